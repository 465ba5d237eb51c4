"""Reference flags that used to parse and do nothing: each now does what docs/cli-reference.md says or is refused
at validation with one line (--num-gpus-per-node, --distributed-backend, --over-sampling-batch-size,
--use-miles-router, --colocate-reward, --ci-test and its checker, the single-choice backend/optimizer/estimator)."""

from __future__ import annotations

import logging
import pytest

from miles.logging.ci_check import check_ci_metric
from miles.config.arguments import parse_args
from miles.config.sections import RunConfig
from miles.ray.train_actor import process_group_backend
from miles.utils.errors import MilesUserError

BASE = ["--hf-checkpoint", "org/sd3-tiny", "--prompt-data", "prompts.jsonl", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1"]


def parse(*extra: str):
    return parse_args([*BASE, *extra])


def error(*extra: str) -> str:
    with pytest.raises(MilesUserError) as info:
        parse(*extra)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_num_gpus_per_node_bounds_the_per_node_flags():
    assert "--actor-num-gpus-per-node 4 exceeds --num-gpus-per-node 2" in error(
        "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "2")
    assert parse("--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2").num_gpus_per_node == 2


def test_distributed_backend_is_checked_and_used_on_gpu_only(caplog):
    assert "invalid choice: 'mpi'" in error("--distributed-backend", "mpi")
    def config(*extra: str) -> RunConfig:
        return RunConfig.from_args(parse(*extra))

    assert process_group_backend(config("--distributed-backend", "gloo"), on_gpu=True) == "gloo"
    assert process_group_backend(config(), on_gpu=True) == "nccl"
    assert process_group_backend(config("--fsdp-cpu-offload"), on_gpu=True) == "cpu:gloo,cuda:nccl"
    with caplog.at_level(logging.INFO, logger="miles.ray.train_actor"):
        assert process_group_backend(config(), on_gpu=False) == "gloo"
    assert "--distributed-backend nccl: no GPU, the trainer's process group uses gloo" in caplog.text


def test_over_sampling_batch_size_must_cover_the_batch():
    assert "--over-sampling-batch-size 2 must be >= --rollout-batch-size 4" in error("--over-sampling-batch-size", "2")
    assert parse("--over-sampling-batch-size", "8").over_sampling_batch_size == 8


def test_use_miles_router_is_implied_and_said_so(caplog):
    with caplog.at_level(logging.INFO, logger="miles.config.validation"):
        assert parse().use_miles_router is True
    assert "--use-miles-router is implied" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="miles.config.validation"):
        assert parse("--use-miles-router").use_miles_router is True
    assert "implied" not in caplog.text


def test_colocate_reward_needs_colocate():
    assert "--colocate-reward needs --colocate" in error("--colocate-reward")


def test_ci_flags_go_together():
    ci = ("--ci-test", "--ci-metric-checker-key", "eval/a/reward_mean", "--ci-metric-checker-threshold", "0.5")
    assert parse(*ci).ci_metric_checker_threshold == 0.5
    assert "--ci-test checks a metric at the end of the run" in error("--ci-test")
    assert "only runs with --ci-test" in error(*ci[1:])
    assert "go together" in error("--ci-test", "--ci-metric-checker-key", "x")


def test_ci_metric_checker_passes_on_any_value_at_the_threshold():
    args = RunConfig.from_args(parse("--ci-test", "--ci-metric-checker-key", "eval/a/reward_mean",
                                     "--ci-metric-checker-threshold", "0.5")).logging
    history = [{"rollout_id": 0, "eval/a/reward_mean": 0.2}, {"rollout_id": 1}, {"rollout_id": 2,
                                                                               "eval/a/reward_mean": 0.5}]
    check_ci_metric(args, history)
    with pytest.raises(MilesUserError, match=r"never reached --ci-metric-checker-threshold 0.5 \(best 0.2 over 1"):
        check_ci_metric(args, history[:2])
    with pytest.raises(MilesUserError, match="no metrics record holds --ci-metric-checker-key"):
        check_ci_metric(args, [{"rollout_id": 0}])
    check_ci_metric(RunConfig.from_args(parse()).logging, [])  # not a CI run: nothing to check


def test_single_choice_flags_refuse_other_values(tmp_path):
    for flag, value in (("--train-backend", "megatron"), ("--optimizer", "sgd"), ("--advantage-estimator", "ppo")):
        assert f"argument {flag}: invalid choice: '{value}'" in error(flag, value)
    config = tmp_path / "override.yaml"
    config.write_text("optimizer: sgd\n")
    assert "--optimizer must be one of ['adam'], got 'sgd'" in error("--custom-config-path", str(config))


def test_use_tensorboard_needs_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert "--use-tensorboard needs the tensorboard package" in error("--use-tensorboard")
