"""Weight-free rewards: jpeg_compressibility (DDPO) and brightness."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.rm_hub.builtin import brightness_score, frames_uint8, jpeg_compressibility_score
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


def _sample(pixels: np.ndarray, prompt: str = "p", index: int = 0) -> Sample:
    return Sample(prompt=prompt, index=index, image=torch.from_numpy(pixels))


def test_jpeg_compressibility_is_minus_kilobytes_at_quality_95():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=95)
    assert jpeg_compressibility_score(noise[None]) == pytest.approx(-len(buffer.getvalue()) / 1000.0)


def test_flat_image_compresses_better_than_noise():
    rng = np.random.default_rng(0)
    flat = np.full((1, 32, 32, 3), 128, np.uint8)
    noise = rng.integers(0, 256, size=(1, 32, 32, 3), dtype=np.uint8)
    args = hook_args(rm_type="jpeg_compressibility")
    flat_reward, noise_reward = asyncio.run(batched_async_rm(args, [_sample(flat), _sample(noise, index=1)]))
    assert flat_reward > noise_reward


def test_brightness_range_and_video_mean():
    black = np.zeros((1, 8, 8, 3), np.uint8)
    white = np.full((1, 8, 8, 3), 255, np.uint8)
    assert brightness_score(black) == 0.0
    assert brightness_score(white) == 1.0
    video = np.concatenate([black, white])  # two frames: mean of 0 and 1
    args = hook_args(rm_type="brightness")
    assert asyncio.run(batched_async_rm(args, [_sample(video)])) == [pytest.approx(0.5)]


def test_float_images_are_rounded_like_section_10():
    image = torch.tensor([[[[0.5, 1.2, -0.1]]]])  # [1, 1, 1, 3]
    frames = frames_uint8(Sample(prompt="p", image=image))
    assert frames.dtype == np.uint8
    assert frames.tolist() == [[[[128, 255, 0]]]]


def test_missing_or_misshapen_image_is_a_user_error():
    with pytest.raises(MilesUserError, match="has no image"):
        frames_uint8(Sample(prompt="a cat", index=3))
    with pytest.raises(MilesUserError, match=r"\[F, H, W, 3\]"):
        frames_uint8(Sample(prompt="a cat", image=torch.zeros(2, 4, 4, 4, dtype=torch.uint8)))
