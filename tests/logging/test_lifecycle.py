"""The console lines of a run's life (miles.logging.lifecycle)."""

from __future__ import annotations

import time

from miles.config.batch_geometry import BatchGeometry
from miles.config.schedule import RunSchedule
from miles.logging import lifecycle


def test_the_started_line_gives_the_shape_and_the_schedule():
    geometry = BatchGeometry(prompts=4, samples_per_prompt=8, trajectories=32, trained_steps_per_trajectory=2,
                             steps_rule="", pairs=64, dp_size=1, pairs_per_rank=64, optimizer_steps=2,
                             pairs_per_rank_per_optimizer_step=32, micro_batch_size=8, forwards_per_optimizer_step=4)
    schedule = RunSchedule(num_rollout=30, start_rollout_id=10, saves=[19, 29], exports=[], evals=[10, 20, 30])
    line = lifecycle.started_line("sd3", "/models/sd3", "cuda", 8, 8, True, geometry, schedule, "/runs/a")
    assert line == ("started: sd3 from /models/sd3 on cuda, 8 trainer rank(s), 8 engine(s) colocated; per rollout 4 "
                    "prompts x 8 samples = 32 trajectories, 64 train pairs, 2 optimizer step(s); rollouts 10..29 of 30; "
                    "saves after 19, 29 (2), evals before 10, 20, 30 (3); outputs in /runs/a")
    on_host = lifecycle.started_line("sd3", "/models/sd3", "cuda", 1, 1, True, geometry, schedule, "/runs/a",
                                     trainer_on_host=True)
    assert on_host.startswith("started: sd3 from /models/sd3 on cuda, 1 trainer rank(s) on the host, 1 engine(s) "
                              "colocated;")


def test_the_eval_and_finished_lines():
    metrics = {"eval/val/reward_mean": 0.5, "eval/val/reward_std": 0.25}
    assert lifecycle.evaluated_line(3, "val", metrics, 16, "/o/eval/3/val.png") == (
        "evaluated val before rollout 3: reward_mean=0.5 reward_std=0.25 over 16 samples; grid /o/eval/3/val.png")
    history = [{"rollout_id": 0, "rollout/reward_mean": 0.1}, {"rollout_id": 1, "rollout/reward_mean": 0.3}]
    schedule = RunSchedule(num_rollout=2, start_rollout_id=0, saves=[1], exports=[], evals=[])
    line = lifecycle.finished_line(history, schedule, time.perf_counter(), "/o", "/c/iter_0000001")
    assert line == ("finished: rollouts 0..1 of 2 in 0 s; reward_mean 0.1 -> 0.3; last checkpoint /c/iter_0000001; "
                    "metrics, curves and samples in /o")


def test_nothing_to_train():
    assert lifecycle.nothing_to_train_line("ckpt", "ckpt/iter_0000299", 300, 300) == (
        "--load ckpt: checkpoint at rollout 300 (ckpt/iter_0000299), --num-rollout 300: nothing to train (raise "
        "--num-rollout to continue)")
