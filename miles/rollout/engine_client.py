"""The rollout side's HTTP client for `POST /rollout/generate` through the miles router.

`EngineClient.generate(request)` sends one microgroup and returns the decoded response and the engine's URL.
- Concurrency: at most `--sglang-server-concurrency` requests in flight per engine (× the engines the router
  knows at start).
- Failures: the router answers 502 (engine died mid-request, already marked dead), 503 (no live engine) or
  504 (`--miles-router-timeout`); an engine answers 500 for an internal failure. With `--use-fault-tolerance`
  the request is sent again — the router then picks a live engine — after up to `max_attempts` engine
  failures, and while no engine is alive it keeps waiting (backing off up to 2 s) for
  max(60 s, 10 × `--rollout-health-check-interval`), the time the supervisor needs to restart one. A request is
  retried as a whole and its samples are only filled from the one answer that succeeded, so no sample is lost
  or counted twice. Without fault tolerance, or when the retries run out, `EngineRequestError` says which
  engine failed and why. 400 (a request the engine cannot serve) is a `MilesUserError`.
- Parsing: responses are decoded on a pool of `--rollout-parser-num-workers` threads when > 1, so large
  trajectory bodies never stall the event loop that keeps the other requests flowing.
- `--use-distributed-post`: the POSTs go through per-node Ray actors (`HttpPostActor`,
  MILES_HTTP_POST_ACTORS_PER_NODE per node, default 1) instead of this process's HTTP client.
- Auth: every request carries `Authorization: Bearer $MILES_API_KEY` (the run's key); a 401 is a
  `MilesUserError` that says so.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from miles.config.sections import RunConfig
from miles.engine.protocol import CONTENT_TYPE, GenerateRequest, GenerateResponse, decode_response, encode_request
from miles.utils.auth import API_KEY_ENV, auth_headers
from miles.utils.errors import MilesUserError, PartDiedError

logger = logging.getLogger(__name__)

ENGINE_URL_HEADER = "X-Miles-Engine-Url"
RETRYABLE_STATUS = (500, 502, 503, 504)
POST_ACTORS_ENV = "MILES_HTTP_POST_ACTORS_PER_NODE"


class EngineRequestError(PartDiedError):
    """A generate request failed for good (engine crash without fault tolerance, or retries exhausted): the run
    ends in this one line (a `PartDiedError`, exit status 3)."""


class HttpPostActor:
    """Ray actor body for `--use-distributed-post`: one HTTP client per actor, POSTs raw bytes."""

    def __init__(self, max_connections: int = 0):
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def post(self, url: str, body: bytes, timeout: float | None,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """`headers`: the caller's auth header (passed per call: the actor keeps no key of its own)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._max_connections))
        try:
            async with self._session.post(
                url, data=body, headers={"Content-Type": CONTENT_TYPE, **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                return response.status, dict(response.headers), await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            return 599, {}, f"{type(err).__name__}: {err}".encode()


# Ray actor handles per (job, actors per node): named actors live as long as a handle does, so this process
# keeps one set for all rollouts instead of starting new actors every rollout.
_POST_ACTOR_HANDLES: dict[tuple[str, int], list[Any]] = {}


def _post_actors(num_per_node: int) -> list[Any]:
    """Named per-node actors (created once per Ray job and process, then reused)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    key = (ray.get_runtime_context().get_job_id(), num_per_node)
    if key in _POST_ACTOR_HANDLES:
        return _POST_ACTOR_HANDLES[key]

    actor_class = ray.remote(num_cpus=0)(HttpPostActor)
    actors = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for i in range(num_per_node):
            actors.append(
                actor_class.options(
                    name=f"miles-http-post-{node['NodeID'][:12]}-{i}",
                    get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                ).remote()
            )
    _POST_ACTOR_HANDLES[key] = actors
    return actors


class EngineClient:
    """One per rollout call: owns the HTTP session, the concurrency cap and the parser pool."""

    def __init__(self, config: RunConfig, max_attempts: int = 5):
        self.router_url = (config.router_url or "").rstrip("/")
        if not self.router_url:
            raise MilesUserError("the router URL is not set (miles_router_url): the rollout needs the router "
                                 "(--use-miles-router)")
        rollout = config.rollout
        self.fault_tolerant = rollout.use_fault_tolerance
        self.max_attempts = max_attempts if self.fault_tolerant else 1
        self.timeout = rollout.miles_router_timeout
        self.per_engine_concurrency = rollout.sglang_server_concurrency
        self.retry_backoff = 0.2
        # how long a request waits for a live engine (the supervisor restarts dead ones every health interval)
        self.no_engine_wait = max(60.0, 10 * rollout.rollout_health_check_interval)
        workers = rollout.rollout_parser_num_workers
        self._parser_pool = ThreadPoolExecutor(workers, thread_name_prefix="miles-parser") if workers > 1 else None
        self._distributed = rollout.use_distributed_post
        self._post_actors: list[Any] = []
        self._actor_cycle = None
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._headers = auth_headers()
        self.stats = {"requests": 0, "retries": 0, "failed_engines": set()}

    async def __aenter__(self) -> "EngineClient":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        num_engines = await self._count_engines()
        self._semaphore = asyncio.Semaphore(max(1, num_engines) * self.per_engine_concurrency)
        if self._distributed:
            per_node = int(os.environ.get(POST_ACTORS_ENV, "1"))
            self._post_actors = _post_actors(max(1, per_node))
            self._actor_cycle = itertools.cycle(self._post_actors)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
        if self._parser_pool is not None:
            self._parser_pool.shutdown(wait=False)

    async def _count_engines(self) -> int:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.router_url}/workers", timeout=aiohttp.ClientTimeout(total=10),
                                         headers=self._headers) as r:
                if r.status == 401:
                    raise MilesUserError(_unauthorized(self.router_url))
                return len((await r.json())["workers"])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KeyError, ValueError) as err:
            raise EngineRequestError(f"router {self.router_url} unreachable: {type(err).__name__}: {err}") from err

    async def _post(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        url = f"{self.router_url}/rollout/generate"
        if self._distributed:
            return await next(self._actor_cycle).post.remote(url, body, self.timeout, self._headers)
        assert self._session is not None
        try:
            async with self._session.post(
                url,
                data=body,
                headers={"Content-Type": CONTENT_TYPE, **self._headers},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as response:
                return response.status, dict(response.headers), await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            return 599, {}, f"router {self.router_url} unreachable: {type(err).__name__}: {err}".encode()

    async def _decode(self, payload: bytes) -> GenerateResponse:
        if self._parser_pool is None:
            return decode_response(payload)
        return await asyncio.get_running_loop().run_in_executor(self._parser_pool, decode_response, payload)

    async def generate(self, request: GenerateRequest) -> tuple[GenerateResponse, str | None]:
        """POST one microgroup; returns (response, engine URL). Retries per the module docstring."""
        assert self._semaphore is not None, "use `async with EngineClient(config)`"
        body = encode_request(request)
        errors: list[str] = []
        engine_failures = 0
        waiting_since: float | None = None
        busy_since: float | None = None
        busy_retries = 0
        loop = asyncio.get_running_loop()
        while True:
            async with self._semaphore:
                self.stats["requests"] += 1
                status, headers, payload = await self._post(body)
            engine_url = headers.get(ENGINE_URL_HEADER)
            if status == 200:
                return await self._decode(payload), engine_url
            message = _error_text(payload)
            if status == 503 and _is_busy(payload):
                # backpressure (an engine at --max-queued-requests, a server at its connection cap), not a failure:
                # wait as told and send again, with or without fault tolerance, for as long as a restart may take
                busy_since = loop.time() if busy_since is None else busy_since
                if loop.time() - busy_since <= self.no_engine_wait:
                    self.stats["busy_retries"] = self.stats.get("busy_retries", 0) + 1
                    await asyncio.sleep(_retry_after(headers, self.retry_backoff * 2 ** min(busy_retries, 4)))
                    busy_retries += 1
                    continue
                errors.append(f"[503] {message} (still busy after {loop.time() - busy_since:.0f}s)")
                break
            if status == 400:
                raise MilesUserError(f"the engine rejected request {request.request_id}: {message}")
            if status == 401:
                raise MilesUserError(_unauthorized(self.router_url))
            errors.append(f"[{status}] {message}")
            if not self.fault_tolerant or (status not in RETRYABLE_STATUS and status != 599):
                break
            if status in (503, 599):
                # no live engine (or no router) right now: wait for the supervisor to restart one
                waiting_since = loop.time() if waiting_since is None else waiting_since
                waited = loop.time() - waiting_since
                if waited > self.no_engine_wait:
                    errors.append(f"no live engine for {waited:.0f}s")
                    break
                await asyncio.sleep(min(2.0, self.retry_backoff * 2 ** min(len(errors), 4)))
            else:
                # this engine failed (died mid-request, timed out, internal error): the router picks another
                waiting_since = None
                if engine_url:
                    self.stats["failed_engines"].add(engine_url)
                engine_failures += 1
                if engine_failures >= self.max_attempts:
                    break
            self.stats["retries"] += 1
            logger.warning("request %s failed (%s); retrying", request.request_id, message)
        hint = "" if self.fault_tolerant else " (pass --use-fault-tolerance to retry on another engine)"
        raise EngineRequestError(
            f"generate request {request.request_id} failed after {len(errors)} attempt(s){hint}: " + "; ".join(errors)
        )


def _unauthorized(router_url: str) -> str:
    return (f"router {router_url} refused the API key (401): this process must have the run's key in "
            f"${API_KEY_ENV}")


MAX_RETRY_AFTER_S = 5.0


def _is_busy(payload: bytes) -> bool:
    import json

    try:
        return json.loads(payload).get("busy") is True
    except (ValueError, AttributeError):
        return False


def _retry_after(headers: dict[str, str], backoff: float) -> float:
    """The server's Retry-After (seconds, at most MAX_RETRY_AFTER_S), else `backoff`; jittered so that the
    clients told to wait do not all come back in the same instant."""
    import random

    try:
        wait = float(headers.get("Retry-After", backoff))
    except ValueError:
        wait = backoff
    return min(MAX_RETRY_AFTER_S, max(0.05, wait)) * random.uniform(0.5, 1.0)


def _error_text(payload: bytes) -> str:
    import json

    try:
        return str(json.loads(payload).get("error", payload[:200]))
    except (ValueError, AttributeError):
        return payload[:200].decode(errors="replace")
