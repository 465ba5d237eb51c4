"""Batch geometry of one rollout: prompts -> trajectories -> train pairs -> micro-batches (docs/algorithms.md §3, §5).

Read by the micro-batch rule of `miles.config.validation` and by the `--dry-run` report; it needs the values that
`validate_args` resolves (global_batch_size, num_steps_per_rollout, dp_size, micro_batch_size).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

STEP_STRATEGY_HUB = "miles.rollout.step_strategy_hub"


def step_strategy(args: argparse.Namespace) -> str | None:
    """The step-strategy function name when it is one of the hub's, "custom" for a user's, None for the bare count."""
    path = args.diffusion_step_strategy_path
    if not path:
        return None
    module, _, name = path.replace(":", ".").rpartition(".")
    return name if module == STEP_STRATEGY_HUB else "custom"


def trained_steps_per_trajectory(args: argparse.Namespace) -> tuple[int | None, str]:
    """Train pairs per sample and how that number is chosen (None when a user function decides)."""
    n, k = args.diffusion_num_steps, args.diffusion_num_sde_steps
    if args.loss_type == "sft_loss":
        return 1, "sft_loss: one (image, sigma) pair per sample"
    if args.loss_type == "nft":  # same count as miles.diffusion.losses.nft_train_sigmas (docs/algorithms.md §6)
        kept = max(1, math.floor(n * args.diffusion_nft_timestep_fraction + 1e-9))
        return kept, "nft: max(1, floor(steps x timestep fraction))"
    strategy = step_strategy(args)
    if strategy == "epoch_global_random_choice":
        candidates = args.diffusion_sde_candidate_steps or []
        chosen = len(candidates) if k == 0 else min(k, len(candidates))
        return chosen, "epoch_global_random_choice: K of the candidates (all when K is 0 or >= their count)"
    if strategy == "ode_and_return_last":
        return 0, "ode_and_return_last: no SDE step"
    if strategy in (None, "sde_window", "all_steps_or_window"):
        return (k, "K = --diffusion-num-sde-steps") if k > 0 else (n, "every step (--diffusion-num-sde-steps 0)")
    return None, f"chosen per sample by {args.diffusion_step_strategy_path}"


@dataclass(frozen=True)
class BatchGeometry:
    prompts: int | None
    samples_per_prompt: int
    trajectories: int | None
    trained_steps_per_trajectory: int | None
    steps_rule: str
    pairs: int | None
    dp_size: int
    pairs_per_rank: int | None
    optimizer_steps: int | None
    pairs_per_rank_per_optimizer_step: int | None
    micro_batch_size: int
    forwards_per_optimizer_step: int | None  # DiT forwards (micro-batches) per rank; CFG doubles each batch
    # --diffusion-rollout-gradient: the engines take the pairs' gradients while they sample; the trainer replays none
    engines_take_gradients: bool = False


def batch_geometry(args: argparse.Namespace) -> BatchGeometry:
    steps, rule = trained_steps_per_trajectory(args)
    prompts = args.rollout_batch_size
    trajectories = args.global_batch_size * args.num_steps_per_rollout if args.global_batch_size else None
    pairs = trajectories * steps if trajectories is not None and steps is not None else None
    per_rank = pairs // args.dp_size if pairs is not None else None
    per_step = per_rank // args.num_steps_per_rollout if per_rank is not None else None
    return BatchGeometry(
        prompts=prompts,
        samples_per_prompt=args.n_samples_per_prompt,
        trajectories=trajectories,
        trained_steps_per_trajectory=steps,
        steps_rule=rule,
        pairs=pairs,
        dp_size=args.dp_size,
        pairs_per_rank=per_rank,
        optimizer_steps=args.num_steps_per_rollout,
        pairs_per_rank_per_optimizer_step=per_step,
        micro_batch_size=args.micro_batch_size,
        forwards_per_optimizer_step=-(-per_step // args.micro_batch_size) if per_step is not None else None,
        engines_take_gradients=args.diffusion_rollout_gradient,
    )

