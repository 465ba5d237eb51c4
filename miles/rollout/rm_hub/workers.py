"""Where model rewards run (pickscore, clipscore, aesthetic): Ray actors on fractional GPUs, or one scorer here.

`get_scorer_pool(name, scorer_class, scorer_args, num_workers, num_gpus_per_worker, batch_size)` returns the pool
for those settings, created on first use:
- with Ray initialised (every real run): `num_workers` actors, each holding `num_gpus_per_worker` GPUs (fractional
  values share a GPU; on a GPU-less cluster they run on CPU) and one CPU;
- without Ray (unit tests, scripts): one scorer in this process.
`pool.score(*columns)` cuts the columns (equal-length lists, e.g. prompts and frames) into batches of `batch_size`
rows, deals them round-robin over the workers and returns the scorer's outputs in order. Creating a pool waits
until every worker has loaded its model, behind a progress bar, so a bad model path fails at start-up.

A worker that dies (the OOM killer, a crash in a native library) is restarted and its batches scored again: a
reward is a function of the sample alone (prompt and image), so the rewards come out the same and none is lost,
whether or not `--use-fault-tolerance` is on. Ray does both halves: it restarts the actor (`max_restarts`; the
scorer is loaded again on its first call) and resubmits the calls that were pending on the dead process
(`max_task_retries`). A worker that keeps dying (more than `MAX_RESTARTS` times in a run) is a `PartDiedError`,
one line that ends the run. `restartable` and `gather_scores` give other worker pools (OCR) the same policy.

`--colocate-reward`: the RolloutManager calls `colocate_reward_workers` with the rollout GPUs' placement-group
bundles before any pool exists. Pools created afterwards put their actors on those bundles, round-robin, and the
actors on one bundle split the reward share of that GPU (`miles.ray.placement.REWARD_GPU_SHARE`, beside the
trainer's 0.7 and the engine's 0.25) and the CPU the colocated trainer and engine leave free.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from miles.utils.errors import MilesUserError, PartDiedError
from miles.utils.progress import progress_bar

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # per worker and run: a crash is survived, a worker that dies on every batch is not

# A colocated bundle's one CPU: trainer 0.45 + engine 0.45 (miles.ray.placement), the rest for reward actors.
COLOCATED_REWARD_CPU_SHARE = 0.1


class ScorerActor:
    """Holds one scorer inside a Ray actor; the scorer class stays a plain class usable in-process.

    The scorer is built in `load`, not in the constructor, so that a user mistake (a wrong model path) comes back
    as its one-line message instead of Ray's actor-death report with a traceback."""

    def __init__(self, scorer_class: type, scorer_args: tuple):
        self.scorer_class, self.scorer_args = scorer_class, scorer_args
        self.scorer = None

    def load(self) -> str | None:
        """Build the scorer; the message of a MilesUserError it raised, else None."""
        try:
            self.scorer = self.scorer_class(*self.scorer_args)
        except MilesUserError as err:
            return str(err)
        return None

    def score(self, *columns: list) -> list:
        if self.scorer is None:  # a worker Ray restarted after a crash: its constructor ran again, `load` did not
            problem = self.load()
            if problem:
                raise MilesUserError(problem)
        return self.scorer.score(*columns)


@dataclass
class ColocatedSlots:
    """Placement-group bundles that reward actors share under --colocate-reward."""

    strategies: list  # one PlacementGroupSchedulingStrategy per bundle
    gpu_per_actor: float
    cpu_per_actor: float
    actors_per_bundle: int
    used: list[int] = field(default_factory=list)

    def claim(self, name: str) -> dict[str, Any]:
        """Ray options for one more reward actor: the least-used bundle, or a user error when all are full."""
        bundle = min(range(len(self.strategies)), key=lambda i: self.used[i])
        if self.used[bundle] >= self.actors_per_bundle:
            raise MilesUserError(
                f"--colocate-reward: the rollout GPUs hold {self.actors_per_bundle * len(self.strategies)} reward "
                f"worker(s) and all are taken; the {name} reward needs one more (lower its --*-num-workers)"
            )
        self.used[bundle] += 1
        return {"num_gpus": self.gpu_per_actor, "num_cpus": self.cpu_per_actor,
                "scheduling_strategy": self.strategies[bundle]}


_COLOCATED: ColocatedSlots | None = None


def colocate_reward_workers(placement_group, bundle_indices: Sequence[int], num_workers: int, on_gpu: bool) -> None:
    """Put the reward actors created from now on onto these bundles, `num_workers` in all (the run's model
    rewards' workers, summed), each taking an equal part of the reward share of its bundle."""
    global _COLOCATED
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.ray.placement import REWARD_GPU_SHARE

    bundles = list(bundle_indices)
    if not bundles:
        raise MilesUserError("--colocate-reward: there are no rollout GPUs to put the reward workers on")
    per_bundle = max(1, math.ceil(max(num_workers, 1) / len(bundles)))
    _COLOCATED = ColocatedSlots(
        strategies=[PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i) for i in bundles],
        gpu_per_actor=round(REWARD_GPU_SHARE / per_bundle, 4) if on_gpu else 0.0,
        cpu_per_actor=round(COLOCATED_REWARD_CPU_SHARE / per_bundle, 4),
        actors_per_bundle=per_bundle,
        used=[0] * len(bundles),
    )
    logger.info("--colocate-reward: up to %d reward worker(s) on each of %d rollout GPU(s), %.4g GPU each",
                per_bundle, len(bundles), _COLOCATED.gpu_per_actor)


def clear_reward_colocation() -> None:
    global _COLOCATED
    _COLOCATED = None


class ScorerPool:
    """See the module docstring."""

    def __init__(self, name: str, scorer_class: type, scorer_args: tuple, num_workers: int,
                 num_gpus_per_worker: float, batch_size: int):
        import ray

        if batch_size < 1:
            raise MilesUserError(f"{name}: the batch size must be >= 1, got {batch_size}")
        self.name = name
        self.batch_size = batch_size
        self.actors: list[Any] = []
        self.local: Any = None
        if not ray.is_initialized():
            with progress_bar(1, f"loading the {name} reward model", unit="model") as bar:
                self.local = scorer_class(*scorer_args)
                bar.update(1)
            return
        if num_gpus_per_worker > 0 and ray.cluster_resources().get("GPU", 0) == 0:
            logger.warning("no GPU in the Ray cluster: %s reward workers run on CPU", name)
            num_gpus_per_worker = 0.0
        actor_class = ray.remote(ScorerActor)
        for _ in range(max(1, num_workers)):
            options = _COLOCATED.claim(name) if _COLOCATED is not None else {"num_gpus": num_gpus_per_worker,
                                                                            "num_cpus": 1}
            self.actors.append(actor_class.options(**restartable(**options)).remote(scorer_class, scorer_args))
        logger.info("%s reward: %d Ray worker(s), %.3g GPU each", name, len(self.actors), options["num_gpus"])
        self._wait_until_loaded()

    def _wait_until_loaded(self) -> None:
        import ray

        pending = [actor.load.remote() for actor in self.actors]
        with progress_bar(len(pending), f"loading the {self.name} reward model", unit="worker") as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    [problem] = ray.get(done)
                except Exception as err:  # a crash, not a user mistake: its last line here, the traceback in the log
                    self.shutdown()
                    last_line = str(err).strip().splitlines()[-1]
                    raise MilesUserError(f"{self.name} reward worker failed to load its model: {last_line}") from err
                if problem:
                    self.shutdown()
                    raise MilesUserError(f"{self.name} reward worker: {problem}")
                bar.update(len(done))

    async def score(self, *columns: Sequence) -> list:
        length = len(columns[0])
        batches = [
            tuple(list(column[start : start + self.batch_size]) for column in columns)
            for start in range(0, length, self.batch_size)
        ]
        if self.actors:
            refs = [self.actors[i % len(self.actors)].score.remote(*batch) for i, batch in enumerate(batches)]
            results = await gather_scores(self.name, refs)
        else:
            results = [await asyncio.to_thread(self.local.score, *batch) for batch in batches]
        return [value for batch in results for value in batch]

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def restartable(**options: Any) -> dict[str, Any]:
    """Ray actor options plus the restart policy of the module docstring."""
    return {**options, "max_restarts": MAX_RESTARTS, "max_task_retries": MAX_RESTARTS}


async def gather_scores(what: str, refs: list) -> list:
    """The results of calls to restartable workers, in order; a worker dead for good is a `PartDiedError`."""
    import ray

    try:
        return await asyncio.gather(*refs)
    except ray.exceptions.RayActorError as err:
        raise PartDiedError(
            f"a {what} reward worker died more often than its {MAX_RESTARTS} restarts allow (killed, out of memory, "
            f"or crashed while scoring); the run is stopped"
        ) from err


_POOLS: dict[tuple, ScorerPool] = {}


def get_scorer_pool(name: str, scorer_class: type, scorer_args: tuple, num_workers: int,
                    num_gpus_per_worker: float, batch_size: int) -> ScorerPool:
    import ray

    key = (name, scorer_class.__qualname__, scorer_args, num_workers, num_gpus_per_worker, batch_size,
           ray.is_initialized())
    if key not in _POOLS:
        _POOLS[key] = ScorerPool(name, scorer_class, scorer_args, num_workers, num_gpus_per_worker, batch_size)
    return _POOLS[key]


def shutdown_scorer_pools() -> None:
    """Kill every reward actor started through this module (and forget the colocation slots)."""
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
    clear_reward_colocation()
