"""What keeps a miles HTTP server (engine, router) standing when clients misbehave (docs/security.md).

Anyone who can reach a port can open connections without the key: the key check only runs once a request's
head has arrived. Left alone, half-open connections (a few header bytes, then silence) are never closed, a few
thousand exhaust the process's file limit, and every refused accept logs a traceback. `ServerGuard` closes
that door below the key check:
- a connection must deliver a complete request head within `read_timeout_s` of connecting (within
  `idle_timeout_s` of its previous answer, on a kept-alive connection), and the body within `read_timeout_s` of
  the key check; otherwise it is closed (a 408 where an answer can still be sent);
- at most `max_connections` are open at once (never more than the file limit allows, with room for the
  process's own files); a connection beyond that gets a 503 at once and is closed;
- a flood is logged once when it starts and once, with counts, when it ends or every minute while it lasts,
  not once per connection; malformed requests likewise, and their raw header lines (which may carry the key)
  never reach a log (`quiet_bad_requests`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)

FD_RESERVE = 256  # files the process keeps for itself (models, logs, shared memory, outgoing connections)
FLOOD_LOG_INTERVAL_S = 60.0
_BUSY_BODY = b'{"error": "too many open connections; retry in a moment", "busy": true}'
_BUSY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Retry-After: 1\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0  # a kept-alive connection with no request in flight
    max_connections: int = 1024


def connection_cap(requested: int) -> int:
    """`requested`, lowered to what the soft file limit leaves after `FD_RESERVE` (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(16, min(requested, soft - FD_RESERVE))


class _EventLog:
    """Logs the first event of a burst at once, then at most one line per interval with the count since."""

    def __init__(self, what: str):
        self.what = what
        self.total = 0
        self.unlogged = 0
        self.last_logged = 0.0

    def note(self, detail: str) -> None:
        self.total += 1
        now = time.monotonic()
        if self.last_logged and now - self.last_logged < FLOOD_LOG_INTERVAL_S:
            self.unlogged += 1
            return
        more = f" (+{self.unlogged} more since the last report, {self.total} in all)" if self.unlogged else ""
        logger.warning("%s: %s%s", self.what, detail, more)
        self.unlogged, self.last_logged = 0, now


class _Connection:
    __slots__ = ("transport", "timer", "busy")

    def __init__(self, transport):
        self.transport = transport
        self.timer: asyncio.TimerHandle | None = None
        self.busy = 0


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted and timed by the guard."""

    def __init__(self, guard: "ServerGuard", inner):
        self.guard, self.inner = guard, inner
        self.connection: _Connection | None = None

    def connection_made(self, transport) -> None:
        if not self.guard.admit(transport):
            transport.write(_BUSY_ANSWER)
            transport.close()
            return
        self.connection = self.guard.track(transport)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.connection is not None:
            self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.connection is not None else None

    def connection_lost(self, exc) -> None:
        if self.connection is not None:
            self.guard.untrack(self.connection)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class ServerGuard:
    """Counts, times and caps one server's connections; the app takes its `middlewares(...)`."""

    def __init__(self, limits: ConnectionLimits, what: str):
        self.limits = limits
        self.what = what
        self.max_connections = connection_cap(limits.max_connections)
        self.connections: dict[object, _Connection] = {}
        self._refused = _EventLog(f"{what}: connection limit")
        self._timed_out = _EventLog(f"{what}: slow connections")
        self._at_limit = False

    # ---- connections ------------------------------------------------------------------------------------------
    def admit(self, transport) -> bool:
        if len(self.connections) < self.max_connections:
            if self._at_limit:
                self._at_limit = False
                logger.warning("%s: below the connection limit again (%d refused with 503 so far)", self.what,
                               self._refused.total)
            return True
        self._at_limit = True
        self._refused.note(f"{self.max_connections} connections open, new ones get 503 until some close")
        return False

    def track(self, transport) -> _Connection:
        connection = _Connection(transport)
        self.connections[transport] = connection
        self._arm(connection, self.limits.read_timeout_s, "sent no complete request head")
        return connection

    def untrack(self, connection: _Connection) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
        self.connections.pop(connection.transport, None)

    def _arm(self, connection: _Connection, seconds: float, reason: str) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
        connection.timer = asyncio.get_running_loop().call_later(seconds, self._expire, connection, seconds, reason)

    def _expire(self, connection: _Connection, seconds: float, reason: str) -> None:
        connection.timer = None
        if connection.busy:
            return
        if connection.transport.get_write_buffer_size():  # an answer still on its way out: not idle
            self._arm(connection, seconds, reason)
            return
        self._timed_out.note(f"closing connections that {reason} within {seconds:g} s")
        connection.transport.abort()

    def protocol_factory(self, inner_factory):
        return lambda: _GuardedProtocol(self, inner_factory())

    # ---- requests -------------------------------------------------------------------------------------------------
    @web.middleware
    async def track_requests(self, request: web.Request, handler):
        """While a request is handled its connection is not timed; after the answer the clock starts again."""
        connection = self.connections.get(request.transport)
        if connection is None:  # a test client without the guarded site
            return await handler(request)
        connection.busy += 1
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None
        try:
            return await handler(request)
        finally:
            connection.busy -= 1
            if not connection.busy and not connection.transport.is_closing():
                # aiohttp's own keep-alive time: what clients that pool connections already expect
                self._arm(connection, self.limits.idle_timeout_s, "sent no next request head")

    @web.middleware
    async def read_body(self, request: web.Request, handler):
        """The body within `read_timeout_s` (after the key check: no unauthenticated client makes it read)."""
        if request.body_exists and request.match_info.http_exception is None:  # a 404/405 reads no body
            try:
                await asyncio.wait_for(request.read(), self.limits.read_timeout_s)  # aiohttp keeps the bytes
            except asyncio.TimeoutError:
                self._timed_out.note(f"closing connections that sent no complete body within "
                                     f"{self.limits.read_timeout_s:g} s")
                return web.json_response({"error": "request body not received in time"}, status=408,
                                         headers={"Connection": "close"})
        return await handler(request)

    def middlewares(self, json_errors, bearer_auth) -> list:
        """The app's middlewares in order: errors as JSON, connection timing, the key, the body read."""
        return [json_errors, self.track_requests, bearer_auth, self.read_body]


class GuardedSite(web.SockSite):
    """aiohttp's socket site with every connection going through a `ServerGuard`."""

    def __init__(self, runner: web.BaseRunner, sock, guard: ServerGuard):
        super().__init__(runner, sock)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner, which stops it on cleanup
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.protocol_factory(self._runner.server), sock=self._sock,
                                                backlog=self._backlog)


class _QuietBadRequests(logging.Filter):
    """One line per malformed request (rate-limited) instead of aiohttp's traceback, which quotes the offending
    raw header line (an `Authorization` line, key and all)."""

    def __init__(self, api_key: str | None):
        super().__init__()
        self.api_key = api_key
        self.events = _EventLog("malformed HTTP requests")

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            self.events.note(f"answered 400 ({type(error).__name__}; the request's raw lines are not logged)")
            return False
        if self.api_key:
            text = record.getMessage()
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
            if self.api_key in text:
                record.msg, record.args = text.splitlines()[0].replace(self.api_key, "<key>")[:200], None
                record.exc_info = record.exc_text = record.stack_info = None
        return True


def quiet_bad_requests(api_key: str | None) -> None:
    """Install `_QuietBadRequests` on aiohttp's server loggers (once per process and key)."""
    for name in ("aiohttp.server", "aiohttp.web", "aiohttp.access"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _QuietBadRequests) and f.api_key == api_key for f in target.filters):
            target.addFilter(_QuietBadRequests(api_key))
