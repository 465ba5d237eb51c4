"""The front door of every miles HTTP server: the per-run API key, one-line JSON errors, bind warnings.

See docs/security.md for the threat model.

The driver creates one random key per run (`ensure_run_api_key`), or takes the one exported in MILES_API_KEY,
and writes it to a file of mode 0600 in a run folder of mode 0700 (`run_folder`). Ray workers learn only that
file's path (MILES_API_KEY_FILE): Ray writes a job's runtime_env into its session logs, so the key itself must
never travel there. Engines and the router get the key in their process environment (readable only by the same
user). `api_key_from_env` reads MILES_API_KEY, else the file. The key never goes on a command line (`ps` shows
those to every user of the machine) nor into the run's `args` (printed by --dry-run, logged to wandb, saved
with checkpoints), and the servers' logs never show a request's raw header lines (miles.utils.http_guard).

Servers check `Authorization: Bearer <key>` in constant time (`bearer_auth_middleware`) and answer 401 to
anything else; clients send the header with `auth_headers()`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import shutil
import stat
import tempfile
from typing import Iterable

from aiohttp import web

from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

API_KEY_ENV = "MILES_API_KEY"
API_KEY_FILE_ENV = "MILES_API_KEY_FILE"  # the path of the 0600 file holding the key (what Ray workers get)
RUN_FOLDER_ENV = "MILES_RUN_FOLDER"  # the run's private (0700) folder: the key file, Ray's temp/log folder
API_KEY_FILE_NAME = "api_key"
MIN_API_KEY_CHARS = 16  # a guessable key is no key; secrets.token_hex(32) gives 64
MAX_API_KEY_BYTES = 4096


def new_api_key() -> str:
    return secrets.token_hex(32)


def api_key_from_env() -> str | None:
    """$MILES_API_KEY, else the key in the file $MILES_API_KEY_FILE names (None when neither is set)."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    path = os.environ.get(API_KEY_FILE_ENV)
    return read_api_key_file(path) if path else None


def read_api_key_file(path: str) -> str:
    """The key in a file of this user's, of mode 0600 or stricter (a key others could read is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise MilesUserError(f"${API_KEY_FILE_ENV} {path!r}: cannot open the API key file ({err.strerror}); on "
                             f"a cluster whose nodes do not share it, export {API_KEY_ENV} instead") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise MilesUserError(f"${API_KEY_FILE_ENV} {path!r}: the API key file must be a regular file of this "
                                 "user with mode 0600")
        key = handle.read(MAX_API_KEY_BYTES).decode("ascii", "replace").strip()
    return check_api_key(key, f"${API_KEY_FILE_ENV} {path!r}")


_made_run_folder: str | None = None  # the run folder this process created, which `remove_run_folder` removes


def run_folder() -> str:
    """The run's private folder (mode 0700, created once per driver, named in $MILES_RUN_FOLDER)."""
    global _made_run_folder
    folder = os.environ.get(RUN_FOLDER_ENV)
    if folder and os.path.isdir(folder):
        return folder
    folder = tempfile.mkdtemp(prefix="miles-")  # mode 0700, a fresh name: nobody else can have made it
    os.environ[RUN_FOLDER_ENV] = folder
    _made_run_folder = folder
    return folder


def remove_run_folder() -> None:
    """At the run's end: the run folder this process created goes, with the key file in it (before, every run
    left an empty folder in the temp folder: a hundred after one pass of the tests). A key file the user
    exported (MILES_API_KEY_FILE outside the folder) and a folder a parent process made stay."""
    global _made_run_folder
    folder, _made_run_folder = _made_run_folder, None
    if folder is None:
        return
    key_file = os.environ.get(API_KEY_FILE_ENV, "")
    if key_file.startswith(folder + os.sep):
        del os.environ[API_KEY_FILE_ENV]
    if os.environ.get(RUN_FOLDER_ENV) == folder:
        del os.environ[RUN_FOLDER_ENV]
    shutil.rmtree(folder, ignore_errors=True)


def write_api_key_file(key: str) -> str:
    """Write the key to `<run folder>/api_key` (mode 0600, created exclusively); returns the path."""
    path = os.path.join(run_folder(), API_KEY_FILE_NAME)
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return path


def check_api_key(key: str, what: str) -> str:
    """Reject keys that are too short or that cannot travel in an HTTP header unchanged."""
    if len(key) < MIN_API_KEY_CHARS:
        raise MilesUserError(f"{what}: the API key must have at least {MIN_API_KEY_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in key):
        raise MilesUserError(f"{what}: the API key must be printable ASCII without spaces")
    return key


def ensure_run_api_key() -> str:
    """Driver side: the run's key, in a 0600 file named by $MILES_API_KEY_FILE, which every child process and Ray
    worker started afterwards inherits. A key the user exported (to share it with a hand-started engine) is
    kept; otherwise a fresh random one is made for this run."""
    key = api_key_from_env()
    if key is None:
        key = new_api_key()
    check_api_key(key, f"${API_KEY_ENV}")
    path = os.environ.get(API_KEY_FILE_ENV)
    if not (path and os.path.isfile(path) and read_api_key_file(path) == key):
        os.environ[API_KEY_FILE_ENV] = write_api_key_file(key)
    return key


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
