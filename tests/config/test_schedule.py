"""The run's length and cadence (miles.config.schedule): the rules the loop, --dry-run and the console share."""

from __future__ import annotations

from argparse import Namespace

from miles.config.schedule import (
    eval_due,
    format_rollout_ids,
    interval_due,
    run_schedule,
    save_due,
    should_save,
)
from miles.testing.tiny_rollout import tiny_trainer_config


def test_saves_and_exports_come_after_every_interval_and_after_the_last_rollout():
    assert [i for i in range(10) if interval_due(4, 10, i)] == [3, 7, 9]
    assert not any(interval_due(None, 10, i) for i in range(10))  # no --export-interval: no export
    assert [i for i in range(10) if save_due("ckpt", None, 10, i)] == [9]  # --save alone: after the last
    assert not any(save_due(None, 4, 10, i) for i in range(10))


def test_the_loop_saves_by_the_runs_typed_configuration():
    config = tiny_trainer_config("unused", save="/ckpt", save_interval=3, num_rollout=8)
    assert [r for r in range(8) if should_save(config, r)] == [2, 5, 7]  # every 3 rollouts and the last one
    assert not any(should_save(config.replace(save=None), r) for r in range(8))


def test_evals_come_before_rollout_0_every_interval_and_after_the_last():
    assert [i for i in range(11) if eval_due(4, False, i, 10)] == [0, 4, 8, 10]
    assert [i for i in range(11) if eval_due(4, True, i, 10)] == [4, 8, 10]  # --skip-eval-before-train
    assert not any(eval_due(None, False, i, 10) for i in range(11))


def _args(**values) -> Namespace:
    defaults = dict(num_rollout=10, eval_prompt_data_pairs=[("val", "v.jsonl")], eval_config=None, train_only=False,
                    eval_interval=4, skip_eval_before_train=False, save="ckpt", save_interval=4, export_interval=None)
    return Namespace(**{**defaults, **values})


def test_a_resumed_schedule_lists_only_what_is_left():
    schedule = run_schedule(_args(), start_rollout_id=5)
    assert (schedule.rollouts_left, schedule.saves, schedule.evals, schedule.exports) == (5, [7, 9], [8, 10], [])
    assert run_schedule(_args(train_only=True)).evals == []  # a train-only run has no engines to evaluate on
    assert run_schedule(_args(), start_rollout_id=10).rollouts_left == 0


def test_long_lists_are_shortened_with_their_count():
    assert format_rollout_ids([]) == "none"
    assert format_rollout_ids([1, 2]) == "1, 2 (2)"
    assert format_rollout_ids(list(range(0, 300, 10))) == "0, 10, 20, 30, ..., 260, 270, 280, 290 (30)"
