"""Nobody gets in (docs/security.md): over real HTTP, against the shared engine process and in-process routers.

- a pickle that would create a file, sent as a weight update (directly, in every field that carries bytes,
  and through the router) creates nothing;
- no key, a wrong key or a wrong scheme get 401 from every endpoint of engine and router; the key is never on
  an engine's command line; an engine without a key refuses to start;
- a module path in a generate body is refused and nothing is imported, while the engine's own
  --sde-step-backend-path is honoured;
- limits, wrong types and oversized bodies get 4xx with one-line JSON;
- a weight-update bucket with one bad entry changes no weight, and shm names outside the pattern, symlinks
  and undersized files are refused.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import pickle
import secrets
import sys
import textwrap
import urllib.error
import urllib.request

import aiohttp
import msgpack
import pytest
import torch

from miles.engine.launcher import BackgroundLoop, launch_engine
from miles.engine.protocol import GenerateRequest, decode_response, encode_request
from miles.engine.server import EngineServer
from miles.engine.server_args import ServerArgs
from miles.engine.weight_sync import (
    WeightSyncError,
    push_weights,
)
from miles.engine.weight_sync_wire import (
    SHM_DIR,
    SharedMemoryRef,
    TensorEntry,
    UpdateMessage,
    encode_update_message,
)
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.router.router import Router, RouterConfig
from miles.types import GuidanceConfig
from miles.utils.auth import API_KEY_ENV, auth_headers

pytestmark = pytest.mark.timeout(120)


class _CreatesFile:
    """Unpickling this opens (creates) `path`: the classic pickle RCE, harmless form."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


@pytest.fixture(scope="module")
def engine(sd3_engine):
    return sd3_engine


def _request(**overrides) -> GenerateRequest:
    fields = dict(prompt="a lock", num_samples=1, seed=1, num_steps=2, height=32, width=32,
                  guidance=GuidanceConfig(1.0), request_id="sec")
    fields.update(overrides)
    return GenerateRequest(**fields)


def _call(url: str, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
    """(status, JSON or raw body) of one request; `headers=None` sends the run's key."""
    method = method or ("POST" if body is not None else "GET")
    request = urllib.request.Request(f"{url}{path}", data=body, method=method,
                                     headers=auth_headers() if headers is None else headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, payload, content_type = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, payload, content_type = err.code, err.read(), err.headers.get("Content-Type", "")
    if "json" in content_type:
        return status, json.loads(payload)
    return status, payload


def _engine_state(url: str) -> tuple[dict, int]:
    status, body = _call(url, "/weights_checksum")
    assert status == 200
    return body["checksums"], body["weight_version"]


@pytest.fixture
def router_url(engine):
    loop = BackgroundLoop()
    router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), [engine.url])
    url = loop.run(router.start())
    yield url
    loop.run(router.stop())
    loop.close()


# ---- no pickle ---------------------------------------------------------------------------------------------


def test_a_crafted_pickle_creates_nothing_directly_or_through_the_router(engine, router_url, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(str(marker)))
    pickle.loads(payload).close()  # the payload is live: unpickled, it creates the file
    assert marker.exists()
    marker.unlink()
    checksums, version = _engine_state(engine.url)

    v1_message = msgpack.packb({"weight_version": 1, "flush": False, "handle": payload, "entries": []})
    v2_fields = dict(protocol_version=2, weight_version=1, flush=False, lora=False, lora_scaling=1.0,
                     target_modules=None, entries=[])
    bodies = [
        payload,  # a bare pickle
        v1_message,  # the old wire format: a pickled handle
        msgpack.packb({**v2_fields, "buffer": {"kind": "shm", "name": payload, "size": 64}}),
        msgpack.packb({**v2_fields, "buffer": {"kind": "shm", "name": "miles_" + "0" * 32, "size": payload}}),
        msgpack.packb({**v2_fields, "buffer": None, "entries": [[payload, "float32", [1], 0]]}),
        msgpack.packb({**v2_fields, "buffer": {"kind": "pickle", "data": payload}}),
        msgpack.packb({**v2_fields, "buffer": msgpack.ExtType(1, payload)}),
    ]
    for body in bodies:
        status, answer = _call(engine.url, "/update_weights_from_tensor", body)
        assert status == 400 and isinstance(answer, dict) and "\n" not in answer["error"], answer
    # the router forwards generate requests only; a pickle as a generate body reaches the engine and is refused
    status, _ = _call(router_url, "/update_weights_from_tensor", v1_message)
    assert status == 404
    for body in (payload, v1_message):
        status, answer = _call(router_url, "/rollout/generate", body)
        assert status == 400 and "error" in answer
    assert not marker.exists()
    assert _engine_state(engine.url) == (checksums, version)


# ---- the key -----------------------------------------------------------------------------------------------

ENGINE_ENDPOINTS = [("GET", "/health"), ("GET", "/server_info"), ("GET", "/weights_checksum"),
                    ("POST", "/rollout/generate"), ("POST", "/update_weights_from_tensor"),
                    ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
                    ("POST", "/init_weights_update_group"), ("POST", "/destroy_weights_update_group"),
                    ("POST", "/update_weights_from_distributed"), ("POST", "/receive_weights_broadcast"),
                    ("POST", "/policy_gradient"), ("POST", "/optimizer_state"), ("GET", "/no_such_endpoint")]
ROUTER_ENDPOINTS = [("GET", "/health"), ("GET", "/workers"), ("POST", "/rollout/generate"),
                    ("POST", "/add_worker"), ("POST", "/remove_worker")]
BAD_HEADERS = [
    {},
    {"Authorization": "Bearer " + secrets.token_hex(32)},
    {"Authorization": "Basic " + os.environ[API_KEY_ENV]},
    {"Authorization": os.environ[API_KEY_ENV]},
    {"Authorization": "Bearer " + os.environ[API_KEY_ENV][:-1]},
    {"Authorization": "Bearer " + os.environ[API_KEY_ENV] + "0"},
    {"Authorization": "Bearer  " + os.environ[API_KEY_ENV]},
]


def test_every_endpoint_wants_the_key(engine, router_url):
    add_body = json.dumps({"url": "http://127.0.0.1:9"}).encode()
    for url, endpoints in ((engine.url, ENGINE_ENDPOINTS), (router_url, ROUTER_ENDPOINTS)):
        for method, path in endpoints:
            body = add_body if method == "POST" else None
            for headers in BAD_HEADERS:
                status, answer = _call(url, path, body, headers=headers, method=method)
                assert status == 401, (url, path, headers)
                assert answer["error"].startswith("missing or wrong API key")
    # nothing changed behind the 401s: memory not released, no weight group joined, no worker added
    assert _call(engine.url, "/server_info")[1]["memory_released"] is False
    assert _call(engine.url, "/server_info")[1]["weights_update_group"] is None
    assert [w["url"] for w in _call(router_url, "/workers")[1]["workers"]] == [engine.url]


def test_the_key_is_not_on_the_engine_command_line(engine):
    with open(f"/proc/{engine.pid}/cmdline", "rb") as f:
        assert os.environ[API_KEY_ENV].encode() not in f.read()


def test_an_engine_without_a_key_refuses_to_start(tmp_path):
    # the key is checked before the model loads: the missing model would fail later, with another message
    server_args = ServerArgs(model_path=str(tmp_path / "missing"), device="cpu")
    with pytest.raises(RuntimeError, match="needs an API key"):
        launch_engine(server_args, env={API_KEY_ENV: ""}, log_path=str(tmp_path / "engine.log"), startup_timeout=60)


# ---- no module paths in requests --------------------------------------------------------------------------

_BACKEND_MODULE = """
import pathlib
from miles.diffusion.sde import DiffusersSdeStepBackend

pathlib.Path({marker!r}).write_text("imported")


class RecordingBackend(DiffusersSdeStepBackend):
    pass
"""


def test_a_module_path_in_a_generate_body_is_refused_and_never_imported(tiny_checkpoint, make_server_args, tmp_path,
                                                                        monkeypatch):
    module_name = f"miles_test_backend_{secrets.token_hex(4)}"
    marker = tmp_path / "imported"
    (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(_BACKEND_MODULE.format(marker=str(marker))))
    monkeypatch.syspath_prepend(str(tmp_path))
    loop = BackgroundLoop()
    server = EngineServer(make_server_args(tiny_checkpoint("sd3")))
    url = loop.run(server.start())
    try:
        body = msgpack.unpackb(encode_request(_request(sde_step_indices=[0], return_latent_indices=[0, 1])))
        for field_name in ("sde_backend_path", "sde_step_backend_path", "model_backend_path",
                           "pipeline_builder_path", "train_pipeline_config_path"):
            status, answer = _call(url, "/rollout/generate",
                                   msgpack.packb({**body, field_name: f"{module_name}.RecordingBackend"}))
            assert status == 400 and "unknown fields" in answer["error"]
        assert module_name not in sys.modules and not marker.exists()
    finally:
        loop.run(server.stop())

    # the engine's own flag is where the backend comes from
    server_args = make_server_args(tiny_checkpoint("sd3"), sde_step_backend_path=f"{module_name}.RecordingBackend")
    server = EngineServer(server_args)
    url = loop.run(server.start())
    try:
        status, payload = _call(url, "/rollout/generate",
                                encode_request(_request(sde_step_indices=[0], return_latent_indices=[0, 1])))
        assert status == 200 and len(decode_response(payload).samples) == 1
        assert marker.exists()
    finally:
        loop.run(server.stop())
        loop.close()
        sys.modules.pop(module_name, None)


# ---- limits and types --------------------------------------------------------------------------------------


def test_limits_wrong_types_and_oversized_bodies_get_4xx_with_one_line_json(engine):
    body = msgpack.unpackb(encode_request(_request()))
    cases = [
        (encode_request(_request(num_samples=65)), 400, "num_samples 65 exceeds"),
        (encode_request(_request(num_steps=1001)), 400, "num_steps 1001 exceeds"),
        (encode_request(_request(height=4104)), 400, "height 4104 exceeds"),
        (encode_request(_request(num_frames=1025)), 400, "num_frames 1025 exceeds"),
        # every field within its limit, the whole over the request's cost caps
        (encode_request(_request(num_samples=64, num_steps=1000, height=1024, width=1024, num_frames=128)), 400,
         "pixel-steps (samples x steps x height x width x frames), over this engine's limit"),
        (encode_request(_request(num_samples=64, num_steps=2, height=4096, width=4096, sde_step_indices=[0],
                                 return_latent_indices=[0, 1])), 400, "the answer would carry up to"),
        (msgpack.packb({**body, "num_samples": "4"}), 400, "num_samples must be an integer"),
        (msgpack.packb({**body, "guidance": "strong"}), 400, "guidance must be a map"),
        (msgpack.packb({**body, "height": None}), 400, "height must be an integer"),
        (msgpack.packb([1, 2, 3]), 400, "map"),
        (b"\x00" * (17 << 20), 413, "exceeded"),  # over --max-request-bytes (16 MiB)
    ]
    for payload, expected_status, message in cases:
        status, answer = _call(engine.url, "/rollout/generate", payload)
        assert status == expected_status and message in answer["error"], (message, status, answer)
        assert "\n" not in answer["error"]
    status, _ = _call(engine.url, "/rollout/generate", payload, method="PUT")
    assert status == 405
    status, answer = _call(engine.url, "/weights_checksum?modules=transformer,../../etc")
    assert status == 400 and "unknown modules" in answer["error"]
    assert _call(engine.url, "/health") == (200, {"ok": True, "weight_version": _engine_state(engine.url)[1]})


# ---- weight updates: validated before anything is copied ---------------------------------------------------


@pytest.fixture(scope="module")
def transformer_params(sd3_path):
    module = SD3TrainPipelineConfig().load_modules(sd3_path, ["transformer"], torch.float32)["transformer"]
    return [(f"transformer.{name}", p.detach().clone()) for name, p in module.named_parameters()]


def test_a_bucket_with_one_bad_entry_changes_no_weight(engine, transformer_params):
    checksums, version = _engine_state(engine.url)
    (name_a, a), (name_b, b) = transformer_params[:2]
    for bad in [(name_b, b.reshape(-1)[:-1]),  # wrong shape
                ("transformer.not_a_param", torch.zeros(2)),  # unknown parameter
                (name_b, b.to(torch.complex64))]:  # dtype outside the allow-list
        with pytest.raises((WeightSyncError, TypeError)):
            push_weights([engine.url], [(name_a, a + 1.0), bad], bucket_bytes=1 << 30, weight_version=version + 7)
        assert _engine_state(engine.url) == (checksums, version)


def _post_update(url: str, message: UpdateMessage) -> tuple[int, dict]:
    return _call(url, "/update_weights_from_tensor", encode_update_message(message))


def test_shm_names_outside_the_pattern_symlinks_and_short_files_are_refused(engine, transformer_params, tmp_path):
    checksums, version = _engine_state(engine.url)
    name, tensor = transformer_params[0]
    entry = TensorEntry(name, torch.float32, tuple(tensor.shape), 0)
    raw = msgpack.unpackb(encode_update_message(UpdateMessage(weight_version=1, buffer=SharedMemoryRef(
        "miles_" + "0" * 32, entry.nbytes), entries=(entry,))))
    for bad_name in ("../../etc/passwd", "/etc/passwd", "miles_" + "0" * 31 + "g", "torch_1_2", "miles_" + "a" * 33):
        raw["buffer"]["name"] = bad_name
        status, answer = _call(engine.url, "/update_weights_from_tensor", msgpack.packb(raw))
        assert status == 400 and "shm buffer name must match" in answer["error"]

    target = tmp_path / "target"
    target.write_bytes(b"\x00" * entry.nbytes)
    link_name = f"miles_{secrets.token_hex(16)}"
    short_name = f"miles_{secrets.token_hex(16)}"
    os.symlink(target, os.path.join(SHM_DIR, link_name))
    with open(os.path.join(SHM_DIR, short_name), "wb") as f:
        f.write(b"\x00" * (entry.nbytes // 2))
    try:
        for shm_name, message in [(link_name, "cannot be opened"), (short_name, "has"),
                                  (f"miles_{secrets.token_hex(16)}", "cannot be opened")]:
            status, answer = _post_update(engine.url, UpdateMessage(
                weight_version=1, buffer=SharedMemoryRef(shm_name, entry.nbytes), entries=(entry,)))
            assert status == 400 and message in answer["error"], answer
        # bytes outside the buffer are refused before any file is opened
        status, answer = _post_update(engine.url, UpdateMessage(
            weight_version=1, buffer=SharedMemoryRef(short_name, entry.nbytes - 4), entries=(entry,)))
        assert status == 400 and "outside" in answer["error"]
    finally:
        os.unlink(os.path.join(SHM_DIR, link_name))
        os.unlink(os.path.join(SHM_DIR, short_name))
    assert _engine_state(engine.url) == (checksums, version)


def test_the_router_refuses_a_path_laden_worker_url_over_http(router_url, engine):
    async def run():
        async with aiohttp.ClientSession(headers=auth_headers()) as session:
            for url in (f"{engine.url}/update_weights_from_tensor", f"{engine.url}?next=/x", "http://a@b:1"):
                async with session.post(f"{router_url}/add_worker", json={"url": url}) as response:
                    assert response.status == 400
                    assert "error" in await response.json()

    asyncio.run(run())
    assert [w["url"] for w in _call(router_url, "/workers")[1]["workers"]] == [engine.url]


# ---- admission and connections -----------------------------------------------------------------------------


def test_an_engine_admits_a_bounded_number_of_requests_and_the_client_retries_politely(tiny_checkpoint,
                                                                                    make_server_args):
    """--max-queued-requests 2 and 8 concurrent requests: the overflow is a 503 with Retry-After, never a queue
    without end; miles' rollout client waits as told and every request is served."""
    from miles.rollout.engine_client import EngineClient
    from miles.testing.config import trainer_config

    loop = BackgroundLoop()
    server = EngineServer(make_server_args(tiny_checkpoint("sd3"), max_queued_requests=2))
    url = loop.run(server.start())
    try:
        async def burst():
            async with aiohttp.ClientSession(headers=auth_headers()) as session:
                async def one(seed):
                    body = encode_request(_request(seed=seed, num_steps=6))
                    async with session.post(f"{url}/rollout/generate", data=body) as response:
                        return response.status, response.headers.get("Retry-After"), await response.read()
                return await asyncio.gather(*(one(seed) for seed in range(8)))

        answers = asyncio.run(burst())
        busy = [a for a in answers if a[0] == 503]
        assert busy and all(a[0] in (200, 503) for a in answers)
        assert all(retry == "1" and json.loads(body)["busy"] is True for _, retry, body in busy)

        router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), [url])
        router_url = loop.run(router.start())
        config = trainer_config(use_fault_tolerance=False, miles_router_timeout=60.0, sglang_server_concurrency=8,
                                rollout_parser_num_workers=1, use_distributed_post=False).with_router_url(router_url)

        async def through_the_client():
            async with EngineClient(config) as client:
                results = await asyncio.gather(*(client.generate(_request(seed=s, num_steps=6)) for s in range(8)))
                return results, client.stats

        results, stats = asyncio.run(through_the_client())
        loop.run(router.stop())
        assert len(results) == 8 and stats.get("busy_retries", 0) > 0
    finally:
        loop.run(server.stop())
        loop.close()


def test_the_engine_closes_half_open_connections_and_logs_no_header_line(tiny_checkpoint, make_server_args, caplog):
    import logging
    import socket
    import time

    caplog.set_level(logging.DEBUG)
    loop = BackgroundLoop()
    server = EngineServer(make_server_args(tiny_checkpoint("sd3"), connection_read_timeout=1.0, max_connections=20))
    url = loop.run(server.start())
    port = int(url.rsplit(":", 1)[1])
    sockets = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /rollout/generate HTTP/1.1\r\nHost: x\r\n")
            sockets.append(sock)
        bad = socket.create_connection(("127.0.0.1", port), timeout=10)
        bad.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {os.environ[API_KEY_ENV]}\x01"
                    "\r\n\r\n".encode())
        bad.recv(4096)
        bad.close()
        time.sleep(3.0)
        for sock in sockets:  # the first 20 closed after the read timeout, the other 20 answered 503 at once
            sock.settimeout(5)
            try:
                answer = sock.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503"), answer[:60]
        assert _call(url, "/health")[0] == 200
    finally:
        for sock in sockets:
            sock.close()
        loop.run(server.stop())
        loop.close()
    assert os.environ[API_KEY_ENV] not in caplog.text

