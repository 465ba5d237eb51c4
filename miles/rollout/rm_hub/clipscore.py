"""CLIPScore reward (Hessel et al., arXiv 2104.08718): how well the image matches its prompt, reference-free.

`score = 100 · max(cos(t, i), 0)` for the CLIP text embedding t of the prompt and the image embedding i of the
frame (the scale of torchmetrics' CLIPScore; the paper's w = 2.5 is a rescaling of the same number), with the
CLIP processor's own preprocessing. A video scores the frames chosen by `pickscore_frame_indices` with
`--pickscore-num-frames` and its reward is their mean.

`--clipscore-model-path` is one folder with the CLIP model and its processor (e.g. a local copy of
openai/clip-vit-large-patch14). Workers: `--clip-reward-num-workers` Ray actors with
`--clip-reward-num-gpus-per-worker` GPUs each, batches of `--clip-reward-batch-size` pairs
(miles/rollout/rm_hub/workers.py).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.clip_models import (
    default_device,
    image_embeddings,
    load_clip_model,
    load_clip_processor,
    mean_over_frames,
    text_embeddings,
)
from miles.rollout.rm_hub.workers import ScorerPool, get_scorer_pool
from miles.types import Sample
from miles.utils.errors import MilesUserError

CLIPSCORE_SCALE = 100.0


class ClipScoreScorer:
    """One CLIP model scoring (prompt, RGB uint8 frame) pairs."""

    def __init__(self, model_path: str, device: str | None = None):
        self.device = default_device(device)
        self.processor = load_clip_processor(model_path, "--clipscore-model-path")
        self.model = load_clip_model(model_path, "--clipscore-model-path", self.device)
        self._lock = threading.Lock()  # one forward at a time when called from several threads

    @torch.no_grad()
    def score(self, prompts: Sequence[str], frames: Sequence[np.ndarray]) -> list[float]:
        assert len(prompts) == len(frames)
        with self._lock:
            image_embeds = image_embeddings(self.model, self.processor, frames, self.device)
            text_embeds = text_embeddings(self.model, self.processor, prompts, self.device)
            cosine = (text_embeds * image_embeds).sum(dim=-1)
        return (CLIPSCORE_SCALE * cosine.clamp_min(0.0)).cpu().tolist()


def clip_reward_workers(reward_config: RewardConfig) -> tuple[int, float, int]:
    """(workers, GPUs per worker, batch size) of the CLIP-based rewards clipscore and aesthetic."""
    return (
        reward_config.clip_reward_num_workers,
        reward_config.clip_reward_num_gpus_per_worker,
        reward_config.clip_reward_batch_size,
    )


def get_clipscore_pool(reward_config: RewardConfig) -> ScorerPool:
    model_path = reward_config.clipscore_model_path
    if not model_path:
        raise MilesUserError("--rm-type clipscore needs --clipscore-model-path (a CLIP model folder)")
    return get_scorer_pool("clipscore", ClipScoreScorer, (model_path,), *clip_reward_workers(reward_config))


async def clipscore_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    pool = get_clipscore_pool(reward_config)
    return await mean_over_frames(samples, reward_config.pickscore_num_frames, pool.score)
