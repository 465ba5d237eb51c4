"""Step strategies (docs/algorithms.md §3; invariant §11.14)."""

from __future__ import annotations

import random
import textwrap
from argparse import Namespace

import numpy as np
import pytest
import torch

from miles.rollout.step_strategy_hub import (
    all_steps_or_window,
    epoch_global_random_choice,
    ode_and_return_last,
    request_seed,
    resolve_step_strategy,
    return_latents_for,
    sde_window,
    validate_step_selection,
)
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_object


def _args(**kw) -> Namespace:
    base = dict(
        diffusion_num_sde_steps=0,
        diffusion_sde_window_range=None,
        diffusion_sde_candidate_steps=None,
        diffusion_step_strategy_path=None,
        rollout_seed=42,
        rollout_batch_size=4,
        loss_type="policy_loss",
        diffusion_sde_type="sde",
    )
    base.update(kw)
    return Namespace(**base)


def _sample(group_index: int = 0) -> Sample:
    return Sample(prompt="a cat", group_index=group_index)


def test_request_seed():
    assert request_seed(42, 0, 8, 0) == 42
    assert request_seed(42, 3, 8, 5) == 42 + 24 + 5
    assert request_seed(2**31 - 1, 1, 4, 2) == (2**31 - 1 + 4) % 2**31 + 2


def test_return_latents():
    assert return_latents_for([2, 3, 7]) == [2, 3, 4, 7, 8]
    assert return_latents_for([]) == []


def test_sde_window_contiguous_inside_range_and_seeded():
    num_steps, count = 10, 3
    lo, hi = 2, 9
    args = _args(diffusion_num_sde_steps=count, diffusion_sde_window_range=[lo, hi])
    seen = set()
    for seed in random.sample(range(10**6), 200):
        steps, latents = sde_window(args, _sample(), num_steps, seed)
        assert steps == list(range(steps[0], steps[0] + count))
        assert lo <= steps[0] and steps[-1] < hi
        assert latents == sorted(set(steps) | {k + 1 for k in steps})
        assert steps[0] == int(np.random.default_rng(seed).integers(lo, hi - count + 1))
        assert sde_window(args, _sample(), num_steps, seed) == (steps, latents), "deterministic per seed"
        seen.add(steps[0])
    assert seen == set(range(lo, hi - count + 1)), "every start in [lo, hi − K] is reachable"


def test_sde_window_pinned_and_default_range():
    steps, latents = sde_window(_args(diffusion_num_sde_steps=2, diffusion_sde_window_range=[3, 5]), None, 10, 7)
    assert steps == [3, 4] and latents == [3, 4, 5]
    steps, _ = sde_window(_args(diffusion_num_sde_steps=10), None, 10, 7)
    assert steps == list(range(10))
    steps, _ = sde_window(_args(diffusion_num_sde_steps=2, diffusion_sde_window_range="3,5"), None, 10, 7)
    assert steps == [3, 4]


@pytest.mark.parametrize(
    "count,window,flag",
    [
        (2, [5, 5], "--diffusion-sde-window-range"),
        (2, [-1, 5], "--diffusion-sde-window-range"),
        (2, [3, 11], "--diffusion-sde-window-range"),
        (3, [3, 5], "--diffusion-num-sde-steps"),
        (0, None, "--diffusion-num-sde-steps"),
        (2, [1, 2, 3], "--diffusion-sde-window-range"),
    ],
)
def test_sde_window_rejects_invalid_settings(count, window, flag):
    with pytest.raises(MilesUserError, match=flag):
        sde_window(_args(diffusion_num_sde_steps=count, diffusion_sde_window_range=window), None, 10, 0)


def test_epoch_global_random_choice():
    candidates = [0, 2, 3, 5, 8]
    args = _args(diffusion_num_sde_steps=2, diffusion_sde_candidate_steps=candidates, rollout_batch_size=4)
    per_epoch = {}
    for group_index in range(40):
        steps, latents = epoch_global_random_choice(args, _sample(group_index), 10, seed=group_index * 17)
        assert steps == sorted(steps) and set(steps) <= set(candidates) and len(steps) == 2
        assert latents == return_latents_for(steps)
        epoch = group_index // 4
        per_epoch.setdefault(epoch, steps)
        assert per_epoch[epoch] == steps, "identical within a rollout, independent of the request seed"
        generator = torch.Generator().manual_seed(epoch + 42)
        expected = sorted(candidates[p] for p in torch.randperm(5, generator=generator)[:2].tolist())
        assert steps == expected, "reproducible from (rollout_seed, e)"
    assert len({tuple(s) for s in per_epoch.values()}) > 1, "S changes across rollouts"


def test_epoch_global_random_choice_takes_all_candidates_when_k_covers_them():
    for count in (0, 3, 4):
        args = _args(diffusion_num_sde_steps=count, diffusion_sde_candidate_steps=[7, 1, 4])
        assert epoch_global_random_choice(args, _sample(5), 10, 0)[0] == [1, 4, 7]
    args = _args(diffusion_num_sde_steps=2, diffusion_sde_candidate_steps="1,4,7")
    assert len(epoch_global_random_choice(args, _sample(5), 10, 0)[0]) == 2


@pytest.mark.parametrize("candidates", [None, [], [1, 1, 2], [3, 10], [-1, 2], ["a"]])
def test_epoch_global_random_choice_rejects_bad_candidates(candidates):
    args = _args(diffusion_num_sde_steps=1, diffusion_sde_candidate_steps=candidates)
    with pytest.raises(MilesUserError, match="--diffusion-sde-candidate-steps"):
        epoch_global_random_choice(args, _sample(), 10, 0)


def test_ode_and_return_last():
    assert ode_and_return_last(_args(), _sample(), 10, 0) == ([], [10])


def test_bare_count():
    steps, latents = all_steps_or_window(_args(diffusion_num_sde_steps=0), _sample(), 6, 3)
    assert steps == list(range(6)) and latents == list(range(7))
    args = _args(diffusion_num_sde_steps=2)
    for seed in range(20):
        assert all_steps_or_window(args, _sample(), 10, seed) == sde_window(args, _sample(), 10, seed)
    with pytest.raises(MilesUserError, match="--diffusion-num-sde-steps"):
        all_steps_or_window(_args(diffusion_num_sde_steps=-1), _sample(), 10, 0)


def test_public_dotted_paths_resolve():
    assert load_object("miles.rollout.step_strategy_hub.sde_window", "--x") is sde_window
    assert load_object("miles.rollout.step_strategy_hub.epoch_global_random_choice", "--x") is epoch_global_random_choice


def test_resolve_step_strategy():
    assert resolve_step_strategy(_args()).__wrapped__ is all_steps_or_window
    nft = _args(loss_type="nft", diffusion_sde_type="ode")
    assert resolve_step_strategy(nft).__wrapped__ is ode_and_return_last
    assert resolve_step_strategy(nft)(nft, _sample(), 10, 0) == ([], [10])
    by_path = _args(
        diffusion_step_strategy_path="miles.rollout.step_strategy_hub.sde_window",
        diffusion_num_sde_steps=2,
        loss_type="nft",
        diffusion_sde_type="ode",
    )
    strategy = resolve_step_strategy(by_path)
    assert strategy.__wrapped__ is sde_window, "the path wins over the nft default"
    assert strategy(by_path, _sample(), 10, 11) == sde_window(by_path, _sample(), 10, 11)


def test_user_strategy_is_loaded_and_checked(tmp_path, monkeypatch):
    (tmp_path / "my_strategies.py").write_text(
        textwrap.dedent(
            """
            def last_two(args, sample, num_steps, seed):
                steps = [num_steps - 2, num_steps - 1]
                return steps, [num_steps - 2, num_steps - 1, num_steps]

            def missing_latent(args, sample, num_steps, seed):
                return [1], [1]

            def out_of_range(args, sample, num_steps, seed):
                return [num_steps], [num_steps, num_steps + 1]

            def three_args(args, sample, num_steps):
                return [], []
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    strategy = resolve_step_strategy(_args(diffusion_step_strategy_path="my_strategies.last_two"))
    assert strategy(_args(), _sample(), 10, 0) == ([8, 9], [8, 9, 10])
    for name in ("missing_latent", "out_of_range"):
        strategy = resolve_step_strategy(_args(diffusion_step_strategy_path=f"my_strategies.{name}"))
        with pytest.raises(MilesUserError, match="--diffusion-step-strategy-path"):
            strategy(_args(), _sample(), 10, 0)
    for name in ("three_args", "nope"):
        with pytest.raises(MilesUserError, match="--diffusion-step-strategy-path"):
            resolve_step_strategy(_args(diffusion_step_strategy_path=f"my_strategies.{name}"))


def test_validate_step_selection():
    assert validate_step_selection([1, 2], [1, 2, 3], 5, "x") == ([1, 2], [1, 2, 3])
    assert validate_step_selection([], [5], 5, "x") == ([], [5])
    for steps, latents in (([2, 1], [1, 2, 3]), ([1, 1], [1, 2]), ([1], [1, 2, 2]), ([4], [4, 5, 6])):
        with pytest.raises(MilesUserError):
            validate_step_selection(steps, latents, 5, "x")
