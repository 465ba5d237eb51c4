"""A Ray actor that supervises one engine process (docs/design.md §3: one OS process per engine, started by an actor).

The actor holds the engine's GPU share; `start()` launches `python -m miles.engine ...` with
CUDA_VISIBLE_DEVICES set to the GPUs Ray gave the actor (plus `base_gpu_id`/`tp_size` within them), waits
until the engine announced its URL and answers `GET /health`, and returns the URL. `kill()` is a crash
(SIGKILL, for tests and fault-tolerance drills), `restart()` starts a fresh process (a new URL), `stop()` a
clean shutdown.

    EngineActor = ray.remote(EngineSupervisor)          # or use `engine_actor_class(num_gpus=..., num_cpus=...)`
    actor = EngineActor.remote(server_args, log_path="/tmp/engine0.log")
    url = ray.get(actor.start.remote())
"""

from __future__ import annotations

import dataclasses
import logging
import time
import urllib.request

from miles.engine.launcher import EngineProcess, launch_engine
from miles.engine.server_args import ServerArgs
from miles.utils.auth import auth_headers

logger = logging.getLogger(__name__)


def wait_for_health(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(f"{url}/health", headers=auth_headers())
            with urllib.request.urlopen(request, timeout=min(5.0, timeout)) as response:
                if response.status == 200:
                    return
        except OSError as err:  # URLError and connection errors are OSErrors
            last_error = err
        time.sleep(0.1)  # polling a remote process's readiness; there is no event to wait on
    raise TimeoutError(f"engine {url} did not become healthy within {timeout}s: {last_error}")


class EngineSupervisor:
    """The actor body (plain class, so it also works without Ray in tests)."""

    def __init__(self, server_args: ServerArgs, log_path: str | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 600.0, bind_node_address: bool = False):
        """`bind_node_address`: the engine binds this node's address instead of `server_args.host` (a run that
        spans nodes: its engines must be reachable from the others)."""
        if bind_node_address:
            import ray

            server_args = dataclasses.replace(server_args, host=ray.util.get_node_ip_address())
        self.server_args = server_args
        self.log_path = log_path
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.engine: EngineProcess | None = None
        self.restarts = 0

    def _env(self) -> dict[str, str]:
        env = dict(self.extra_env)
        if "CUDA_VISIBLE_DEVICES" in env:  # the caller placed the engine explicitly
            return env
        try:
            import ray

            gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        except Exception:  # outside a Ray worker
            gpu_ids = []
        if gpu_ids:
            lo = self.server_args.base_gpu_id
            selected = [str(int(g)) for g in gpu_ids[lo : lo + self.server_args.tp_size]] or [str(int(gpu_ids[0]))]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(selected)
        return env

    def start(self) -> str:
        if self.engine is not None and self.engine.alive():
            return self.engine.url
        args = self.server_args
        env = self._env()
        if "CUDA_VISIBLE_DEVICES" in env:
            args = dataclasses.replace(args, base_gpu_id=0)  # the child sees only its own GPUs
        self.engine = launch_engine(args, env=env, log_path=self.log_path,
                                    startup_timeout=self.startup_timeout)
        wait_for_health(self.engine.url, timeout=self.startup_timeout)
        return self.engine.url

    def url(self) -> str | None:
        return None if self.engine is None else self.engine.url

    def pid(self) -> int | None:
        return None if self.engine is None else self.engine.pid

    def is_alive(self) -> bool:
        return self.engine is not None and self.engine.alive()

    def kill(self) -> None:
        """Crash the engine (SIGKILL), leaving the actor up so that it can restart it."""
        if self.engine is not None:
            self.engine.kill()

    def restart(self) -> str:
        if self.engine is not None:
            self.engine.stop()
        self.engine = None
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def node_ip(self) -> str:
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:
            return "127.0.0.1"

    def __del__(self):  # an actor that dies takes its engine with it
        try:
            self.stop()
        except Exception as err:  # interpreter shutdown: modules may be gone; say so rather than stay silent
            logger.debug("engine supervisor cleanup failed: %s", err)


def engine_actor_class(num_gpus: float = 0, num_cpus: float = 1, **options):
    """The Ray actor class with its resources, e.g. `engine_actor_class(num_gpus=0.25)`."""
    import ray

    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, **options)(EngineSupervisor)
