"""The miles router: one HTTP front for all rollout engines (`--use-miles-router`).

- `POST /rollout/generate`: forwarded as raw bytes to the live engine with the fewest requests in flight
  (ties: the one used least recently). The engine's answer comes back unchanged, with the header
  `X-Miles-Engine-Url` naming the engine. If the engine cannot be reached or drops the connection, the router
  marks it dead at once and answers 502 with JSON {"error", "engine_url", "retryable": true}; the client decides
  whether to retry (`--use-fault-tolerance`), and the next pick skips the dead engine. No live engine: 503.
  A forward that exceeds `--miles-router-timeout` answers 504.
- Health: every `health_check_interval` seconds each engine's `GET /health` is polled (timeout
  `health_check_timeout`); after `failure_threshold` consecutive failures the engine is dead; a success brings
  it back.
- `POST /add_worker` / `POST /remove_worker` (JSON {"url": ...} or `?url=`), `GET /workers`, `GET /health`.
  A worker URL is exactly `http[s]://host:port` (no path, query, fragment or user info; 400 otherwise), so the
  router can only ever be pointed at an engine's root.
- Every endpoint requires `Authorization: Bearer <api key>` (401 otherwise); the router sends the same key to
  the engines (one key per run, $MILES_API_KEY; docs/security.md). A client that disconnects cancels its
  forward, which cancels the request on the engine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from miles.utils.auth import (
    API_KEY_ENV,
    auth_headers,
    bearer_auth_middleware,
    json_errors_middleware,
    resolve_api_key,
    warn_if_exposed,
)
from miles.utils.http_guard import ConnectionLimits, GuardedSite, ServerGuard, quiet_bad_requests

if TYPE_CHECKING:
    from miles.config.sections import RolloutConfig

logger = logging.getLogger(__name__)

ENGINE_URL_HEADER = "X-Miles-Engine-Url"
FORWARDED_PATHS = ("/rollout/generate",)


@dataclass
class RouterConfig:
    health_check_interval: float = 30.0
    health_check_timeout: float = 30.0
    health_check_first_wait: float = 0.0
    failure_threshold: int = 3
    timeout: float | None = None  # per forwarded request; None = no limit
    max_connections: int | None = None  # total open connections to engines; None = unlimited
    max_request_bytes: int = 16 << 20  # largest request body a client may send (generate bodies are small)
    connection_read_timeout: float = 30.0  # seconds a client has for a request head, then for its body
    max_client_connections: int = 1024  # open client connections; more get 503 (miles.utils.http_guard)

    @classmethod
    def from_rollout(cls, rollout: "RolloutConfig") -> "RouterConfig":
        """From the run's flags (`--rollout-health-check-*`, `--miles-router-*`)."""
        return cls(
            health_check_interval=rollout.rollout_health_check_interval,
            health_check_timeout=rollout.rollout_health_check_timeout,
            health_check_first_wait=rollout.rollout_health_check_first_wait,
            failure_threshold=rollout.miles_router_health_check_failure_threshold,
            timeout=rollout.miles_router_timeout,
            max_connections=rollout.miles_router_max_connections,
        )


@dataclass
class WorkerState:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    alive: bool = True
    requests_total: int = 0
    requests_failed: int = 0
    last_used: float = 0.0
    last_error: str | None = None
    added_at: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "alive": self.alive,
            "in_flight": self.in_flight,
            "consecutive_failures": self.consecutive_failures,
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "last_error": self.last_error,
        }


class WorkerUrlError(ValueError):
    """A worker URL that is not exactly `http[s]://host:port`."""


_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def normalize_worker_url(url: object) -> str:
    """`http[s]://host:port` of an engine, or WorkerUrlError. A bare `host:port` means http.

    Nothing but scheme, host and port is accepted: a path, query or fragment would make the router send its
    requests (and its API key) somewhere other than an engine's root, and user info could smuggle credentials."""
    if not isinstance(url, str) or not 0 < len(url) <= 512:
        raise WorkerUrlError(f"a worker URL must be a non-empty string, got {str(url)[:80]!r}")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise WorkerUrlError(f"worker URL {url[:80]!r} contains whitespace or control characters")
    text = url if "://" in url else f"http://{url}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise WorkerUrlError(f"worker URL {url!r}: the scheme must be http or https")
    if "@" in parts.netloc:
        raise WorkerUrlError(f"worker URL {url!r}: user info is not allowed")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in text or "#" in text:
        raise WorkerUrlError(f"worker URL {url!r}: only http[s]://host:port, no path, query or fragment")
    try:
        port = parts.port
    except ValueError as err:
        raise WorkerUrlError(f"worker URL {url!r}: {err}") from err
    host = parts.hostname
    if not host or port is None or port == 0:
        raise WorkerUrlError(f"worker URL {url!r}: needs a host and a port (http://host:port)")
    try:
        address = ipaddress.ip_address(host)
        netloc_host = f"[{address.compressed}]" if address.version == 6 else address.compressed
    except ValueError:
        if _HOST_NAME.fullmatch(host) is None:
            raise WorkerUrlError(f"worker URL {url!r}: {host!r} is not a valid host name") from None
        netloc_host = host.lower()
    return f"{parts.scheme}://{netloc_host}:{port}"


class Router:
    """The router's state and HTTP app; `start()` binds it in the running event loop."""

    def __init__(self, config: RouterConfig, worker_urls: list[str] | None = None, api_key: str | None = None):
        """`api_key`: what clients must send and what the router sends to the engines (default $MILES_API_KEY)."""
        self.config = config
        api_key = resolve_api_key(api_key, "the router")
        self._engine_headers = auth_headers(api_key)
        self.workers: dict[str, WorkerState] = {}
        for url in worker_urls or []:
            self.add_worker(url)
        self._tick = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._app_runner: web.AppRunner | None = None
        self.url: str | None = None
        quiet_bad_requests(api_key)
        self.guard = ServerGuard(ConnectionLimits(read_timeout_s=config.connection_read_timeout,
                                                  max_connections=config.max_client_connections), "the router")
        self.app = web.Application(
            client_max_size=config.max_request_bytes,
            middlewares=self.guard.middlewares(json_errors_middleware, bearer_auth_middleware(api_key)),
        )
        self.app.add_routes(
            [
                web.post("/rollout/generate", self.handle_forward),
                web.post("/add_worker", self.handle_add_worker),
                web.post("/remove_worker", self.handle_remove_worker),
                web.get("/workers", self.handle_workers),
                web.get("/health", self.handle_health),
            ]
        )

    # ---- workers --------------------------------------------------------------------------------------------
    def add_worker(self, url: str) -> WorkerState:
        url = normalize_worker_url(url)
        if url not in self.workers:
            self.workers[url] = WorkerState(url)
            logger.info("router: added engine %s", url)
        return self.workers[url]

    def remove_worker(self, url: str) -> bool:
        return self.workers.pop(normalize_worker_url(url), None) is not None

    def pick_worker(self) -> WorkerState | None:
        live = [w for w in self.workers.values() if w.alive]
        if not live:
            return None
        return min(live, key=lambda w: (w.in_flight, w.last_used))

    def mark_failure(self, worker: WorkerState, reason: str, fatal: bool) -> None:
        worker.consecutive_failures += 1
        worker.last_error = reason
        if fatal or worker.consecutive_failures >= self.config.failure_threshold:
            if worker.alive:
                logger.warning("router: engine %s marked dead (%s)", worker.url, reason)
            worker.alive = False

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        connector = aiohttp.TCPConnector(limit=self.config.max_connections or 0)
        self._session = aiohttp.ClientSession(connector=connector)
        warn_if_exposed(host, "the router")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # handler_cancellation: a client that disconnects cancels the forward, and so the engine's request
        self._app_runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._app_runner.setup()
        await GuardedSite(self._app_runner, sock, self.guard).start()
        bound_host, bound_port = sock.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return self.url

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        if self._app_runner is not None:
            await self._app_runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- health ---------------------------------------------------------------------------------------------
    async def check_worker(self, worker: WorkerState) -> bool:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout)
            async with self._session.get(f"{worker.url}/health", timeout=timeout,
                                         headers=self._engine_headers) as response:
                healthy = response.status == 200
                reason = f"/health answered {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            healthy, reason = False, f"/health failed: {type(err).__name__}: {err}"
        if healthy:
            if not worker.alive:
                logger.info("router: engine %s is healthy again", worker.url)
            worker.alive = True
            worker.consecutive_failures = 0
        else:
            self.mark_failure(worker, reason, fatal=False)
        return healthy

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_worker(w) for w in list(self.workers.values())))

    async def _health_loop(self) -> None:
        if self.config.health_check_first_wait > 0:
            await asyncio.sleep(self.config.health_check_first_wait)
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_check_interval)

    # ---- handlers -------------------------------------------------------------------------------------------
    async def handle_forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        worker = self.pick_worker()
        if worker is None:
            return web.json_response(
                {"error": f"no live engine among {len(self.workers)} registered", "retryable": True}, status=503
            )
        worker.in_flight += 1
        worker.requests_total += 1
        worker.last_used = next(self._tick)
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.timeout)
        headers = {"Content-Type": request.headers.get("Content-Type", "application/octet-stream"),
                   **self._engine_headers}
        try:
            async with self._session.post(
                worker.url + request.path, data=body, headers=headers, timeout=timeout
            ) as response:
                payload = await response.read()
                status = response.status
                content_type = response.headers.get("Content-Type", "application/octet-stream")
                retry_after = response.headers.get("Retry-After")  # an engine at its admission limit
        except asyncio.TimeoutError:
            worker.requests_failed += 1
            return web.json_response(
                {"error": f"engine {worker.url} did not answer within {self.config.timeout}s", "engine_url": worker.url,
                 "retryable": True},
                status=504,
                headers={ENGINE_URL_HEADER: worker.url},
            )
        except (aiohttp.ClientError, OSError) as err:
            worker.requests_failed += 1
            self.mark_failure(worker, f"forward failed: {type(err).__name__}: {err}", fatal=True)
            return web.json_response(
                {"error": f"engine {worker.url} failed: {type(err).__name__}: {err}", "engine_url": worker.url,
                 "retryable": True},
                status=502,
                headers={ENGINE_URL_HEADER: worker.url},
            )
        finally:
            worker.in_flight -= 1
        if status >= 500:
            worker.requests_failed += 1
        headers = {ENGINE_URL_HEADER: worker.url, "Content-Type": content_type}
        if retry_after is not None:
            headers["Retry-After"] = retry_after
        return web.Response(body=payload, status=status, headers=headers)

    async def _url_from(self, request: web.Request) -> str:
        """The normalized worker URL of `?url=` or a JSON body {"url": ...}; WorkerUrlError (a 400) otherwise."""
        url = request.query.get("url")
        if url is None and request.body_exists:
            try:
                body = json.loads(await request.read())
            except (ValueError, UnicodeDecodeError) as err:
                raise WorkerUrlError(f"the body must be JSON {{\"url\": ...}}: {err}") from err
            if not isinstance(body, dict):
                raise WorkerUrlError('the body must be a JSON object {"url": ...}')
            url = body.get("url")
        if url is None:
            raise WorkerUrlError(f"{request.path} needs a url (JSON {{\"url\": ...}} or ?url=)")
        return normalize_worker_url(url)

    async def handle_add_worker(self, request: web.Request) -> web.Response:
        try:
            url = await self._url_from(request)
        except WorkerUrlError as err:
            return web.json_response({"error": str(err)}, status=400)
        worker = self.add_worker(url)
        # a re-added engine (restarted on the same URL) starts alive with a clean record
        worker.alive, worker.consecutive_failures = True, 0
        return web.json_response({"ok": True, "workers": [w.url for w in self.workers.values()]})

    async def handle_remove_worker(self, request: web.Request) -> web.Response:
        try:
            url = await self._url_from(request)
        except WorkerUrlError as err:
            return web.json_response({"error": str(err)}, status=400)
        removed = self.remove_worker(url)
        return web.json_response({"ok": removed, "workers": [w.url for w in self.workers.values()]},
                                 status=200 if removed else 404)

    async def handle_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [w.as_dict() for w in self.workers.values()]})

    async def handle_health(self, request: web.Request) -> web.Response:
        live = sum(w.alive for w in self.workers.values())
        return web.json_response({"ok": True, "live_workers": live, "workers": len(self.workers)})


# ---- running the router as its own process ---------------------------------------------------------------


def router_argv(config: RouterConfig, worker_urls: list[str], host: str = "127.0.0.1", port: int = 0,
                url_file: str | None = None) -> list[str]:
    """The `python -m miles.router` command line for this configuration."""
    argv = [
        "--host", host,
        "--port", str(port),
        "--health-check-interval", str(config.health_check_interval),
        "--health-check-timeout", str(config.health_check_timeout),
        "--health-check-first-wait", str(config.health_check_first_wait),
        "--failure-threshold", str(config.failure_threshold),
    ]
    if config.timeout is not None:
        argv += ["--timeout", str(config.timeout)]
    if config.max_connections is not None:
        argv += ["--max-connections", str(config.max_connections)]
    argv += ["--max-request-bytes", str(config.max_request_bytes)]
    if url_file:
        argv += ["--url-file", url_file]
    for url in worker_urls:
        argv += ["--worker-url", url]
    return argv


def launch_router_process(config: RouterConfig, worker_urls: list[str], host: str = "127.0.0.1",
                          startup_timeout: float = 60.0, api_key: str | None = None):
    """Start `python -m miles.router` and wait for its URL; returns (subprocess.Popen, url).

    The key (`api_key`, default this process's $MILES_API_KEY) reaches the child through its environment. The
    router dies with this process, even one killed by SIGKILL (`miles.utils.parent_death`)."""
    import os
    import subprocess
    import sys

    from miles.utils.parent_death import mark_parent

    env = mark_parent(dict(os.environ))
    env[API_KEY_ENV] = resolve_api_key(api_key, "the router")
    process = subprocess.Popen(
        [sys.executable, "-m", "miles.router", *router_argv(config, worker_urls, host)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    url = read_announced_url(process, "MILES_ROUTER_URL=", startup_timeout, "router")
    return process, url


def read_announced_url(process, prefix: str, timeout: float, what: str) -> str:
    """Read the child's stdout until the `prefix<url>` line; fail clearly if it exits or takes too long."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.kill()
                raise TimeoutError(f"{what} did not announce its URL within {timeout}s")
            if not selector.select(timeout=remaining):
                continue
            line = process.stdout.readline()
            if not line:
                code = process.wait()
                raise RuntimeError(f"{what} exited with status {code} before announcing its URL")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
    finally:
        selector.close()
