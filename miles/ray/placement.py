"""Where every process runs: Ray start-up and one placement group for the whole job.

One bundle per GPU (`{"GPU": 1, "CPU": 1}`), or one CPU slot per process on a CPU-only machine, which is
how tests and the quick start run. The trainer takes the first `train_world_size` bundles; engines take
the next `rollout_num_gpus` (or, under `--colocate`, share the trainer's: fractional GPUs, trainer 0.7 +
engine 0.25 + reward 0.05 with `--colocate-reward`). Reward workers take fractional GPUs on their own.

Each run starts a Ray instance of its own unless it is told to join a cluster (`--ray-address` or $RAY_ADDRESS,
`start_or_join_ray`). Ray may spread the bundles over several nodes of such a cluster (docs/cluster.md). The
placement records each bundle's node: a run whose processes span nodes has its engines bind their node's
address instead of loopback, since the driver's router and the trainer must reach them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from miles.config.sections import RunConfig
from miles.ray.shutdown import on_run_exit, reinstall_signal_handlers
from miles.utils.cuda_allocator import ALLOC_CONF_VARIABLE, GROWING_SEGMENTS

logger = logging.getLogger(__name__)

# GPU shares of colocated actors on one device (they must add up to at most 1).
TRAIN_GPU_SHARE = 0.7
ROLLOUT_GPU_SHARE = 0.25
REWARD_GPU_SHARE = 0.05

# Environment every Ray worker inherits: tests and CI must never reach a model hub; MILES_RUN_ID marks the
# run's processes for the cleanup sweep (miles.ray.shutdown); MILES_API_KEY_FILE names the run's key file
# (miles.utils.auth: the key itself never goes into a runtime_env, which Ray writes into its logs).
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "WANDB_MODE",
                  "PYTHONPATH", "MILES_RUN_ID", "MILES_API_KEY_FILE", "MILES_RUN_FOLDER", "PYTORCH_CUDA_ALLOC_CONF")


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
    bundle_nodes: list[str] = field(default_factory=list)  # the Ray node id of each bundle
    driver_node: str | None = None  # the node of the driver (and of the router it starts)

    def nodes_of(self, slots: Slots) -> list[str]:
        return [self.bundle_nodes[i] for i in slots.bundle_indices] if self.bundle_nodes else []

    @property
    def spans_nodes(self) -> bool:
        """True when the driver, the trainer ranks and the engines are not all on one node."""
        return len(set(self.bundle_nodes) | ({self.driver_node} if self.driver_node else set())) > 1


def init_ray(config: RunConfig) -> None:
    """Start the run's own Ray instance, or join the cluster the user named (`start_or_join_ray`), forwarding the
    offline environment and the run's API key (created here unless $MILES_API_KEY is set)."""
    import ray

    from miles.utils.auth import ensure_run_api_key, remove_run_folder

    # the run's key for engines, router and trainer ranks: through the environment, never a command line or args
    api_key = ensure_run_api_key()
    if ray.is_initialized():
        return
    on_run_exit("the run's key folder", remove_run_folder)
    start_or_join_ray(config, {"env_vars": worker_env_vars(config, api_key)})
    reinstall_signal_handlers()  # ray.init made SIGTERM a bare sys.exit, which would skip the run's cleanup


RAY_ADDRESS_ENV = "RAY_ADDRESS"
_RAY_AUTH_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
LOCAL_RAY = "local"  # as an address: a private instance, the same as naming none


def cluster_address(config: RunConfig, environ=os.environ) -> str | None:
    """The Ray cluster the run joins: `--ray-address`, else $RAY_ADDRESS; None (or `local`): the run starts a
    Ray instance of its own, whatever other Ray instances run on the machine (docs/cluster.md)."""
    address = config.placement.ray_address or environ.get(RAY_ADDRESS_ENV) or None
    return None if address == LOCAL_RAY else address


def local_ray_system_config(environ=os.environ) -> dict:
    """Settings of a Ray instance the run starts for itself (a joined cluster keeps its own).

    Ray starts its workers at niceness 15 to keep its own daemons responsive; here the workers are the trainer
    and the engines, whose one Python thread each dispatches every kernel of a step, so they run at the
    ordinary priority of the user's other processes (0), as the same loop run outside Ray would. On one H200
    the LoRA train step of bench_e2e took 9.1 s at niceness 0 against 10.5 s at 15 (bench/RESULTS.md).
    `RAY_worker_niceness` in the environment still decides when it is set."""
    return {} if "RAY_worker_niceness" in environ else {"worker_niceness": 0}


def start_or_join_ray(config: RunConfig, runtime_env: dict) -> None:
    """`ray.init` for the run. Joining a cluster is explicit (`cluster_address`); otherwise the run starts a
    private instance in its own temp folder (`miles.ray.shutdown.make_run_ray_temp_dir`), so two runs on one
    machine, or a run beside someone's `ray start`, never attach to each other (a bare `ray.init()` would attach
    to the newest instance on the machine and then refuse the resources this run asks for)."""
    import ray

    from miles.ray.shutdown import make_run_ray_temp_dir

    address = cluster_address(config)
    if address:
        logger.info("joining the Ray cluster at %s (--ray-address / $%s)", address, RAY_ADDRESS_ENV)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    # A CPU machine gets logical CPU slots for every process the job starts (they mostly wait on each other).
    placement = config.placement
    slots = placement.train_world_size + _num_engines(config) * placement.rollout_num_gpus_per_engine + 8
    num_cpus = None if use_gpus() else max(slots, os.cpu_count() or 1)
    num_gpus = _local_gpu_budget(config) if use_gpus() else None  # --num-gpus-per-node caps this node's GPUs
    # A new local instance turns token authentication on (Ray's default, which the run keeps) and warns about
    # it on every start; the warning is not news to a miles user, so that one logger is quiet during the start.
    auth_logger = logging.getLogger(_RAY_AUTH_SETUP_LOGGER)
    level = auth_logger.level
    auth_logger.setLevel(logging.ERROR)
    try:
        ray.init(address=LOCAL_RAY, num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env,
                 include_dashboard=False, log_to_driver=True, _temp_dir=make_run_ray_temp_dir(),
                 _system_config=local_ray_system_config())
    finally:
        auth_logger.setLevel(level)


def _local_gpu_budget(config: RunConfig) -> int:
    import torch

    return min(config.placement.num_gpus_per_node, torch.cuda.device_count())


# Set by `ray job submit` in the driver's environment: the job's config, its runtime_env included.
_RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def worker_env_vars(config: RunConfig, api_key: str, environ=os.environ) -> dict[str, str]:
    """The environment every Ray worker of the run gets: the offline settings, the allocator's (growing segments
    unless set), --train-env-vars and the path of the key file. Joining a cluster (RAY_ADDRESS), whose other nodes
    may not see this node's files, the key itself goes too (it then lands in that cluster's logs,
    docs/security.md), unless the key file is one the user exported (MILES_API_KEY_FILE outside the run's folder:
    storage every node shares).

    Inside a submitted job (`ray job submit`) the job's own runtime_env already reaches every worker, and Ray
    refuses a `ray.init` runtime_env that sets any variable the job sets (even to the same value): those are
    left to the job (they are in this process's environment too, so the values agree)."""
    from miles.utils.auth import API_KEY_ENV, API_KEY_FILE_ENV, RUN_FOLDER_ENV

    env = {k: environ[k] for k in _FORWARDED_ENV if k in environ}
    # Growing segments from each process's start, unless the user configured the allocator: without the variable
    # (the trainer turning them on once it runs, miles/utils/cuda_allocator.py) an H100 full fine-tune's step ran
    # 3-4 s slower, with up to 77 allocator retries, than with it (one launch each, the process it acted through
    # not isolated: bench/RESULTS.md, twenty-third session).
    env.setdefault(ALLOC_CONF_VARIABLE, GROWING_SEGMENTS)
    env.update(config.trainer.train_env_vars)
    key_file = environ.get(API_KEY_FILE_ENV, "")
    run_folder = environ.get(RUN_FOLDER_ENV)
    shared_key_file = bool(key_file) and not (run_folder and key_file.startswith(run_folder + os.sep))
    if environ.get("RAY_ADDRESS") and not shared_key_file:  # a key file of the user's own reaches every node
        env[API_KEY_ENV] = api_key
    job_config = environ.get(_RAY_JOB_CONFIG_ENV)
    if job_config:
        job_env = (json.loads(job_config).get("runtime_env") or {}).get("env_vars") or {}
        for key in sorted(set(env) & set(job_env)):
            if job_env[key] != env[key]:
                logger.warning("%s differs between the job's runtime_env and this run; the job's value reaches the "
                               "workers", key)
            del env[key]
    return env


def _num_engines(config: RunConfig) -> int:
    if config.debug.train_only or config.debug.load_debug_rollout_data:
        return 0
    rollout_gpus = config.placement.rollout_num_gpus or config.placement.train_world_size
    return max(1, rollout_gpus // config.placement.rollout_num_gpus_per_engine)


def create_placement_groups(config: RunConfig) -> Placement:
    """Reserve every slot at once, so a job that does not fit fails before any model loads."""
    import ray
    from ray.util.placement_group import placement_group

    device = "cuda" if use_gpus() else "cpu"
    world = config.placement.train_world_size
    num_engines = _num_engines(config)
    gpus_per_engine = config.placement.rollout_num_gpus_per_engine
    on_gpu = device == "cuda"
    rollout_bundles = 0 if config.placement.colocate else num_engines * gpus_per_engine
    first_engine_bundle = 0 if config.placement.colocate else world
    engine_bundles = [first_engine_bundle + i * gpus_per_engine for i in range(num_engines)]
    bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
    bundles = [dict(bundle) for _ in range(world + rollout_bundles)]
    total = len(bundles)
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        from miles.utils.errors import MilesUserError

        raise MilesUserError(
            f"Ray could not reserve {total} {'GPU' if device == 'cuda' else 'CPU'} slots "
            f"(trainer {world} = --actor-num-nodes × --actor-num-gpus-per-node, rollout {rollout_bundles} = "
            f"--rollout-num-gpus); cluster resources: {ray.cluster_resources()}"
        )
    gpu_ids = _bundle_gpu_ids(pg, total) if device == "cuda" else []
    # trainer rank and engine supervisor; reward actors take the rest
    cpu_share = 0.45 if config.placement.colocate else 1.0
    train_gpu_share = TRAIN_GPU_SHARE if config.placement.colocate else 1.0
    train = Slots(pg, list(range(world)), train_gpu_share if on_gpu else 0.0, cpu_share, gpu_ids[:world])
    # An engine's actor only supervises its process, which owns the devices: a small share is enough.
    rollout = Slots(pg, engine_bundles, ROLLOUT_GPU_SHARE if on_gpu else 0.0, cpu_share, gpu_ids)
    placement = Placement(device, train, rollout, num_engines, gpus_per_engine, _bundle_nodes(pg, total),
                          ray.get_runtime_context().get_node_id())
    logger.info(
        "placement: %s, trainer ranks %d on nodes %s, engines %d × %d device(s) on nodes %s%s; driver on node %s%s",
        device,
        world,
        _short_ids(placement.nodes_of(train)),
        num_engines,
        gpus_per_engine,
        _short_ids(placement.nodes_of(rollout)),
        " (colocated)" if config.placement.colocate else "",
        _short_ids([placement.driver_node]),
        "; the run spans nodes: engines bind their node's address" if placement.spans_nodes else "",
    )
    return placement


def _bundle_nodes(pg, total: int) -> list[str]:
    """The node id of each bundle of a ready placement group (Ray decided where they went)."""
    from ray.util.placement_group import placement_group_table

    by_bundle = placement_group_table(pg)["bundles_to_node_id"]
    return [by_bundle[i] for i in range(total)]


def _short_ids(node_ids: list[str]) -> list[str]:
    return [node_id[:8] for node_id in node_ids]


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
