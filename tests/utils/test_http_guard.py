"""Nothing falls over (miles.utils.http_guard), over real sockets on 127.0.0.1 against an in-process router (the
engine runs the same guard: tests/engine/test_security.py): half-open connections are closed within the read
timeout, connections beyond the cap get 503 while legitimate requests are served again once the flood is gone,
a flood is logged in a few lines, and a malformed request's header lines (the key among them) reach no log."""

from __future__ import annotations

import logging
import socket
import time
import urllib.request

import pytest

from miles.engine.launcher import BackgroundLoop
from miles.router.router import Router, RouterConfig
from miles.utils.auth import api_key_from_env, auth_headers

pytestmark = pytest.mark.timeout(60)

READ_TIMEOUT_S = 3.0  # long enough that opening the flood on a loaded 2-core machine stays inside it
CAP = 100
HALF_OPEN = 200


@pytest.fixture
def router_url():
    loop = BackgroundLoop()
    router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600,
                                 connection_read_timeout=READ_TIMEOUT_S, max_client_connections=CAP))
    url = loop.run(router.start())
    yield url
    loop.run(router.stop())
    loop.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _health(url: str) -> int:
    request = urllib.request.Request(f"{url}/health", headers=auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)
    return data == b"" or data.startswith(b"HTTP/1.1 503")


def test_half_open_connections_are_closed_and_a_flood_gets_503_logged_once(router_url, caplog):
    caplog.set_level(logging.WARNING, logger="miles.utils.http_guard")
    sockets = []
    try:
        start = time.monotonic()
        for _ in range(HALF_OPEN):
            sock = socket.create_connection(("127.0.0.1", _port(router_url)), timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
            sockets.append(sock)
        time.sleep(0.5)
        refused = [sock for sock in sockets if _closed_by_server(sock)]
        assert len(refused) == HALF_OPEN - CAP  # beyond the cap: answered 503 and closed at once
        assert _health(router_url) == 503  # still at the cap: a polite refusal, not a hang
        deadline = start + READ_TIMEOUT_S + 5
        while time.monotonic() < deadline and not all(_closed_by_server(sock) for sock in sockets):
            time.sleep(0.2)
        closed_after = time.monotonic() - start
        assert all(_closed_by_server(sock) for sock in sockets), "half-open connections outlived the read timeout"
        assert _health(router_url) == 200
    finally:
        for sock in sockets:
            sock.close()
    records = [r for r in caplog.records if r.name == "miles.utils.http_guard"]
    assert 1 <= len(records) <= 4, [r.getMessage() for r in records]  # the flood in a few lines, not per connection
    print(f"{HALF_OPEN} half-open connections closed within {closed_after:.1f} s (read timeout {READ_TIMEOUT_S} s)")


def test_a_body_that_never_comes_is_408_after_the_key_and_401_before(router_url):
    for headers, expected in (({}, b"401"), (auth_headers(), b"408")):
        sock = socket.create_connection(("127.0.0.1", _port(router_url)), timeout=READ_TIMEOUT_S + 10)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /add_worker HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n{lines}\r\n{{".encode())
        answer = sock.recv(4096)
        sock.close()
        assert answer.split(b" ")[1] == expected, answer[:80]


def test_a_malformed_request_never_logs_its_header_lines(router_url, caplog):
    caplog.set_level(logging.DEBUG)
    key = api_key_from_env()
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", _port(router_url)), timeout=10)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\x01\r\n\r\n".encode())
        assert sock.recv(4096).split(b" ")[1] == b"400"
        sock.close()
    time.sleep(0.2)
    assert key not in caplog.text and "Authorization" not in caplog.text
    bad = [r for r in caplog.records if "malformed HTTP requests" in r.getMessage()]
    assert len(bad) == 1 and "\n" not in bad[0].getMessage()
    assert _health(router_url) == 200
