"""The front door shared by engine and router: the bearer-key middleware (constant-time compare, 401), one-line
JSON errors, the run's key in the environment, and the bind warning."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import tempfile

import aiohttp
import pytest
from aiohttp import web

from miles.utils import auth
from miles.utils.errors import MilesUserError

KEY = "k" * 32


async def _serve_and_call(calls):
    async def ok(request):
        await request.read()  # aiohttp enforces client_max_size while reading
        return web.json_response({"ok": True})

    async def boom(request):
        raise RuntimeError("secret internals")

    app = web.Application(client_max_size=64,
                          middlewares=[auth.json_errors_middleware, auth.bearer_auth_middleware(KEY)])
    app.add_routes([web.get("/x", ok), web.post("/x", ok), web.get("/boom", boom)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            results = []
            for method, path, headers, data in calls:
                async with session.request(method, f"http://127.0.0.1:{port}{path}", headers=headers,
                                           data=data) as response:
                    results.append((response.status, await response.json()))
            return results
    finally:
        await runner.cleanup()


def test_only_the_right_bearer_key_gets_in_and_errors_are_one_line_json():
    good = {"Authorization": f"Bearer {KEY}"}
    results = asyncio.run(_serve_and_call([
        ("GET", "/x", {}, None),
        ("GET", "/x", {"Authorization": "Bearer " + "x" * 32}, None),
        ("GET", "/x", {"Authorization": KEY}, None),  # no scheme
        ("GET", "/x", {"Authorization": f"Bearer {KEY}extra"}, None),
        ("GET", "/nowhere", {}, None),  # unknown paths are not enumerable without the key
        ("GET", "/x", good, None),
        ("GET", "/nowhere", good, None),
        ("POST", "/x", good, b"x" * 1000),  # over client_max_size
        ("GET", "/boom", good, None),
    ]))
    statuses = [status for status, _ in results]
    assert statuses == [401, 401, 401, 401, 401, 200, 404, 413, 500]
    assert "Authorization: Bearer" in results[0][1]["error"]
    for status, body in results:
        assert status == 200 or ("\n" not in body["error"] and body["error"])
    assert "secret internals" not in results[-1][1]["error"]  # a 500 names the type, not the details


@pytest.fixture
def no_run_key(monkeypatch, tmp_path):
    """A driver before its run: no key, no key file, no run folder, the temp folder `tmp_path`."""
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    for name in (auth.API_KEY_FILE_ENV, auth.RUN_FOLDER_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that what ensure_run_api_key sets is undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(auth, "_made_run_folder", None)  # what remove_run_folder would remove, restored after


def test_the_run_key_is_created_once_and_kept_in_a_private_file(monkeypatch, no_run_key):
    key = auth.ensure_run_api_key()
    assert len(key) == 64 and auth.api_key_from_env() == key
    assert auth.API_KEY_ENV not in os.environ  # what the driver's children inherit is the file's path only
    path = os.environ[auth.API_KEY_FILE_ENV]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert auth.ensure_run_api_key() == key  # the same key for every component of the run
    assert auth.auth_headers() == {"Authorization": f"Bearer {key}"}
    os.chmod(path, 0o644)  # a key file others can read is refused
    with pytest.raises(MilesUserError, match="mode 0600"):
        auth.api_key_from_env()
    os.chmod(path, 0o600)
    monkeypatch.setenv(auth.API_KEY_ENV, "mine-" + "9" * 20)
    assert auth.ensure_run_api_key() == "mine-" + "9" * 20  # a key the user exported is kept
    assert auth.read_api_key_file(os.environ[auth.API_KEY_FILE_ENV]) == "mine-" + "9" * 20


def test_the_run_folder_goes_with_the_run_and_a_users_key_file_stays(monkeypatch, tmp_path, no_run_key):
    auth.ensure_run_api_key()
    folder = os.environ[auth.RUN_FOLDER_ENV]
    assert os.listdir(folder) == [auth.API_KEY_FILE_NAME]
    auth.remove_run_folder()
    assert not os.path.exists(folder) and auth.API_KEY_FILE_ENV not in os.environ
    assert auth.RUN_FOLDER_ENV not in os.environ and list(tmp_path.iterdir()) == []
    auth.remove_run_folder()  # twice: nothing left to do

    mine = tmp_path / "my_key"  # a key file the user exported: the run uses it and leaves it
    mine.touch(mode=0o600)
    mine.write_text("k" * 32)
    monkeypatch.setenv(auth.API_KEY_FILE_ENV, str(mine))
    assert auth.ensure_run_api_key() == "k" * 32
    auth.remove_run_folder()
    assert mine.read_text() == "k" * 32 and os.environ[auth.API_KEY_FILE_ENV] == str(mine)

    parents = tmp_path / "miles-parent"  # a run folder a parent process made and named
    parents.mkdir(mode=0o700)
    monkeypatch.setenv(auth.RUN_FOLDER_ENV, str(parents))
    assert auth.run_folder() == str(parents)
    auth.remove_run_folder()
    assert parents.is_dir()


def test_servers_refuse_to_run_without_a_usable_key(monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    monkeypatch.delenv(auth.API_KEY_FILE_ENV, raising=False)
    with pytest.raises(MilesUserError, match="needs an API key"):
        auth.resolve_api_key(None, "the engine")
    with pytest.raises(MilesUserError, match="at least 16"):
        auth.resolve_api_key("short", "the engine")
    with pytest.raises(MilesUserError, match="printable ASCII"):
        auth.resolve_api_key("a key with spaces in it", "the engine")
    assert auth.resolve_api_key(KEY, "the engine") == KEY


def test_binding_beyond_loopback_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="miles.utils.auth"):
        for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
            auth.warn_if_exposed(host, "the engine")
        assert not caplog.records
        auth.warn_if_exposed("0.0.0.0", "the engine")
    assert "reachable from other machines" in caplog.text
