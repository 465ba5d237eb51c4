"""Which denoising steps of a rollout are SDE steps (docs/algorithms.md §3).

A strategy is `f(settings, sample, num_steps, seed) -> (sde_step_indices, return_latent_indices)`: S ⊂ {0..n−1}
(sorted), and the latent indices the engine must return, sorted(S ∪ (S+1)) for the built-ins. Every step not in
S is an ODE step with log-prob 0 and is never trained. Public dotted paths:
`miles.rollout.step_strategy_hub.sde_window` and `miles.rollout.step_strategy_hub.epoch_global_random_choice`.

The built-ins read a `StepStrategyConfig` (`config.step_strategy`); its fields are named after the flags' dests,
so a user's strategy that calls a built-in with its own `args` gets the same answer. A user's strategy
(`--diffusion-step-strategy-path`) receives the read-only `args` (miles/rollout/hooks.py converts).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from miles.config.rollout_sections import StepStrategyConfig
from miles.config.sections import RunConfig
from miles.rollout.hooks import hook_args_of
from miles.utils.errors import MilesUserError

__all__ = [
    "StepStrategy",
    "request_seed",
    "return_latents_for",
    "sde_window",
    "epoch_global_random_choice",
    "ode_and_return_last",
    "all_steps_or_window",
    "resolve_step_strategy",
    "validate_step_selection",
]

StepStrategy = Callable[[Any, Any, int, int], tuple[list[int], list[int]]]
SEED_MODULUS = 2**31
STRATEGY_FLAG = "--diffusion-step-strategy-path"


def request_seed(rollout_seed: int, group_index: int, n_samples_per_prompt: int, offset: int) -> int:
    """`(rollout_seed + group_index·G) mod 2^31 + offset` (§3): the seed of the microgroup whose first sample sits at
    `offset` in its group; its samples' noises use seed, seed+1, ..."""
    return (rollout_seed + group_index * n_samples_per_prompt) % SEED_MODULUS + offset


def return_latents_for(sde_step_indices: Sequence[int]) -> list[int]:
    """sorted(S ∪ (S+1)): each SDE step needs x_k and x_{k+1}."""
    return sorted(set(sde_step_indices) | {k + 1 for k in sde_step_indices})


def _window_range(settings: StepStrategyConfig, num_steps: int) -> tuple[int, int]:
    window = settings.diffusion_sde_window_range
    if window is None:
        return 0, num_steps
    if isinstance(window, str):
        window = [part for part in window.split(",") if part.strip()]
    try:
        lo, hi = (int(v) for v in window)
    except (TypeError, ValueError) as err:
        raise MilesUserError(f"--diffusion-sde-window-range {window!r}: expected 'lo,hi'") from err
    return lo, hi


def sde_window(settings: StepStrategyConfig, sample, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """K contiguous SDE steps at a random start in [lo, hi−K], drawn with `numpy.random.default_rng(seed)` (§3).

    K = `--diffusion-num-sde-steps`, [lo, hi) = `--diffusion-sde-window-range` (default [0, n)).
    """
    lo, hi = _window_range(settings, num_steps)
    count = settings.diffusion_num_sde_steps
    if not 0 <= lo < hi <= num_steps:
        raise MilesUserError(
            f"--diffusion-sde-window-range {lo},{hi}: need 0 <= lo < hi <= {num_steps} (--diffusion-num-steps)"
        )
    if not 1 <= count <= hi - lo:
        raise MilesUserError(
            f"--diffusion-num-sde-steps {count}: sde_window needs 1 <= K <= {hi - lo} (the window [{lo}, {hi}))"
        )
    start = int(np.random.default_rng(seed).integers(lo, hi - count + 1))
    steps = list(range(start, start + count))
    return steps, return_latents_for(steps)


def _candidate_steps(settings: StepStrategyConfig, num_steps: int) -> list[int]:
    candidates = settings.diffusion_sde_candidate_steps
    if isinstance(candidates, str):
        candidates = [part for part in candidates.split(",") if part.strip()]
    if not candidates:
        raise MilesUserError("epoch_global_random_choice needs --diffusion-sde-candidate-steps 'i,j,...'")
    try:
        values = [int(c) for c in candidates]
    except (TypeError, ValueError) as err:
        raise MilesUserError(f"--diffusion-sde-candidate-steps {candidates!r}: expected integers") from err
    if len(set(values)) != len(values):
        raise MilesUserError(f"--diffusion-sde-candidate-steps {values}: duplicate steps")
    bad = [v for v in values if not 0 <= v < num_steps]
    if bad:
        raise MilesUserError(f"--diffusion-sde-candidate-steps {values}: {bad} outside [0, {num_steps})")
    return values


def epoch_global_random_choice(settings: StepStrategyConfig, sample, num_steps: int,
                               seed: int) -> tuple[list[int], list[int]]:
    """K of the candidate steps, shared by every sample of one rollout "epoch" (§3).

    e = group_index // rollout_batch_size; S = sorted(C[p] for p in randperm(|C|)[:K]) with a torch generator seeded
    `e + rollout_seed`. K ≥ |C| (or K = 0, "no subset selection") gives all candidates. `seed` is unused.
    """
    candidates = _candidate_steps(settings, num_steps)
    count = settings.diffusion_num_sde_steps
    if count < 0:
        raise MilesUserError(f"--diffusion-num-sde-steps {count}: must be >= 0")
    if count == 0 or count >= len(candidates):
        steps = sorted(candidates)
    else:
        epoch = sample.group_index // settings.rollout_batch_size
        generator = torch.Generator().manual_seed(epoch + settings.rollout_seed)
        order = torch.randperm(len(candidates), generator=generator)[:count]
        steps = sorted(candidates[p] for p in order.tolist())
    return steps, return_latents_for(steps)


def ode_and_return_last(settings: StepStrategyConfig, sample, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """NFT rollouts (§6): no SDE step, return only the final latent x_n."""
    return [], [num_steps]


def all_steps_or_window(settings: StepStrategyConfig, sample, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """The bare `--diffusion-num-sde-steps` K (§3, SPEC): K = 0 ⇒ every step is an SDE step; K > 0 ⇒ `sde_window`."""
    count = settings.diffusion_num_sde_steps
    if count < 0:
        raise MilesUserError(f"--diffusion-num-sde-steps {count}: must be >= 0")
    if count == 0:
        steps = list(range(num_steps))
        return steps, return_latents_for(steps)
    return sde_window(settings, sample, num_steps, seed)


def validate_step_selection(
    sde_step_indices: Sequence[int], return_latent_indices: Sequence[int], num_steps: int, source: str
) -> tuple[list[int], list[int]]:
    """Check a strategy's answer: S sorted unique in [0, n); return latents sorted unique in [0, n] ⊇ S ∪ (S+1)."""
    try:
        steps = [int(k) for k in sde_step_indices]
        latents = [int(k) for k in return_latent_indices]
    except (TypeError, ValueError) as err:
        raise MilesUserError(f"{source}: step indices must be integers: {err}") from err
    if steps != sorted(set(steps)) or any(not 0 <= k < num_steps for k in steps):
        raise MilesUserError(f"{source}: SDE steps {steps} must be sorted, unique and in [0, {num_steps})")
    if latents != sorted(set(latents)) or any(not 0 <= k <= num_steps for k in latents):
        raise MilesUserError(f"{source}: return latents {latents} must be sorted, unique and in [0, {num_steps}]")
    missing = set(return_latents_for(steps)) - set(latents)
    if missing:
        raise MilesUserError(f"{source}: return latents {latents} miss {sorted(missing)} needed by SDE steps {steps}")
    return steps, latents


BUILT_IN_STRATEGIES = (sde_window, epoch_global_random_choice, ode_and_return_last, all_steps_or_window)


def _settings(config: RunConfig | StepStrategyConfig) -> StepStrategyConfig:
    return config.step_strategy if isinstance(config, RunConfig) else config


def _checked(strategy: Callable, source: str) -> StepStrategy:
    """`strategy` called as `run(config, sample, num_steps, seed)` with `config` the run's `RunConfig`: a built-in
    gets `config.step_strategy`, a user's strategy the read-only `args`; the answer is checked."""
    user = strategy not in BUILT_IN_STRATEGIES

    @functools.wraps(strategy)
    def run(config, sample, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
        result = strategy(hook_args_of(config) if user else _settings(config), sample, num_steps, seed)
        if not (isinstance(result, tuple | list) and len(result) == 2):
            raise MilesUserError(f"{source}: must return (sde_step_indices, return_latent_indices), got {result!r}")
        return validate_step_selection(result[0], result[1], num_steps, source)

    return run


def resolve_step_strategy(config: RunConfig | StepStrategyConfig) -> StepStrategy:
    """The strategy for this run: `--diffusion-step-strategy-path` if given; `ode_and_return_last` under
    `--loss-type nft` with `--diffusion-sde-type ode`; else the bare count. The result validates its answers;
    the underlying function is `result.__wrapped__`."""
    settings = _settings(config)
    path = settings.diffusion_step_strategy_path
    if path:
        from miles.utils.imports import load_function

        return _checked(load_function(path, STRATEGY_FLAG, required_params=4), f"{STRATEGY_FLAG} {path}")
    if settings.loss_type == "nft" and settings.diffusion_sde_type == "ode":
        return _checked(ode_and_return_last, "ode_and_return_last")
    return _checked(all_steps_or_window, "--diffusion-num-sde-steps")
