"""Weight-free rewards for the quick start and the tests, plus the image helpers every reward shares.

Both rewards are learnable signals that need no model download, so a CPU run can show the reward curve
move within a few rollouts:

- `jpeg_compressibility` (DDPO, arXiv 2305.13301): minus the JPEG size of the image in kB at quality 95.
  Smooth, flat images compress well and score higher.
- `brightness`: the mean pixel intensity in [0, 1].

A video reward is the mean over its frames.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from miles.config.sections import RewardConfig
from miles.types import Sample
from miles.utils.errors import MilesUserError

JPEG_QUALITY = 95


def frames_uint8(sample: Sample) -> np.ndarray:
    """The sample's pixels as RGB uint8 [F, H, W, 3].

    Engines return uint8 already; a float tensor in [0, 1] (a user's custom generate) is converted by
    `round(clamp(x, 0, 1) · 255)` (docs/algorithms.md §10).
    """
    image = sample.image
    if image is None:
        raise MilesUserError(f"sample {sample.index} (prompt {sample.prompt[:60]!r}) has no image to score")
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8:
            image = torch.round(image.detach().float().clamp(0, 1) * 255).to(torch.uint8)
        array = image.detach().cpu().numpy()
    else:
        array = np.asarray(image)
        if array.dtype != np.uint8:
            array = np.round(np.clip(array.astype(np.float32), 0, 1) * 255).astype(np.uint8)
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4 or array.shape[-1] != 3:
        raise MilesUserError(
            f"sample {sample.index} (prompt {sample.prompt[:60]!r}): image must be [F, H, W, 3], got {list(array.shape)}"
        )
    return array


def jpeg_size_kb(frame: np.ndarray, quality: int = JPEG_QUALITY) -> float:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def jpeg_compressibility_score(frames: np.ndarray) -> float:
    """−(JPEG size in kB at quality 95), averaged over frames."""
    return -float(np.mean([jpeg_size_kb(frame) for frame in frames]))


def brightness_score(frames: np.ndarray) -> float:
    """Mean pixel intensity in [0, 1]."""
    return float(frames.astype(np.float64).mean() / 255.0)


async def jpeg_compressibility_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    return [jpeg_compressibility_score(frames_uint8(sample)) for sample in samples]


async def brightness_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    return [brightness_score(frames_uint8(sample)) for sample in samples]
