"""How long a run is and at which rollouts it saves, evaluates and exports.

One rule each, read by the training loop (through `should_save`, `model_export.should_export` and
`RolloutManager.should_eval`), by `--dry-run` (`run_schedule`, which lists every rollout the run will save,
evaluate and export at) and by the start-up and finished-run lines of `train_diffusion.py`.

- Length: `--num-rollout`, else `--num-epoch` passes (one by default) over `--prompt-data`:
  ceil(epochs x prompts / --rollout-batch-size) rollouts (`resolve_num_rollout`).
- Saves (with `--save`): after every `--save-interval`-th rollout and after the last one.
- Exports (with `--export-interval`): the same rule with its own interval.
- Evals (with eval sets): before rollout 0 (unless `--skip-eval-before-train`), before every rollout whose id is a
  multiple of `--eval-interval`, and once after the last rollout. Eval sets without `--eval-interval` evaluate
  every `DEFAULT_EVAL_INTERVAL` rollouts (validation fills it in and says so).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import RunConfig

DEFAULT_EVAL_INTERVAL = 10


def interval_due(interval: int | None, num_rollout: int, rollout_id: int) -> bool:
    """After every `interval`-th rollout and after the last one; never without an interval."""
    if not interval:
        return False
    return (rollout_id + 1) % int(interval) == 0 or rollout_id == num_rollout - 1


def save_due(save: str | None, save_interval: int | None, num_rollout: int, rollout_id: int) -> bool:
    """With `--save`: after every `--save-interval`-th rollout (when set) and always after the last one."""
    return bool(save) and (interval_due(save_interval, num_rollout, rollout_id) or rollout_id == num_rollout - 1)


def should_save(config: RunConfig, rollout_id: int) -> bool:
    """The loop's save rule for a run's typed configuration (`save_due`)."""
    return save_due(config.checkpoint.save, config.checkpoint.save_interval, config.data.num_rollout, rollout_id)


def eval_due(eval_interval: int | None, skip_eval_before_train: bool, rollout_id: int, num_rollout: int) -> bool:
    """Whether the loop evaluates before `rollout_id` (`rollout_id == num_rollout`: the eval after the last one)."""
    if not eval_interval:
        return False
    if rollout_id >= num_rollout:
        return True
    if rollout_id == 0:
        return not skip_eval_before_train
    return rollout_id % int(eval_interval) == 0


def resolve_num_rollout(args: argparse.Namespace) -> str:
    """Fill `args.num_rollout` from the prompt data when it is unset; returns how the length was chosen."""
    if args.num_rollout is not None:
        return "--num-rollout"
    from miles.config.sections import RunConfig
    from miles.rollout.data_source import num_rollout_of

    args.num_rollout = num_rollout_of(RunConfig.from_args(args).data)
    epochs = args.num_epoch or 1
    return (f"{epochs} epoch(s) of --prompt-data at --rollout-batch-size {args.rollout_batch_size} "
            f"(set --num-rollout or --num-epoch to change it)")


@dataclass(frozen=True)
class RunSchedule:
    num_rollout: int
    start_rollout_id: int  # the first rollout this invocation trains (after a --load checkpoint)
    saves: list[int]  # rollout ids whose checkpoint is written after them
    exports: list[int]
    evals: list[int]  # rollout ids evaluated before (num_rollout: after the last rollout)

    @property
    def rollouts_left(self) -> int:
        return max(0, self.num_rollout - self.start_rollout_id)


def run_schedule(args: argparse.Namespace, start_rollout_id: int = 0) -> RunSchedule:
    """The rollouts of a validated namespace with `num_rollout` resolved, from `start_rollout_id` on."""
    n = int(args.num_rollout)
    ids = range(start_rollout_id, n)
    has_eval_sets = bool(args.eval_prompt_data_pairs or args.eval_config) and not args.train_only
    eval_interval = args.eval_interval if has_eval_sets else None
    return RunSchedule(
        num_rollout=n,
        start_rollout_id=start_rollout_id,
        saves=[i for i in ids if save_due(args.save, args.save_interval, n, i)],
        exports=[i for i in ids if interval_due(args.export_interval, n, i)],
        evals=[i for i in [*ids, n] if eval_due(eval_interval, args.skip_eval_before_train, i, n)],
    )


def format_rollout_ids(ids: list[int], limit: int = 8) -> str:
    """ "0, 10, 20, ..., 290 (30)": the first and last few ids of a long list, and the count."""
    if not ids:
        return "none"
    shown = ids if len(ids) <= limit else [*ids[: limit // 2], "...", *ids[-(limit // 2):]]
    return ", ".join(map(str, shown)) + f" ({len(ids)})"
