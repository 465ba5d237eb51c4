"""Placement: the resource requests of reward workers (colocated on the rollout GPUs or on GPUs of their own),
proved on a real Ray cluster with logical GPUs by scheduling actors with exactly those requests; the node
bookkeeping that decides whether engines bind their node's address; the workers' environment inside a
submitted Ray job."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import ray

from miles.ray import placement as placement_module
from miles.ray.placement import (
    REWARD_GPU_SHARE,
    ROLLOUT_GPU_SHARE,
    TRAIN_GPU_SHARE,
    Placement,
    Slots,
    create_placement_groups,
    reward_layout,
    worker_env_vars,
)

pytestmark = pytest.mark.timeout(180)


def _args(**overrides) -> Namespace:
    values = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None, rollout_num_gpus_per_engine=1,
                  colocate=False, colocate_reward=False, train_only=False, load_debug_rollout_data=None,
                  rm_type="pickscore", pickscore_num_workers=1, pickscore_num_gpus_per_worker=1.0,
                  train_env_vars={})
    values.update(overrides)
    return Namespace(**values)


@pytest.mark.parametrize("overrides, on_gpu, want", [
    # --colocate-reward: on the rollout GPUs, beside trainer 0.7 and engine 0.25; the CPU they leave
    (dict(colocate=True, colocate_reward=True, pickscore_num_workers=2), True, ([], [0, 1], REWARD_GPU_SHARE, 0.1)),
    # GPUs of their own: fractional workers pack onto shared GPU bundles appended after trainer and engines
    (dict(pickscore_num_workers=3, pickscore_num_gpus_per_worker=0.5), True,
     ([{"GPU": 1, "CPU": 2}, {"GPU": 1, "CPU": 1}], [4, 4, 5], 0.5, 1.0)),
    (dict(pickscore_num_workers=2, pickscore_num_gpus_per_worker=1.0), True,
     ([{"GPU": 1.0, "CPU": 1}, {"GPU": 1.0, "CPU": 1}], [4, 5], 1.0, 1.0)),
    (dict(pickscore_num_workers=1, pickscore_num_gpus_per_worker=2.0), True, ([{"GPU": 2.0, "CPU": 1}], [4], 2.0, 1.0)),
    # no GPU: one CPU slot each
    (dict(pickscore_num_workers=2), False, ([{"CPU": 1}, {"CPU": 1}], [4, 5], 0.0, 1.0)),
    # rewards without GPU workers reserve nothing
    (dict(rm_type="brightness"), True, ([], [], 0.0, 0.0)),
    (dict(rm_type="ocr"), True, ([], [], 0.0, 0.0)),
])
def test_reward_layout(overrides, on_gpu, want):
    assert reward_layout(_args(**overrides), on_gpu, [0, 1] if overrides.get("colocate") else [2, 3], 4) == want


def test_colocated_shares_fill_one_gpu_and_one_cpu():
    assert TRAIN_GPU_SHARE + ROLLOUT_GPU_SHARE + REWARD_GPU_SHARE == pytest.approx(1.0)
    _, _, _, reward_cpu = reward_layout(_args(colocate=True, colocate_reward=True), True, [0], 2)
    assert 2 * placement_module.COLOCATED_CPU_SHARE + reward_cpu == pytest.approx(1.0)


@ray.remote
class _Holder:
    """Stands for a trainer rank, an engine supervisor or a reward worker: holds its resources, reports its GPU."""

    def gpu_ids(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


def _hold(options: dict) -> list[int]:
    return ray.get(_Holder.options(**options).remote().gpu_ids.remote(), timeout=60)


def _slot_options(slots: Slots, bundle_index: int) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_gpus": slots.gpu_share, "num_cpus": slots.cpu_share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(slots.placement_group,
                                                                   placement_group_bundle_index=bundle_index)}


@pytest.fixture(scope="module")
def logical_gpus():
    """A local Ray with 4 logical GPUs (resources only: no device is touched), the placement told to use them."""
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    original = placement_module.use_gpus
    placement_module.use_gpus = lambda: True
    yield
    placement_module.use_gpus = original
    ray.shutdown()


def test_colocated_reward_workers_share_the_rollout_gpus(logical_gpus):
    args = _args(colocate=True, colocate_reward=True, rollout_num_gpus=2, pickscore_num_workers=2)
    placement = create_placement_groups(args)
    try:
        assert placement.reward.bundle_indices == [0, 1] and placement.reward.gpu_share == REWARD_GPU_SHARE
        # the trainer rank, the engine and the reward worker of each bundle all fit on its one GPU
        for bundle, reward_options in zip((0, 1), placement.reward.actor_options()):
            gpus = {tuple(_hold(_slot_options(placement.train, bundle))),
                    tuple(_hold(_slot_options(placement.rollout, bundle))), tuple(_hold(reward_options))}
            assert len(gpus) == 1 and len(next(iter(gpus))) == 1
    finally:
        ray.util.remove_placement_group(placement.train.placement_group)


def test_reward_workers_get_gpus_of_their_own(logical_gpus):
    args = _args(actor_num_gpus_per_node=1, rollout_num_gpus=1, pickscore_num_workers=3,
                 pickscore_num_gpus_per_worker=0.5)
    placement = create_placement_groups(args)
    try:
        assert placement.reward.bundle_indices == [2, 2, 3] and placement.reward.gpu_share == 0.5
        trainer_gpu = _hold(_slot_options(placement.train, 0))
        engine_gpu = _hold(_slot_options(placement.rollout, 1))
        reward_gpus = [_hold(options) for options in placement.reward.actor_options()]
        assert reward_gpus[0] == reward_gpus[1] != reward_gpus[2]  # two halves share a GPU, the third its own
        assert not {tuple(g) for g in reward_gpus} & {tuple(trainer_gpu), tuple(engine_gpu)}
    finally:
        ray.util.remove_placement_group(placement.train.placement_group)


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
