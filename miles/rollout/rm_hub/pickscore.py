"""PickScore reward (Pick-a-Pic, arXiv 2305.01569), docs/algorithms.md §10.

`score = exp(logit_scale) · ⟨t/‖t‖, i/‖i‖⟩ / 26` per (prompt, frame) pair, with the CLIP processor's own
preprocessing (shortest-side resize + center crop, CLIP mean/std; text padded and truncated to 77 tokens).
A video scores the frames chosen by `pickscore_frame_indices` and its reward is their mean.

Where it runs (miles/rollout/rm_hub/workers.py): with Ray initialised, a pool of `--pickscore-num-workers`
actors, each holding `--pickscore-num-gpus-per-worker` GPUs (fractional values share a GPU); without Ray, one
scorer in this process. Either way the (prompt, frame) pairs are cut into batches of `--pickscore-batch-size`.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.clip_models import (
    default_device,
    frame_indices,
    image_embeddings,
    load_clip_model,
    load_clip_processor,
    mean_over_frames,
    text_embeddings,
)
from miles.rollout.rm_hub.workers import ScorerPool, get_scorer_pool, shutdown_scorer_pools
from miles.types import Sample
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

PICKSCORE_SCALE = 26.0  # maps the ≈[0, 26] logit range to ≈[0, 1]

pickscore_frame_indices = frame_indices  # the frame rule of §10, shared by the CLIP-based rewards


class PickScoreScorer:
    """CLIP processor + model, scoring (prompt, RGB uint8 frame) pairs one batch at a time."""

    def __init__(self, processor_path: str, model_path: str, device: str | None = None):
        self.device = default_device(device)
        self.processor = load_clip_processor(processor_path, "--pickscore-processor-path")
        self.model = load_clip_model(model_path, "--pickscore-model-path", self.device)
        self._lock = threading.Lock()  # one forward at a time when called from several threads

    @torch.no_grad()
    def score(self, prompts: Sequence[str], frames: Sequence[np.ndarray]) -> list[float]:
        """One score per pair (the diagonal of the prompt × image similarity)."""
        assert len(prompts) == len(frames)
        with self._lock:
            image_embeds = image_embeddings(self.model, self.processor, frames, self.device)
            text_embeds = text_embeddings(self.model, self.processor, prompts, self.device)
            scores = self.model.logit_scale.float().exp() * (text_embeds * image_embeds).sum(dim=-1) / PICKSCORE_SCALE
        return scores.cpu().tolist()


def get_pickscore_pool(reward_config: RewardConfig) -> ScorerPool:
    """The PickScore workers for these flags, created (and loaded) on first use."""
    processor_path = reward_config.pickscore_processor_path
    model_path = reward_config.pickscore_model_path
    if not processor_path or not model_path:
        raise MilesUserError("--rm-type pickscore needs --pickscore-model-path and --pickscore-processor-path")
    return get_scorer_pool(
        "pickscore",
        PickScoreScorer,
        (processor_path, model_path),
        reward_config.pickscore_num_workers,
        reward_config.pickscore_num_gpus_per_worker,
        reward_config.pickscore_batch_size,
    )


def shutdown_pickscore_pools() -> None:
    """Kill the model rewards' workers: PickScore's and, since all share one registry (workers.py), the others'."""
    shutdown_scorer_pools()


async def pickscore_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    """Mean PickScore over each sample's selected frames (§10)."""
    pool = get_pickscore_pool(reward_config)
    return await mean_over_frames(samples, reward_config.pickscore_num_frames, pool.score)
