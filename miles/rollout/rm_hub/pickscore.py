"""PickScore reward (Pick-a-Pic, arXiv 2305.01569), docs/algorithms.md §10.

`score = exp(logit_scale) · ⟨t/‖t‖, i/‖i‖⟩ / 26` per (prompt, frame) pair, with the CLIP processor's own
preprocessing (shortest-side resize + center crop, CLIP mean/std; text padded and truncated to 77 tokens).
A video scores the frames chosen by `pickscore_frame_indices` and its reward is their mean.

Where it runs: with Ray initialised, a pool of `--pickscore-num-workers` actors, each holding
`--pickscore-num-gpus-per-worker` GPUs (fractional values share a GPU); without Ray, one scorer in this
process. Either way the (prompt, frame) pairs are cut into batches of `--pickscore-batch-size`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Sequence

import numpy as np
import torch

from miles.rollout.rm_hub.builtin import frames_uint8
from miles.types import Sample
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

PICKSCORE_SCALE = 26.0  # maps the ≈[0, 26] logit range to ≈[0, 1]
TEXT_MAX_LENGTH = 77


def pickscore_frame_indices(num_frames: int, num_sampled: int | None) -> list[int]:
    """Which frames of an F-frame video are scored (§10): all if k is unset or F ≤ k; [⌊F/2⌋] if k = 1;
    else round(i·(F−1)/(k−1)) for i = 0..k−1."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if num_sampled is None or num_frames <= num_sampled:
        return list(range(num_frames))
    if num_sampled < 1:
        raise MilesUserError(f"--pickscore-num-frames must be >= 1, got {num_sampled}")
    if num_sampled == 1:
        return [num_frames // 2]
    return [int(round(i * (num_frames - 1) / (num_sampled - 1))) for i in range(num_sampled)]


def _projected(features: Any) -> torch.Tensor:
    """transformers 4 returns the projected embedding; transformers 5 an output whose pooler_output holds it."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


class PickScoreScorer:
    """CLIP processor + model, scoring (prompt, RGB uint8 frame) pairs one batch at a time."""

    def __init__(self, processor_path: str, model_path: str, device: str | None = None):
        from transformers import AutoModel, AutoProcessor

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            self.processor = AutoProcessor.from_pretrained(processor_path)
        except Exception as err:
            raise MilesUserError(f"--pickscore-processor-path {processor_path!r}: cannot load the CLIP processor: {err}") from err
        try:
            self.model = AutoModel.from_pretrained(model_path, dtype=torch.float32).to(self.device).eval()
        except Exception as err:
            raise MilesUserError(f"--pickscore-model-path {model_path!r}: cannot load the CLIP model: {err}") from err
        self._lock = threading.Lock()  # one forward at a time when called from several threads

    @torch.no_grad()
    def score(self, prompts: Sequence[str], frames: Sequence[np.ndarray]) -> list[float]:
        """One score per pair (the diagonal of the prompt × image similarity)."""
        from PIL import Image

        assert len(prompts) == len(frames)
        images = [Image.fromarray(frame) for frame in frames]
        with self._lock:
            image_inputs = self.processor(images=images, return_tensors="pt")
            text_inputs = self.processor(
                text=list(prompts), padding=True, truncation=True, max_length=TEXT_MAX_LENGTH, return_tensors="pt"
            )
            image_embeds = _projected(self.model.get_image_features(pixel_values=image_inputs["pixel_values"].to(self.device)))
            text_embeds = _projected(
                self.model.get_text_features(
                    input_ids=text_inputs["input_ids"].to(self.device),
                    attention_mask=text_inputs["attention_mask"].to(self.device),
                )
            )
            image_embeds = image_embeds.float() / image_embeds.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
            text_embeds = text_embeds.float() / text_embeds.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
            scores = self.model.logit_scale.float().exp() * (text_embeds * image_embeds).sum(dim=-1) / PICKSCORE_SCALE
        return scores.cpu().tolist()


class PickScorePool:
    """Ray actors when Ray is up, else one in-process scorer; `score` spreads batches over the workers."""

    def __init__(self, args, scheduling_strategy: Any | None = None, actor_options: Sequence[dict] | None = None):
        """`actor_options`: one dict of Ray options per worker (the run's placement, miles.ray.placement), which
        then replace `--pickscore-num-workers` / `--pickscore-num-gpus-per-worker` and `scheduling_strategy`."""
        processor_path = getattr(args, "pickscore_processor_path", None)
        model_path = getattr(args, "pickscore_model_path", None)
        if not processor_path or not model_path:
            raise MilesUserError("--rm-type pickscore needs --pickscore-model-path and --pickscore-processor-path")
        self.batch_size = int(getattr(args, "pickscore_batch_size", 8) or 8)
        if self.batch_size < 1:
            raise MilesUserError(f"--pickscore-batch-size must be >= 1, got {self.batch_size}")
        self.actors: list[Any] = []
        self.local: PickScoreScorer | None = None
        import ray

        if ray.is_initialized() and actor_options is not None:
            actor_class = ray.remote(PickScoreScorer)
            self.actors = [actor_class.options(**options).remote(processor_path, model_path) for options in actor_options]
            logger.info("PickScore: %d Ray workers on the run's placement", len(self.actors))
        elif ray.is_initialized():
            num_workers = int(getattr(args, "pickscore_num_workers", 1) or 1)
            num_gpus = float(getattr(args, "pickscore_num_gpus_per_worker", 1.0))
            if num_gpus > 0 and ray.cluster_resources().get("GPU", 0) == 0:
                logger.warning("no GPU in the Ray cluster: PickScore workers run on CPU")
                num_gpus = 0.0
            actor_class = ray.remote(PickScoreScorer)
            options: dict[str, Any] = {"num_gpus": num_gpus, "num_cpus": 1}
            if scheduling_strategy is not None:
                options["scheduling_strategy"] = scheduling_strategy
            self.actors = [
                actor_class.options(**options).remote(processor_path, model_path) for _ in range(num_workers)
            ]
            logger.info("PickScore: %d Ray workers with %.2f GPU each", num_workers, num_gpus)
        else:
            self.local = PickScoreScorer(processor_path, model_path)

    async def score(self, prompts: Sequence[str], frames: Sequence[np.ndarray]) -> list[float]:
        batches = [
            (list(prompts[start : start + self.batch_size]), list(frames[start : start + self.batch_size]))
            for start in range(0, len(prompts), self.batch_size)
        ]
        if self.actors:
            refs = [
                self.actors[i % len(self.actors)].score.remote(batch_prompts, batch_frames)
                for i, (batch_prompts, batch_frames) in enumerate(batches)
            ]
            results = await asyncio.gather(*refs)
        else:
            results = [await asyncio.to_thread(self.local.score, p, f) for p, f in batches]
        return [score for batch in results for score in batch]

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


_POOLS: dict[tuple, PickScorePool] = {}


def get_pickscore_pool(args, scheduling_strategy: Any | None = None,
                       actor_options: Sequence[dict] | None = None) -> PickScorePool:
    """The pool for these flags, created on first use (the RolloutManager creates it up front with each worker's
    placement: `actor_options`, see `PickScorePool`)."""
    import ray

    key = (
        getattr(args, "pickscore_processor_path", None),
        getattr(args, "pickscore_model_path", None),
        getattr(args, "pickscore_num_workers", 1),
        getattr(args, "pickscore_num_gpus_per_worker", 1.0),
        getattr(args, "pickscore_batch_size", 8),
        ray.is_initialized(),
    )
    if key not in _POOLS:
        _POOLS[key] = PickScorePool(args, scheduling_strategy, actor_options)
    return _POOLS[key]


def shutdown_pickscore_pools() -> None:
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()


async def pickscore_rm(args, samples: Sequence[Sample]) -> list[float]:
    """Mean PickScore over each sample's selected frames (§10)."""
    num_sampled = getattr(args, "pickscore_num_frames", None)
    prompts: list[str] = []
    frames: list[np.ndarray] = []
    owners: list[int] = []
    for position, sample in enumerate(samples):
        video = frames_uint8(sample)
        for frame_index in pickscore_frame_indices(video.shape[0], num_sampled):
            prompts.append(sample.prompt)
            frames.append(video[frame_index])
            owners.append(position)
    scores = await get_pickscore_pool(args).score(prompts, frames)
    totals = [0.0] * len(samples)
    counts = [0] * len(samples)
    for owner, score in zip(owners, scores):
        totals[owner] += score
        counts[owner] += 1
    return [total / count for total, count in zip(totals, counts)]
