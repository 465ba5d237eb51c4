"""Sigma schedules of flow-matching samplers (docs/algorithms.md §1, §7).

The values reproduce diffusers' `FlowMatchEulerDiscreteScheduler` bit for bit: its constructor builds the
training table in fp32 (so sigma_min = S_s(1/N) rounded to fp32), `set_timesteps` spaces the inference grid in
fp64 between the fp32 end points, shifts in fp64 and rounds once to fp32. The terminal 0 is appended.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "shift_sigmas",
    "flow_match_sigmas",
    "dynamic_shift_mu",
    "sft_sigma_grid",
    "timesteps_from_sigmas",
    "sigmas_from_timesteps",
]


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The static shift `S_s(u) = s·u / (1 + (s − 1)·u)` (§1), elementwise, in the dtype of `u`."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * u / (1 + (shift - 1) * u)


def _dynamic_shift(u: np.ndarray, mu: float) -> np.ndarray:
    """Resolution-dependent shift `σ = e^μ / (e^μ + 1/u − 1)` (§1, Flux / Qwen-Image).

    Computed in numpy like diffusers: torch's scalar-by-tensor division rounds twice (reciprocal, then
    multiply) and would differ from the scheduler in the last bit.
    """
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def _training_sigmas(shift: float, num_train_timesteps: int, dynamic: bool) -> torch.Tensor:
    """The scheduler constructor's fp32 table `S_s(linspace(1, 1/N, N))` (unshifted when dynamic)."""
    timesteps = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy()
    sigmas = torch.from_numpy(timesteps).to(torch.float32) / num_train_timesteps
    if not dynamic:
        sigmas = shift_sigmas(sigmas, shift)
    return sigmas


def flow_match_sigmas(
    num_steps: int,
    shift: float = 1.0,
    num_train_timesteps: int = 1000,
    mu: float | None = None,
    *,
    sigmas: Sequence[float] | None = None,
) -> torch.Tensor:
    """The n + 1 inference sigmas (terminal 0 included) of diffusers' flow-matching Euler scheduler (§1).

    Static shift `shift` when `mu` is None, otherwise the dynamic shift with e^mu (the scheduler's
    `use_dynamic_shifting=True`; `shift` is then ignored, as in diffusers). `sigmas` optionally passes
    explicit unshifted base sigmas, as pipelines such as Flux do (`np.linspace(1, 1/n, n)`); they are then
    shifted the same way. Returns fp32 values on the CPU.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    dynamic = mu is not None
    if sigmas is None:
        table = _training_sigmas(shift, num_train_timesteps, dynamic)
        sigma_max, sigma_min = table[0].item(), table[-1].item()
        timesteps = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
        base = timesteps / num_train_timesteps  # fp64, like diffusers' numpy path
    else:
        if len(sigmas) != num_steps:
            raise ValueError(f"got {len(sigmas)} base sigmas for {num_steps} steps")
        base = np.array(sigmas).astype(np.float32)
    if dynamic:
        shifted_np = _dynamic_shift(base, mu)
    else:
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        shifted_np = shift * base / (1 + (shift - 1) * base)
    shifted = torch.from_numpy(np.asarray(shifted_np)).to(torch.float32)
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float32)])


def dynamic_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """μ for the dynamic shift: linear in the image token count between (base_seq_len, base_shift) and
    (max_seq_len, max_shift), as the Flux / Qwen-Image pipelines compute it (§1)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def sft_sigma_grid(shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The SFT training grid (§7): `σ = S_s(u)`, `u = linspace(1, 1/N, N)`; N fp32 values, descending.

    This is the scheduler's own training table, so `t = N·σ` matches diffusers' `scheduler.timesteps`.
    """
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    return _training_sigmas(shift, num_train_timesteps, dynamic=False)


def timesteps_from_sigmas(sigmas: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """`t_i = N·σ_i` for the n non-terminal sigmas (§1); the DiT's input convention is the family's business."""
    return sigmas[:-1] * num_train_timesteps


def sigmas_from_timesteps(timesteps: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """`σ = t/N` with the terminal 0 appended (§1: the trainer never recomputes the RL schedule)."""
    sigmas = timesteps.to(torch.float32) / num_train_timesteps
    return torch.cat([sigmas, torch.zeros(1, dtype=sigmas.dtype, device=sigmas.device)])
