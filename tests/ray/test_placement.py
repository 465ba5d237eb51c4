"""Placement: the node bookkeeping that decides whether engines bind their node's address, and the workers'
environment inside a submitted Ray job. (Reward workers' placement: tests/rollout/test_reward_workers.py.)"""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from miles.ray.placement import Placement, Slots, worker_env_vars

pytestmark = pytest.mark.timeout(180)


def _args(**overrides) -> Namespace:
    values = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None, rollout_num_gpus_per_engine=1,
                  colocate=False, colocate_reward=False, train_only=False, load_debug_rollout_data=None,
                  rm_type="pickscore", pickscore_num_workers=1, pickscore_num_gpus_per_worker=1.0,
                  train_env_vars={})
    values.update(overrides)
    return Namespace(**values)


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
    assert worker_env_vars(args, "k" * 32, environ) == {**environ, "NCCL_DEBUG": "INFO", "MILES_API_KEY": "k" * 32}
    job = {"runtime_env": {"working_dir": "/code", "env_vars": {"HF_HUB_OFFLINE": "1", "MILES_API_KEY": "k" * 32}}}
    inside_job = {**environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    # Ray refuses a ray.init runtime_env that repeats a variable of the job's, even with the same value
    assert worker_env_vars(args, "k" * 32, inside_job) == {"PYTHONPATH": "/code", "WANDB_MODE": "disabled",
                                                           "NCCL_DEBUG": "INFO"}
