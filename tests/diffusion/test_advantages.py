"""GRPO advantages (docs/algorithms.md §4; invariant §11.13)."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.advantages import GRPO_STD_EPS, clip_advantages, compute_grpo_advantages
from miles.utils.errors import MilesUserError


def _rewards(prompts: int, group: int) -> torch.Tensor:
    return torch.rand(prompts * group) * 3 - 1


def test_per_group_mean_and_unbiased_std():
    prompts, group = 5, 4
    rewards = _rewards(prompts, group)
    adv, stats = compute_grpo_advantages(rewards, group, False, False, False)
    assert adv.dtype == torch.float32 and adv.shape == (prompts * group,)
    grouped_adv = adv.double().reshape(prompts, group)
    grouped = rewards.double().reshape(prompts, group)
    sd = grouped.std(dim=1)
    assert torch.allclose(grouped_adv.mean(1), torch.zeros(prompts, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(grouped_adv.std(1), sd / (sd + GRPO_STD_EPS), atol=1e-5)
    assert torch.allclose(grouped_adv, (grouped - grouped.mean(1, keepdim=True)) / (sd[:, None] + 1e-4), atol=1e-5)
    assert stats["zero_std_ratio"] == 0.0


def test_constant_group_gives_exact_zeros():
    rewards = _rewards(3, 4)
    rewards[4:8] = 0.1  # 0.1 is not exactly representable: the group mean need not equal it
    adv, stats = compute_grpo_advantages(rewards, 4, False, False, False)
    assert torch.equal(adv[4:8], torch.zeros(4))
    assert stats["zero_std_ratio"] == pytest.approx(1 / 3)
    adv_dr, _ = compute_grpo_advantages(rewards, 4, False, False, True)
    assert torch.equal(adv_dr[4:8], torch.zeros(4))


def test_globalized_mean_and_std_use_the_whole_batch():
    rewards = _rewards(4, 3)
    flat = rewards.double()
    adv, _ = compute_grpo_advantages(rewards, 3, True, True, False)
    assert torch.allclose(adv.double(), (flat - flat.mean()) / (flat.std() + 1e-4), atol=1e-6)
    # per-group mean + global std (the Flow-GRPO PickScore recipe)
    adv, _ = compute_grpo_advantages(rewards, 3, False, True, False)
    grouped = flat.reshape(4, 3)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (flat.std() + 1e-4)
    assert torch.allclose(adv.double(), expected.reshape(-1), atol=1e-6)
    # global mean + per-group std
    adv, _ = compute_grpo_advantages(rewards, 3, True, False, False)
    expected = (grouped - flat.mean()) / (grouped.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(adv.double(), expected.reshape(-1), atol=1e-5)


def test_dr_grpo_has_no_division():
    rewards = _rewards(3, 5)
    adv, _ = compute_grpo_advantages(rewards, 5, False, False, True)
    grouped = rewards.double().reshape(3, 5)
    assert torch.allclose(adv.double(), (grouped - grouped.mean(1, keepdim=True)).reshape(-1), atol=1e-6)


def test_single_sample_groups_disable_std():
    rewards = _rewards(6, 1)
    adv, _ = compute_grpo_advantages(rewards, 1, False, False, False)
    assert torch.equal(adv, torch.zeros(6)), "per-group baseline of one sample: no signal"
    adv, _ = compute_grpo_advantages(rewards, 1, True, True, False)
    flat = rewards.double()
    assert torch.allclose(adv.double(), flat - flat.mean(), atol=1e-6), "std forced off for G = 1"


def test_clip():
    adv = torch.randn(100) * 10
    clipped = clip_advantages(adv, 5.0)
    assert clipped.max() <= 5.0 and clipped.min() >= -5.0
    inside = adv.abs() <= 5
    assert torch.equal(clipped[inside], adv[inside])
    with pytest.raises(MilesUserError, match="--diffusion-adv-clip-max"):
        clip_advantages(adv, 0.0)


def test_errors():
    with pytest.raises(MilesUserError, match="--n-samples-per-prompt"):
        compute_grpo_advantages(torch.rand(7), 2, False, False, False)
    with pytest.raises(MilesUserError):
        compute_grpo_advantages(torch.rand(4), 0, False, False, False)
    with pytest.raises(MilesUserError, match="NaN"):
        compute_grpo_advantages(torch.tensor([1.0, float("nan")]), 2, False, False, False)
