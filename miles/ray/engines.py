"""The engines of a run and their router: start, address, restart, stop.

Each engine is an OS process supervised by a Ray actor (`miles.ray.engine_actor`) on its placement slot; the
router (`python -m miles.router`) is a child process of the driver. Engines and router bind 127.0.0.1 and
require the run's key, which every process inherits as $MILES_API_KEY (`init_ray` creates it). A run that spans
nodes binds each engine to its node's address instead (the driver's router and the trainer must reach it), and
with `--use-distributed-post` the router to the driver's (the POST actors of other nodes call it). Engines are
added to the router as they come up, and removed and re-added when fault tolerance restarts one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import urllib.error
import urllib.request
from typing import Callable

from miles.config.sections import RunConfig
from miles.engine.server_args import ServerArgs
from miles.utils.auth import auth_headers
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 20.0  # for the engines and the router to exit after being asked to


def build_server_args(config: RunConfig, device: str) -> ServerArgs:
    """The engine's settings: what miles decides, plus every `--sglang-<field>` passthrough value."""
    model, sampling = config.model, config.sampling
    return ServerArgs(
        model_path=model.hf_checkpoint,
        model_family=None if model.train_pipeline_config_path else model.diffusion_model_family_resolved,
        train_pipeline_config_path=model.train_pipeline_config_path,
        model_backend_path=model.model_backend_path,
        # the engines import the SDE step backend from their own flags; requests never carry a module path
        sde_step_backend_path=sampling.sde_step_backend_path,
        rollout_patch_group=",".join(sampling.rollout_patch_group),
        forward_tile=sampling.parity_forward_tile,
        # by default the trainer's micro-batch: a forward with its backward holds what a trainer micro-batch holds
        rollout_gradient_tile=(config.trainer.rollout_gradient_tile or config.data.micro_batch_size)
        if config.trainer.diffusion_rollout_gradient else 0,
        tp_size=config.placement.rollout_num_gpus_per_engine,
        random_seed=sampling.rollout_seed,
        dtype=config.trainer.diffusion_forward_dtype,
        device=device,
        generator_device=sampling.diffusion_generator_device if device == "cuda" else "cpu",
        # colocated engines release their weights while the trainer trains, unless the trainer is on the host
        release_buffers_ahead=config.placement.colocate and device == "cuda" and not config.trainer.on_host,
        **config.engine.passthrough,
    )


def _wait_with_progress(refs: list, description: str) -> list:
    """`ray.get(refs)` with a progress bar over the ones done (engines take tens of seconds to load)."""
    import ray

    from miles.utils.progress import progress_bar

    pending = list(refs)
    with progress_bar(len(refs), description, unit="engine") as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)  # re-raises an engine's start-up error at once
            bar.update(len(done))
    return ray.get(refs)


def _get_json(url: str, timeout: float = 60.0) -> dict:
    request = urllib.request.Request(url, headers=auth_headers())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _post_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(payload or {}).encode()
    headers = {"Content-Type": "application/json", **auth_headers()}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else {}


def post_to_engines(urls: list[str], path: str, log_dir: str) -> None:
    """POST `path` to every engine in turn; an engine's error answer raises with its own words (out of memory,
    most often) and where its log is, not only the status."""
    for url in urls:
        try:
            _post_json(f"{url}{path}")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"engine {url} answered {err.code} to POST {path}: {_error_text(err)}; "
                               f"its log is in {log_dir}/") from None


def _error_text(err: urllib.error.HTTPError) -> str:
    """The `error` field of an engine's JSON error body (server.py), else the body's start."""
    body = err.read().decode(errors="replace")
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:300] or err.reason


class EngineFleet:
    """The engine actors of a run and the router in front of them."""

    def __init__(self, config: RunConfig, placement) -> None:
        self.config = config
        self.placement = placement
        self.server_args = build_server_args(config, placement.device)
        self.actors: list = []
        self.urls: list[str] = []
        self.router_process = None
        self.router_url: str | None = None
        self.on_restart: Callable[[str], None] | None = None
        self._restart_lock = threading.Lock()  # the watcher and a failed call may both find an engine dead
        self.restarts = 0  # engines restarted so far: a failed call tells an engine that died and came back meanwhile
        self.log_dir = os.path.join(config.logging.output_dir, "engine_logs")
        self._starting: list = []  # the actors' start() calls, between launch() and wait_until_started()

    def start(self) -> None:
        self.launch()
        self.wait_until_started()

    def launch(self) -> None:
        """Create the engine actors and start their processes loading; `wait_until_started` collects them."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.ray.engine_actor import engine_actor_class

        os.makedirs(self.log_dir, exist_ok=True)
        slots = self.placement.rollout
        actor_class = engine_actor_class(num_gpus=slots.gpu_share, num_cpus=slots.cpu_share)
        for engine_index, bundle_index in enumerate(slots.bundle_indices):
            server_args = self.server_args
            if self.placement.device == "cuda":
                # The engine process sees exactly its GPUs; the actor sits on the first of them.
                gpu_ids = slots.gpu_ids[bundle_index : bundle_index + self.placement.gpus_per_engine]
                env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_ids)}
            else:
                env = {}
            actor = actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    slots.placement_group, placement_group_bundle_index=bundle_index
                )
            ).remote(server_args, log_path=os.path.join(self.log_dir, f"engine{engine_index}.log"), env=env,
                     bind_node_address=self.placement.spans_nodes)
            self.actors.append(actor)
        self._starting = [actor.start.remote() for actor in self.actors]

    def wait_until_started(self) -> None:
        import ray

        from miles.router.router import RouterConfig, launch_router_process

        try:
            self.urls = _wait_with_progress(self._starting, "starting rollout engines")
        except Exception as err:
            raise MilesUserError(
                f"a rollout engine failed to start ({err.__class__.__name__}: {str(err).splitlines()[-1]}); "
                f"its log is in {self.log_dir}/"
            ) from err
        # the router serves the driver's rollout client; the per-node POST actors of --use-distributed-post may
        # call it from other nodes
        router_host = "127.0.0.1"
        if self.placement.spans_nodes and self.config.rollout.use_distributed_post:
            router_host = ray.util.get_node_ip_address()
        self.router_process, self.router_url = launch_router_process(
            RouterConfig.from_rollout(self.config.rollout), self.urls, host=router_host
        )
        logger.info("engines up: %s, router %s", self.urls, self.router_url)

    def engine_urls(self) -> list[str]:
        return list(self.urls)

    def post_all(self, path: str) -> None:
        post_to_engines(self.urls, path, self.log_dir)

    def load_seconds(self) -> list[float]:
        """Each engine's model load (from its `/server_info`): what the trainer's start-up overlaps."""
        return [float(_get_json(f"{url}/server_info").get("load_seconds", 0.0)) for url in self.urls]

    def memory_stats(self) -> list:
        """Each engine's GPU memory (`DeviceMemory`), from its `/server_info`; empty for CPU engines."""
        from miles.utils.device_memory import DeviceMemory

        stats = []
        for url in self.urls:
            memory = _get_json(f"{url}/server_info").get("cuda_memory")
            if memory:
                stats.append(DeviceMemory(**memory))
        return stats

    def dead_engines(self) -> list[int]:
        """Indices of the engines whose process is gone (an actor that died itself counts as dead too)."""
        import ray

        dead = []
        for index, actor in enumerate(self.actors):
            try:
                if not ray.get(actor.is_alive.remote(), timeout=30):
                    dead.append(index)
            except ray.exceptions.RayError:
                dead.append(index)
        return dead

    def describe_engine(self, index: int) -> str:
        return f"rollout engine {index} ({self.urls[index]}; its log: {self.log_dir}/engine{index}.log)"

    def restart_dead_engines(self) -> list[str]:
        """Restart every engine whose process died; the new one gets the current weights before serving. Waits for
        a restart under way on another thread (the watcher) first."""
        with self._restart_lock:
            return self._restart_dead_engines()

    def _restart_dead_engines(self) -> list[str]:
        import ray

        restarted = []
        dead = set(self.dead_engines())
        for index in range(len(self.actors)):
            if index not in dead:
                continue
            old_url = self.urls[index]
            logger.warning("engine %d (%s) died; restarting it", index, old_url)
            _post_json(f"{self.router_url}/remove_worker", {"url": old_url})
            new_url = ray.get(self.actors[index].restart.remote())
            if self.on_restart is not None:
                self.on_restart(new_url)
            self.urls[index] = new_url
            _post_json(f"{self.router_url}/add_worker", {"url": new_url})
            self.restarts += 1
            restarted.append(new_url)
        return restarted

    def kill_engine(self, index: int) -> None:
        """Crash one engine (fault-tolerance drills and tests)."""
        import ray

        ray.get(self.actors[index].kill.remote())

    def shutdown(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop the engines (through their actors, then the actors) and the router; idempotent.

        Bounded in time: an actor still busy starting or restarting its engine (a signal arrived meanwhile)
        cannot take `stop` before it finishes, so it is killed after `timeout`; the run's cleanup sweep
        (miles.ray.shutdown) then ends the engine process it leaves behind.
        """
        import ray

        actors, self.actors = self.actors, []
        if actors:
            try:
                ray.get([actor.stop.remote() for actor in actors], timeout=timeout)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as err:
                logger.warning("engines did not stop within %.0fs (%s); killing their actors", timeout,
                               type(err).__name__)
            for actor in actors:
                ray.kill(actor)
        router, self.router_process = self.router_process, None
        if router is not None:
            router.terminate()
            try:
                router.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("router (pid %d) ignored SIGTERM for %.0fs; killing it", router.pid, timeout)
                router.kill()
                router.wait()
            if router.stdout is not None:
                router.stdout.close()
