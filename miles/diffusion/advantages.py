"""GRPO advantages (docs/algorithms.md §4; GRPO arXiv 2402.03300, Dr.GRPO arXiv 2503.20783)."""

from __future__ import annotations

import torch

from miles.utils.errors import MilesUserError

__all__ = ["GRPO_STD_EPS", "compute_grpo_advantages", "clip_advantages"]

GRPO_STD_EPS = 1e-4  # added outside the sqrt: A = Ã / (sd + 1e-4)


def compute_grpo_advantages(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    globalize_mean: bool,
    globalize_std: bool,
    disable_std_normalization: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages for one rollout batch of raw rewards, ordered group-contiguously ([P·G], §4).

    1. baseline m: per-group mean, or the batch mean with `globalize_mean`;  2. Ã = R − m;
    3. unless `disable_std_normalization` (Dr.GRPO) or G = 1: A = Ã / (sd + 1e-4) with sd the unbiased per-group
    std, or the unbiased std of all raw rewards with `globalize_std`.
    A group whose rewards are all equal gets exactly A = 0 under the per-group baseline. Computed in fp64,
    returned as fp32 [P·G] with statistics (reward mean/std, zero_std_ratio = fraction of constant groups).
    """
    if n_samples_per_prompt < 1:
        raise MilesUserError(f"--n-samples-per-prompt {n_samples_per_prompt}: must be >= 1")
    flat = rewards.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0 or flat.numel() % n_samples_per_prompt != 0:
        raise MilesUserError(
            f"GRPO advantages: {flat.numel()} rewards do not form whole groups of "
            f"--n-samples-per-prompt {n_samples_per_prompt}"
        )
    if not torch.isfinite(flat).all():
        raise MilesUserError("GRPO advantages: the rollout's rewards contain NaN or inf")
    grouped = flat.reshape(-1, n_samples_per_prompt)
    constant_group = grouped.amax(dim=1) == grouped.amin(dim=1)

    if globalize_mean:
        centered = grouped - grouped.mean()
    else:
        centered = grouped - grouped.mean(dim=1, keepdim=True)
        centered[constant_group] = 0.0  # exact zeros: the mean of equal floats need not equal them

    normalize = not disable_std_normalization and n_samples_per_prompt > 1
    if normalize:
        std = flat.std() if globalize_std else grouped.std(dim=1, keepdim=True)
        advantages = centered / (std + GRPO_STD_EPS)
    else:
        advantages = centered

    advantages = advantages.reshape(-1)
    stats = {
        "raw_reward_mean": flat.mean().item(),
        "raw_reward_std": flat.std().item() if flat.numel() > 1 else 0.0,
        "zero_std_ratio": constant_group.to(torch.float64).mean().item(),
        "advantage_mean": advantages.mean().item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
        "advantage_max": advantages.max().item(),
        "advantage_min": advantages.min().item(),
    }
    return advantages.to(torch.float32), stats


def clip_advantages(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """`A_c = clamp(A, −M, M)` (§4), M = `--diffusion-adv-clip-max`."""
    if adv_clip_max <= 0:
        raise MilesUserError(f"--diffusion-adv-clip-max {adv_clip_max}: must be > 0")
    return advantages.clamp(-adv_clip_max, adv_clip_max)
