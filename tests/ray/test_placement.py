"""Placement: the node bookkeeping that decides whether engines bind their node's address, and the workers'
environment inside a submitted Ray job. (Reward workers' placement: tests/rollout/test_reward_workers.py.)"""

from __future__ import annotations

import json

import pytest

from miles.config.sections import RunConfig
from miles.ray.placement import Placement, Slots, worker_env_vars
from miles.testing.config import trainer_config

pytestmark = pytest.mark.timeout(180)


def _args(**overrides) -> RunConfig:
    values = dict(actor_num_gpus_per_node=2, num_gpus_per_node=2, rm_type="pickscore",
                  pickscore_model_path="unused", pickscore_processor_path="unused")
    values.update(overrides)
    return trainer_config(**values)


def test_spans_nodes():
    slots = Slots(None, [0], 1.0, 1.0)
    one_node = Placement("cpu", slots, Slots(None, [1], 0.0, 1.0), 1, 1, ["a", "a"], "a")
    assert not one_node.spans_nodes and one_node.nodes_of(one_node.rollout) == ["a"]
    assert Placement("cpu", slots, Slots(None, [1], 0.0, 1.0), 1, 1, ["a", "b"], "a").spans_nodes
    # the driver (and its router) on a node without bundles: the engines must still be reachable from it
    assert Placement("cpu", slots, Slots(None, [1], 0.0, 1.0), 1, 1, ["b", "b"], "head").spans_nodes


def test_worker_env_leaves_the_submitted_jobs_variables_to_the_job():
    environ = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": "/code", "WANDB_MODE": "disabled"}
    args = _args(train_env_vars={"NCCL_DEBUG": "INFO"})
    # a Ray of the run's own: the key file's path, never the key (Ray logs a runtime_env)
    local = {**environ, "MILES_API_KEY_FILE": "/run/k", "MILES_API_KEY": "k" * 32}
    assert worker_env_vars(args, "k" * 32, local) == {**environ, "NCCL_DEBUG": "INFO", "MILES_API_KEY_FILE": "/run/k",
                                                      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # the user's allocator settings reach every worker (a joined cluster's nodes too), in place of the default
    own = {**local, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert worker_env_vars(args, "k" * 32, own)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    fixed = _args(train_env_vars={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert worker_env_vars(fixed, "k" * 32, local)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    joined = {**environ, "RAY_ADDRESS": "10.0.0.1:6379"}  # a cluster joined: its nodes may not share the run's file
    ours = {**joined, "MILES_RUN_FOLDER": "/tmp/miles-x", "MILES_API_KEY_FILE": "/tmp/miles-x/api_key"}
    assert worker_env_vars(args, "k" * 32, ours)["MILES_API_KEY"] == "k" * 32
    shared = {**joined, "MILES_RUN_FOLDER": "/tmp/miles-x", "MILES_API_KEY_FILE": "/shared/key"}  # the user's own
    assert "MILES_API_KEY" not in worker_env_vars(args, "k" * 32, shared)
    environ = joined
    job = {"runtime_env": {"working_dir": "/code", "env_vars": {"HF_HUB_OFFLINE": "1", "MILES_API_KEY": "k" * 32}}}
    inside_job = {**environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    # Ray refuses a ray.init runtime_env that repeats a variable of the job's, even with the same value
    assert worker_env_vars(args, "k" * 32, inside_job) == {"PYTHONPATH": "/code", "WANDB_MODE": "disabled",
                                                           "NCCL_DEBUG": "INFO",
                                                           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_a_run_joins_a_cluster_only_when_one_is_named():
    from miles.ray.placement import cluster_address

    assert cluster_address(_args(), environ={}) is None  # its own private Ray instance
    assert cluster_address(_args(), environ={"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert cluster_address(_args(ray_address="auto"), environ={"RAY_ADDRESS": "10.0.0.1:6379"}) == "auto"
    assert cluster_address(_args(), environ={"RAY_ADDRESS": "local"}) is None
    assert cluster_address(_args(ray_address="local"), environ={"RAY_ADDRESS": "10.0.0.1:6379"}) is None


def test_a_private_ray_runs_its_workers_at_ordinary_priority(monkeypatch):
    """The trainer and engines dispatch every kernel from one thread: Ray's default niceness 15 is not theirs."""
    import os

    import ray

    from miles.ray.placement import local_ray_system_config, start_or_join_ray

    assert local_ray_system_config(environ={"RAY_worker_niceness": "10"}) == {}  # the user's setting decides
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    start_or_join_ray(_args(), runtime_env={})
    try:
        @ray.remote(num_cpus=0)
        def niceness() -> int:
            return os.nice(0)

        assert ray.get(niceness.remote()) == os.nice(0)
    finally:
        ray.shutdown()
