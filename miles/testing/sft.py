"""Checks of a family's `encode_images` (SFT's pixels → clean latents) shared by the family tests.

Tiny random VAEs do not reconstruct their input, so a round trip is checked against the VAE itself instead:
the encoded latents have `prepare_latents`' layout, equal a manual diffusers computation, and decode to what
the VAE decodes from its own (un-normalised, unpacked) posterior mean.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.models.base import GenerationShape, TrainPipelineConfig
from miles.models.common import generators_from_seeds


def gradient_pixels(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """uint8 [B, F, H, W, 3]: smooth colour ramps, different per sample, frame and channel."""
    rows = torch.linspace(0.0, 1.0, height)[:, None]
    columns = torch.linspace(0.0, 1.0, width)[None, :]
    images = torch.empty(batch, frames, height, width, 3)
    for b in range(batch):
        for f in range(frames):
            for c in range(3):
                phase = 0.3 * b + 0.2 * f + 0.25 * c
                images[b, f, :, :, c] = 0.5 + 0.45 * torch.sin(3.0 * rows + 2.0 * columns * (c + 1) + phase)
    return (images * 255).round().to(torch.uint8)


def vae_input(pixels: torch.Tensor, video: bool) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] -> the [-1, 1] VAE input, [B, 3, F, H, W] (`video`) or [B, 3, H, W] (frame 0)."""
    images = pixels.float().div(255.0).mul(2.0).sub(1.0).permute(0, 4, 1, 2, 3)
    return images if video else images[:, :, 0]


def check_encode_images(
    family: TrainPipelineConfig,
    pipe: Any,
    shape: GenerationShape,
    pixels: torch.Tensor,
    expected_latents: torch.Tensor,
    expected_pixels: torch.Tensor,
) -> torch.Tensor:
    """Assert (1) `encode_images` gives fp32 latents of `prepare_latents`' shape, (2) equal to
    `expected_latents` (a manual diffusers computation) to 1e-5, (3) whose `decode` is `expected_pixels`
    (the VAE's decode of its raw posterior mean) to within one uint8 level (the normalisation round trip
    rounds in fp32). Returns the encoded latents."""
    latents = family.encode_images(pipe, pixels, shape)
    noise = family.prepare_latents(pipe, shape, generators_from_seeds(range(len(pixels))), torch.float32)
    assert latents.dtype == torch.float32
    assert latents.shape == noise.shape, f"encode_images {tuple(latents.shape)} vs prepare_latents {tuple(noise.shape)}"
    torch.testing.assert_close(latents, expected_latents.float(), rtol=1e-5, atol=1e-5)
    decoded = family.decode(pipe, latents, shape)
    assert decoded.shape == pixels.shape and decoded.dtype == torch.uint8
    assert (decoded.int() - expected_pixels.int()).abs().max() <= 1
    return latents
