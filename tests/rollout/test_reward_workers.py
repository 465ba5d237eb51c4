"""The model rewards' worker pool: batching in order, the --colocate-reward slots, load failures, and (Ray) actors
placed in a placement-group bundle beside a colocated trainer and engine."""

from __future__ import annotations

import asyncio
import os

import pytest

from miles.rollout.rm_hub.workers import (
    ColocatedSlots,
    ScorerPool,
    clear_reward_colocation,
    colocate_reward_workers,
    shutdown_scorer_pools,
)
from miles.utils.errors import MilesUserError


class DoublingScorer:
    """Stands in for a model: scores each row as 2 x its number, and records batch sizes."""

    def __init__(self, fail: bool = False):
        if fail:
            raise MilesUserError("--fake-model-path '/nowhere': cannot load the model")
        self.batches: list[int] = []

    def score(self, prompts: list[str], numbers: list[int]) -> list[float]:
        self.batches.append(len(numbers))
        return [2.0 * n for n in numbers]


def test_in_process_pool_cuts_batches_and_keeps_the_order():
    pool = ScorerPool("doubling", DoublingScorer, (), num_workers=3, num_gpus_per_worker=1.0, batch_size=4)
    scores = asyncio.run(pool.score([f"p{i}" for i in range(10)], list(range(10))))
    assert scores == [2.0 * i for i in range(10)]
    assert pool.local.batches == [4, 4, 2]


def test_colocated_slots_fill_the_least_used_bundle_then_refuse():
    slots = ColocatedSlots(strategies=["bundle0", "bundle1"], gpu_per_actor=0.025, cpu_per_actor=0.05,
                           actors_per_bundle=2, used=[0, 0])
    placed = [slots.claim("pickscore")["scheduling_strategy"] for _ in range(4)]
    assert sorted(placed) == ["bundle0", "bundle0", "bundle1", "bundle1"]
    with pytest.raises(MilesUserError, match="--colocate-reward: the rollout GPUs hold 4 reward worker"):
        slots.claim("clipscore")


@pytest.mark.slow
def test_colocated_reward_actors_fit_beside_trainer_and_engine_in_one_bundle():
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # the workers unpickle DoublingScorer, so they need this folder on their path
    path = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        bundle = placement_group([{"CPU": 1}])
        ray.get(bundle.ready(), timeout=60)

        @ray.remote
        class Occupant:  # the colocated trainer rank and engine: 0.45 CPU each (miles.ray.placement)
            def ping(self) -> bool:
                return True

        in_bundle = PlacementGroupSchedulingStrategy(bundle, placement_group_bundle_index=0)
        occupants = [Occupant.options(num_cpus=0.45, scheduling_strategy=in_bundle).remote() for _ in range(2)]
        ray.get([o.ping.remote() for o in occupants], timeout=60)
        colocate_reward_workers(bundle, [0], num_workers=2, on_gpu=False)
        pool = ScorerPool("doubling", DoublingScorer, (), num_workers=2, num_gpus_per_worker=1.0, batch_size=2)
        assert asyncio.run(pool.score(["a", "b", "c"], [1, 2, 3])) == [2.0, 4.0, 6.0]
        with pytest.raises(MilesUserError, match="all are taken"):
            ScorerPool("another", DoublingScorer, (), num_workers=1, num_gpus_per_worker=1.0, batch_size=2)
        clear_reward_colocation()
        with pytest.raises(MilesUserError, match=r"^doubling reward worker: --fake-model-path '/nowhere': cannot load the model$"):
            ScorerPool("doubling", DoublingScorer, (True,), num_workers=1, num_gpus_per_worker=0.0, batch_size=2)
        pool.shutdown()
    finally:
        shutdown_scorer_pools()
        ray.shutdown()
