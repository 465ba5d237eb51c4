"""The front door of every miles HTTP server: the per-run API key, one-line JSON errors, bind warnings.

See docs/security.md for the threat model.

The driver creates one random key per run (`ensure_run_api_key`) and hands it to every process of the run
through the environment variable MILES_API_KEY: engines, the router, trainer ranks and rollout clients read it
from there. It never goes on a command line (`ps` shows those to every user of the machine) nor into the run's
`args` (which are printed by --dry-run, logged to wandb and saved with checkpoints).

Servers check `Authorization: Bearer <key>` in constant time (`bearer_auth_middleware`) and answer 401 to
anything else; clients send the header with `auth_headers()`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
from typing import Iterable

from aiohttp import web

from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

API_KEY_ENV = "MILES_API_KEY"
MIN_API_KEY_CHARS = 16  # a guessable key is no key; secrets.token_hex(32) gives 64


def new_api_key() -> str:
    return secrets.token_hex(32)


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def check_api_key(key: str, what: str) -> str:
    """Reject keys that are too short or that cannot travel in an HTTP header unchanged."""
    if len(key) < MIN_API_KEY_CHARS:
        raise MilesUserError(f"{what}: the API key must have at least {MIN_API_KEY_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in key):
        raise MilesUserError(f"{what}: the API key must be printable ASCII without spaces")
    return key


def ensure_run_api_key() -> str:
    """Driver side: the run's key, exported to this process's environment so that every child process and Ray
    worker started afterwards inherits it. A key the user exported (to share it with a hand-started engine)
    is kept; otherwise a fresh random one is made for this run."""
    key = api_key_from_env()
    if key is None:
        key = new_api_key()
        os.environ[API_KEY_ENV] = key
    return check_api_key(key, f"${API_KEY_ENV}")


def resolve_api_key(explicit: str | None, what: str) -> str:
    """Server side: the key given to the constructor or flag, else $MILES_API_KEY; a server never runs open."""
    key = explicit or api_key_from_env()
    if not key:
        raise MilesUserError(
            f"{what} needs an API key: export {API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
            "(or pass --api-key); clients send it as 'Authorization: Bearer <key>'"
        )
    return check_api_key(key, what)


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The header a client sends: the given key, else $MILES_API_KEY (none: the server answers 401)."""
    key = api_key or api_key_from_env()
    return {"Authorization": f"Bearer {key}"} if key else {}


def bearer_auth_middleware(api_key: str, open_paths: Iterable[str] = ()):
    """aiohttp middleware: 401 unless `Authorization: Bearer <api_key>` (constant-time comparison)."""
    expected = f"Bearer {api_key}".encode()
    unauthenticated = frozenset(open_paths)

    @web.middleware
    async def require_bearer(request: web.Request, handler):
        if request.path not in unauthenticated:
            # surrogateescape: a header with odd bytes compares unequal instead of raising
            supplied = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(supplied, expected):
                return web.json_response(
                    {"error": f"missing or wrong API key: send 'Authorization: Bearer <${API_KEY_ENV}>'"},
                    status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return require_bearer


@web.middleware
async def json_errors_middleware(request: web.Request, handler):
    """Every error answer is one line of JSON `{"error": ...}`: aiohttp's own (404, 405, 413 for a body over the
    size limit) too, and an unexpected exception is a 500 naming its type, never a traceback page."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        headers = {k: v for k, v in err.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = (err.text or err.reason or "").strip().splitlines()
        return web.json_response({"error": message[0] if message else err.reason}, status=err.status,
                                 headers=headers)
    except Exception as err:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"internal error: {type(err).__name__}"}, status=500)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to any interface
        return False


def warn_if_exposed(host: str, what: str) -> None:
    """Binding beyond loopback is an explicit opt-in (--host); say what it exposes."""
    if not is_loopback_host(host):
        logger.warning(
            "%s binds %s: reachable from other machines. Every request still needs the API key, but traffic is "
            "plain HTTP (key and payloads readable on the network): use a trusted network or a TLS tunnel",
            what,
            host,
        )
