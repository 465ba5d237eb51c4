"""Where every process runs: Ray start-up and one placement group for the whole job.

One bundle per GPU (`{"GPU": 1, "CPU": 1}`), or one CPU slot per process on a CPU-only machine, which is
how tests and the quick start run. The trainer takes the first `train_world_size` bundles; engines take
the next `rollout_num_gpus` (or, under `--colocate`, share the trainer's: fractional GPUs, trainer 0.7 +
engine 0.25 + reward 0.05 with `--colocate-reward`). Reward workers take fractional GPUs on their own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from miles.ray.shutdown import reinstall_signal_handlers

logger = logging.getLogger(__name__)

# GPU shares of colocated actors on one device (they must add up to at most 1).
TRAIN_GPU_SHARE = 0.7
ROLLOUT_GPU_SHARE = 0.25
REWARD_GPU_SHARE = 0.05

# Environment every Ray worker inherits: tests and CI must never reach a model hub; MILES_RUN_ID marks the
# run's processes for the cleanup sweep (miles.ray.shutdown).
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "WANDB_MODE",
                  "PYTHONPATH", "MILES_RUN_ID")


def use_gpus() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class Slots:
    """A set of bundles of the job's placement group and the GPU share an actor takes on each."""

    placement_group: object | None
    bundle_indices: list[int]
    gpu_share: float  # 0 on CPU
    cpu_share: float  # colocated actors split their bundle's one CPU
    gpu_ids: list[int] = field(default_factory=list)  # physical device of each bundle (GPU only)


@dataclass
class Placement:
    device: str  # "cuda" or "cpu"
    train: Slots
    rollout: Slots
    num_engines: int
    gpus_per_engine: int


def train_world_size(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def init_ray(args) -> None:
    """Start (no address) or join (RAY_ADDRESS set) a Ray cluster, forwarding the offline environment and the
    run's API key (created here unless $MILES_API_KEY is set)."""
    import ray

    from miles.utils.auth import API_KEY_ENV, ensure_run_api_key

    # the run's key for engines, router and trainer ranks: through the environment, never a command line or args
    api_key = ensure_run_api_key()
    if ray.is_initialized():
        return
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    env.update(args.train_env_vars or {})
    env[API_KEY_ENV] = api_key
    runtime_env = {"env_vars": env}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
    else:
        # A CPU machine gets logical CPU slots for every process the job starts (they mostly wait on each other).
        slots = train_world_size(args) + _num_engines(args) * max(1, args.rollout_num_gpus_per_engine) + 8
        num_cpus = None if use_gpus() else max(slots, os.cpu_count() or 1)
        num_gpus = _local_gpu_budget(args) if use_gpus() else None  # --num-gpus-per-node caps this node's GPUs
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env, include_dashboard=False,
                 log_to_driver=True)
    reinstall_signal_handlers()  # ray.init made SIGTERM a bare sys.exit, which would skip the run's cleanup


def _local_gpu_budget(args) -> int:
    import torch

    return min(int(getattr(args, "num_gpus_per_node", 8) or 8), torch.cuda.device_count())


def _num_engines(args) -> int:
    if args.train_only or args.load_debug_rollout_data:
        return 0
    rollout_gpus = args.rollout_num_gpus or train_world_size(args)
    return max(1, rollout_gpus // args.rollout_num_gpus_per_engine)


def create_placement_groups(args) -> Placement:
    """Reserve every slot at once, so a job that does not fit fails before any model loads."""
    import ray
    from ray.util.placement_group import placement_group

    device = "cuda" if use_gpus() else "cpu"
    world = train_world_size(args)
    num_engines = _num_engines(args)
    gpus_per_engine = args.rollout_num_gpus_per_engine
    rollout_bundles = 0 if args.colocate else num_engines * gpus_per_engine
    total = world + rollout_bundles
    bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(total)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        from miles.utils.errors import MilesUserError

        raise MilesUserError(
            f"Ray could not reserve {total} {'GPU' if device == 'cuda' else 'CPU'} slots "
            f"(trainer {world} = --actor-num-nodes × --actor-num-gpus-per-node, rollout {rollout_bundles} = "
            f"--rollout-num-gpus); cluster resources: {ray.cluster_resources()}"
        )
    gpu_ids = _bundle_gpu_ids(pg, total) if device == "cuda" else []
    on_gpu = device == "cuda"
    cpu_share = 0.45 if args.colocate else 1.0
    train_gpu_share = TRAIN_GPU_SHARE if args.colocate else 1.0
    train = Slots(pg, list(range(world)), train_gpu_share if on_gpu else 0.0, cpu_share, gpu_ids[:world])
    first_engine_bundle = 0 if args.colocate else world
    engine_bundles = [first_engine_bundle + i * gpus_per_engine for i in range(num_engines)]
    # An engine's actor only supervises its process, which owns the devices: a small share is enough.
    rollout = Slots(pg, engine_bundles, ROLLOUT_GPU_SHARE if on_gpu else 0.0, cpu_share, gpu_ids)
    logger.info(
        "placement: %s, trainer ranks %d, engines %d × %d device(s)%s",
        device,
        world,
        num_engines,
        gpus_per_engine,
        " (colocated)" if args.colocate else "",
    )
    return Placement(device, train, rollout, num_engines, gpus_per_engine)


def _bundle_gpu_ids(pg, total: int) -> list[int]:
    """Ask a tiny actor on each bundle which physical GPU it sees (Ray decides the mapping)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_gpus=0.01, num_cpus=0.01)
    def visible_gpu() -> int:
        return int(ray.get_gpu_ids()[0])

    refs = [
        visible_gpu.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(total)
    ]
    return ray.get(refs)
