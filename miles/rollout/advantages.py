"""Rewards → advantages for one rollout batch, and the `rollout/*` reward metrics.

`assign_advantages` runs the math core's GRPO (docs/algorithms.md §4) on the scalar rewards
(`reward_value`: `--reward-key` picks from dict rewards, `--reward-weights` sums their components), or `--custom-reward-post-process-path`
`fn(args, samples) -> list[float]`, which replaces §4 steps 1–3 wholesale. Samples must be ordered
group-contiguously (`--n-samples-per-prompt` per prompt). Samples masked by `--rollout-sample-filter-path`
still count in the statistics (§4). Each component of dict rewards is logged as `rollout/reward/<name>_mean` and
`_std` beside the scalar's `rollout/reward_mean`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from miles.config.sections import RunConfig
from miles.diffusion.advantages import compute_grpo_advantages
from miles.rollout.hooks import with_hook_args
from miles.rollout.rm_hub import reward_component_metrics, reward_value
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function

METRIC_PREFIX = "rollout/"


def _check_group_order(samples: Sequence[Sample], group_size: int) -> None:
    if len(samples) % group_size != 0:
        raise MilesUserError(
            f"{len(samples)} samples do not form whole groups of --n-samples-per-prompt {group_size}"
        )
    for start in range(0, len(samples), group_size):
        group = samples[start : start + group_size]
        if len({sample.group_index for sample in group}) != 1:
            raise MilesUserError(
                f"samples {start}..{start + group_size - 1} are not one prompt group (group indices "
                f"{[sample.group_index for sample in group]}): advantages need group-contiguous samples"
            )


def _zero_std_ratio(rewards: torch.Tensor, group_size: int) -> float:
    grouped = rewards.reshape(-1, group_size)
    return (grouped.amax(dim=1) == grouped.amin(dim=1)).double().mean().item()


def assign_advantages(config: RunConfig, samples: Sequence[Sample]) -> dict[str, float]:
    """Write `sample.advantage` for every sample; return the rollout's reward/advantage metrics."""
    samples = list(samples)
    if not samples:
        raise MilesUserError("no samples to compute advantages for (did every group get filtered out?)")
    reward = config.reward
    group_size = config.data.n_samples_per_prompt
    _check_group_order(samples, group_size)
    rewards = torch.tensor([reward_value(config.reward_selection, sample.reward) for sample in samples],
                           dtype=torch.float64)

    post_process_path = reward.custom_reward_post_process_path
    if post_process_path:
        fn = load_function(post_process_path, "--custom-reward-post-process-path", required_params=2)
        advantages = list(with_hook_args(fn, config)(samples))
        if len(advantages) != len(samples):
            raise MilesUserError(
                f"--custom-reward-post-process-path {post_process_path!r} returned {len(advantages)} values "
                f"for {len(samples)} samples"
            )
        values = []
        for sample, value in zip(samples, advantages):
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
            if not math.isfinite(value):
                raise MilesUserError(
                    f"--custom-reward-post-process-path {post_process_path!r} returned {value} for sample "
                    f"{sample.index} (prompt {sample.prompt[:60]!r})"
                )
            values.append(value)
        advantage_tensor = torch.tensor(values, dtype=torch.float64)
        zero_std_ratio = _zero_std_ratio(rewards, group_size)
    else:
        advantage_tensor, stats = compute_grpo_advantages(
            rewards,
            group_size,
            globalize_mean=reward.globalize_reward_mean,
            globalize_std=reward.globalize_reward_std,
            disable_std_normalization=reward.disable_grpo_std_normalization,
        )
        zero_std_ratio = float(stats["zero_std_ratio"])

    for sample, advantage in zip(samples, advantage_tensor.tolist()):
        sample.advantage = float(advantage)
    return {
        f"{METRIC_PREFIX}reward_mean": rewards.mean().item(),
        f"{METRIC_PREFIX}reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        f"{METRIC_PREFIX}reward_min": rewards.min().item(),
        f"{METRIC_PREFIX}reward_max": rewards.max().item(),
        f"{METRIC_PREFIX}zero_std_ratio": zero_std_ratio,
        f"{METRIC_PREFIX}advantage_abs_mean": advantage_tensor.abs().mean().item(),
        f"{METRIC_PREFIX}num_masked_samples": float(sum(sample.remove_sample for sample in samples)),
        **reward_component_metrics([sample.reward for sample in samples], METRIC_PREFIX),
    }
