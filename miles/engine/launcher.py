"""Start an engine as its own OS process and wait until it serves (used by the Ray actor, tests, benchmarks)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from miles.engine.server_args import ServerArgs
from miles.utils.auth import API_KEY_ENV
from miles.utils.cuda_allocator import ALLOC_CONF_VARIABLE, GROWING_SEGMENTS
from miles.utils.parent_death import mark_parent

logger = logging.getLogger(__name__)

URL_PREFIX = "MILES_ENGINE_URL="

# An engine's CUDA allocator grows its segments in place unless the run's environment sets
# PYTORCH_CUDA_ALLOC_CONF: its work alternates denoising tiles and VAE decodes of other sizes, whose freed blocks
# fixed segments strand (2.3 GiB reserved beyond the allocated peak at SD3.5-Medium, bench/RESULTS.md). Set for
# the whole process at launch: an engine exports no CUDA memory, it only opens the handles the trainer exports
# (the trainer, which does export, keeps its shared buffers in fixed segments: miles/utils/cuda_allocator.py).
ENGINE_CUDA_ALLOC_CONF = GROWING_SEGMENTS


@dataclass
class EngineProcess:
    process: subprocess.Popen
    url: str
    log_path: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (crash simulation); waits for the process to be gone."""
        if self.alive():
            self.process.kill()
        self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def engine_environment(inherited: dict[str, str], env: dict[str, str] | None = None,
                       api_key: str | None = None) -> dict[str, str]:
    """The engine process's environment: this process's (`inherited`), offline hub defaults, the engine's
    allocator default (`ENGINE_CUDA_ALLOC_CONF`), then `env`'s entries and the key."""
    child_env = mark_parent(dict(inherited))
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("TRANSFORMERS_OFFLINE", "1")
    child_env.setdefault(ALLOC_CONF_VARIABLE, ENGINE_CUDA_ALLOC_CONF)
    child_env.update(env or {})
    if api_key is not None:
        child_env[API_KEY_ENV] = api_key
    return child_env


def spawn_engine(server_args: ServerArgs, env: dict[str, str] | None = None, log_path: str | None = None,
                 api_key: str | None = None):
    """Start `python -m miles.engine` with these args without waiting (see `wait_engine`).

    The engine's key (`api_key`, default $MILES_API_KEY of this process) travels in the child's environment,
    never on its command line. The engine dies with this process (`miles.utils.parent_death`)."""
    from miles.engine.__main__ import server_args_to_argv

    child_env = engine_environment(dict(os.environ), env, api_key)
    stderr = open(log_path, "a") if log_path else None
    process = subprocess.Popen(
        [sys.executable, "-m", "miles.engine", *server_args_to_argv(server_args)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=child_env,
        text=True,
    )
    if stderr is not None:
        stderr.close()  # the child holds its own descriptor
    return process


def wait_engine(process: subprocess.Popen, log_path: str | None, startup_timeout: float, what: str) -> EngineProcess:
    """Wait for a spawned engine's URL line (model loaded, port bound); kill it and raise on failure."""
    from miles.router.router import read_announced_url

    began = time.monotonic()
    try:
        url = read_announced_url(process, URL_PREFIX, startup_timeout, what)
    except Exception as err:
        if process.poll() is None:
            process.kill()
            process.wait()
        detail = ""
        if log_path and os.path.exists(log_path):
            with open(log_path) as f:
                detail = "; last log lines:\n" + "".join(f.readlines()[-15:])
        raise RuntimeError(f"{what} failed to start: {err}{detail}") from err
    logger.info("%s (pid %d) up at %s after %.1fs", what, process.pid, url, time.monotonic() - began)
    return EngineProcess(process, url, log_path)


def launch_engine(
    server_args: ServerArgs,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    startup_timeout: float = 300.0,
    api_key: str | None = None,
) -> EngineProcess:
    """Spawn `python -m miles.engine` with these args; returns once it printed its URL (model loaded, bound).

    `env` entries are added to the current environment (e.g. CUDA_VISIBLE_DEVICES). The engine's logs go to
    `log_path` (appended) or to this process's stderr. `api_key`: see `spawn_engine`.
    """
    process = spawn_engine(server_args, env, log_path, api_key)
    return wait_engine(process, log_path, startup_timeout, f"engine for {server_args.model_path!r}")


def launch_engines(
    all_server_args: list[ServerArgs], log_dir: str | None = None, startup_timeout: float = 300.0
) -> list[EngineProcess]:
    """Start several engines at once (their model loads overlap) and wait for all of them."""
    processes = []
    for i, server_args in enumerate(all_server_args):
        log_path = os.path.join(log_dir, f"engine{i}.log") if log_dir else None
        processes.append((spawn_engine(server_args, log_path=log_path), log_path))
    engines: list[EngineProcess] = []
    try:
        for i, (process, log_path) in enumerate(processes):
            engines.append(wait_engine(process, log_path, startup_timeout, f"engine {i}"))
    except Exception:
        for process, _ in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        raise
    return engines


class BackgroundLoop:
    """An asyncio event loop on a daemon thread: runs an in-process EngineServer or Router beside sync code
    (benchmarks, client tests). `run(coroutine)` blocks until the coroutine finished on that loop."""

    def __init__(self, name: str = "miles-background-loop"):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float | None = None):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
