"""Weight sync by broadcast (gloo on CPU): this process is the trainer's rank 0, the engines are the session's
engine process and an in-process engine server. Exact weights after full and LoRA updates (checksums), a refused
bucket writes nothing and leaves the group usable, shared memory and broadcast in one push, and every field of
the control messages checked."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import msgpack
import pytest
import torch

from miles.engine.launcher import BackgroundLoop
from miles.engine.server import EngineServer
from miles.engine.weight_broadcast import WeightBroadcastGroup, device_identity, split_by_transport
from miles.engine.weight_sync import (
    WeightSyncError,
    merge_lora_weight,
    named_tensor_checksums,
    push_weights,
)
from miles.engine.weight_sync_wire import (
    BroadcastRef,
    UpdateMessage,
    encode_update_message,
)
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.utils.auth import auth_headers

pytestmark = pytest.mark.timeout(180)

BUCKET_BYTES = 16 * 1024  # the tiny transformer travels in many buckets, some tensors alone
LORA_LAYERS = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj")


@pytest.fixture(scope="module")
def base_transformer(sd3_path):
    return SD3TrainPipelineConfig().load_modules(sd3_path, ["transformer"], torch.float32)["transformer"]


@pytest.fixture(scope="module")
def engines(sd3_engine, sd3_path, make_server_args, base_transformer):
    """[the session's engine process, an engine server in this process]; both hold the base weights after."""
    loop = BackgroundLoop()
    server = EngineServer(make_server_args(sd3_path))
    local_url = loop.run(server.start())
    yield [sd3_engine.url, local_url]
    push_weights([sd3_engine.url, local_url], _named(base_transformer), BUCKET_BYTES, weight_version=0)
    loop.run(server.stop())
    loop.close()


def _named(module, prefix="transformer"):
    return [(f"{prefix}.{name}", tensor.detach().clone()) for name, tensor in module.named_parameters()]


def _perturbed(base, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(name, t + 0.05 * torch.randn(t.shape, generator=generator)) for name, t in _named(base)]


def _call(url: str, path: str, body: bytes | dict | None = None, method: str = "POST"):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(f"{url}{path}", data=data, method=method, headers=auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _state(url: str) -> tuple[dict, int]:
    status, body = _call(url, "/weights_checksum", method="GET")
    assert status == 200
    return body["checksums"], body["weight_version"]


def _lora(base, seed: int):
    generator = torch.Generator().manual_seed(seed)
    state = base.state_dict()
    named, merged = [], {name: t.detach().clone() for name, t in base.named_parameters()}
    for layer in LORA_LAYERS:
        out_features, in_features = state[f"{layer}.weight"].shape
        lora_a = 0.3 * torch.randn(2, in_features, generator=generator)
        lora_b = 0.3 * torch.randn(out_features, 2, generator=generator)
        named += [(f"transformer.base_model.model.{layer}.lora_A.default.weight", lora_a),
                  (f"transformer.base_model.model.{layer}.lora_B.default.weight", lora_b)]
        merged[f"{layer}.weight"] = merge_lora_weight(merged[f"{layer}.weight"], lora_a, lora_b, 0.5)
    return named, [(f"transformer.{name}", t) for name, t in merged.items()]


def test_full_and_lora_broadcasts_give_every_engine_exact_weights(engines, base_transformer):
    group = WeightBroadcastGroup.connect(engines, timeout=60)
    try:
        assert group.backend == "gloo" and group.device.type == "cpu"
        for url, rank in zip(engines, (1, 2)):
            deadline = time.monotonic() + 30  # the engine's join thread marks itself ready just after the handshake
            while (info := _call(url, "/server_info", method="GET")[1]["weights_update_group"])["state"] != "ready":
                assert time.monotonic() < deadline, info
                time.sleep(0.1)
            assert info["group_name"] == group.name and info["rank"] == rank and info["world_size"] == 3
        new_weights = _perturbed(base_transformer, seed=1)
        stats = push_weights([], new_weights, BUCKET_BYTES, weight_version=7, broadcast_group=group)
        assert stats["num_buckets"] > 3 and stats["broadcast_engines"] == 2 and stats["ipc_engines"] == 0
        assert stats["engine_weight_versions"] == [7, 7]
        for url in engines:
            assert _state(url) == (named_tensor_checksums(new_weights), 7)

        lora_named, merged = _lora(base_transformer, seed=2)
        push_weights([], _named(base_transformer), BUCKET_BYTES, weight_version=8, broadcast_group=group)
        push_weights([], lora_named, 1024, weight_version=9, lora=True, lora_scaling=0.5, broadcast_group=group)
        for url in engines:
            assert _state(url) == (named_tensor_checksums(merged), 9)
    finally:
        group.close()
    for url in engines:
        assert _call(url, "/server_info", method="GET")[1]["weights_update_group"] is None  # left the group


def _per_tensor(url: str) -> dict[str, str]:
    status, body = _call(url, "/weights_checksum?per_tensor=1", method="GET")
    assert status == 200
    return body["checksums"]["transformer"]


def _receive_unstaged(group, urls):
    """The trainer's side of a broadcast whose bucket no engine staged: every engine must take part and drop it."""
    with ThreadPoolExecutor(len(urls) + 1) as pool:
        answers = [pool.submit(_call, url, "/receive_weights_broadcast",
                               {"group_name": group.name, "bucket": 999, "size": 64}) for url in urls]
        pool.submit(group.broadcast, torch.full((64,), 7, dtype=torch.uint8)).result(timeout=60)
        return [answer.result(timeout=60) for answer in answers]


def test_a_refused_bucket_writes_nothing_and_the_group_stays_usable(engines, base_transformer):
    group = WeightBroadcastGroup.connect(engines, timeout=60)
    try:
        push_weights([], _named(base_transformer), BUCKET_BYTES, weight_version=20, broadcast_group=group)
        name, tensor = _named(base_transformer)[5]
        good = _perturbed(base_transformer, seed=3)
        before = {url: _per_tensor(url) for url in engines}
        # one tensor per bucket: the first three apply, the misshapen fourth is refused by every engine
        with pytest.raises(WeightSyncError, match="shape"):
            push_weights([], [*good[:3], (name, tensor.reshape(-1)[:-1])], 1, weight_version=21,
                         broadcast_group=group)
        with pytest.raises(WeightSyncError, match="no parameter 'not_a_param'"):
            push_weights([], [("transformer.not_a_param", torch.zeros(2))], BUCKET_BYTES, weight_version=21,
                         broadcast_group=group)
        assert not group.broken
        short = name.partition(".")[2]
        for url in engines:
            now = _per_tensor(url)
            assert now[short] == before[url][short] and _state(url)[1] == 20
            assert all(now[n.partition(".")[2]] != before[url][n.partition(".")[2]] for n, _ in good[:3])
        # bytes broadcast for a bucket nobody staged are received and dropped
        for status, answer in _receive_unstaged(group, engines):
            assert status == 409 and "was not staged" in answer["error"]
        push_weights([], good, BUCKET_BYTES, weight_version=22, broadcast_group=group)
        for url in engines:
            assert _state(url) == (named_tensor_checksums(good), 22)
    finally:
        group.close()


def test_shared_memory_and_broadcast_engines_in_one_push(engines, base_transformer):
    ipc_url, broadcast_url = engines
    group = WeightBroadcastGroup.connect([broadcast_url], timeout=60)
    try:
        new_weights = _perturbed(base_transformer, seed=4)
        stats = push_weights([ipc_url], new_weights, BUCKET_BYTES, weight_version=30, broadcast_group=group)
        assert stats["ipc_engines"] == 1 and stats["broadcast_engines"] == 1
        for url in engines:
            assert _state(url) == (named_tensor_checksums(new_weights), 30)
        with pytest.raises(ValueError, match="either"):
            push_weights([broadcast_url], new_weights, BUCKET_BYTES, weight_version=31, broadcast_group=group)
    finally:
        group.close()


def _spec(**overrides) -> dict:
    spec = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
                group_name="miles-weights-test", backend="gloo", timeout_seconds=30.0)
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("overrides, message", [
    (dict(backend="mpi"), "backend must be one of"),
    (dict(backend="nccl"), "needs a CUDA device"),
    (dict(rank_offset=0), "rank_offset must be an integer in \\[1, 1\\]"),
    (dict(rank_offset=2), "rank_offset"),
    (dict(world_size=1), "world_size"),
    (dict(master_port=0), "master_port"),
    (dict(master_port=True), "master_port"),
    (dict(master_address="127.0.0.1/x"), "not an IP address or host name"),
    (dict(master_address="-evil"), "not an IP address or host name"),
    (dict(group_name="a b"), "group_name must match"),
    (dict(timeout_seconds=0), "timeout_seconds"),
    (dict(extra=1), "unknown \\['extra'\\]"),
])
def test_init_fields_are_checked_before_anything_joins(engines, overrides, message):
    status, answer = _call(engines[0], "/init_weights_update_group", _spec(**overrides))
    assert status == 400 and "\n" not in answer["error"]
    assert re.search(message, answer["error"]), answer["error"]


def test_bodies_for_the_wrong_endpoint_or_group_are_refused(engines):
    url = engines[0]
    assert _call(url, "/init_weights_update_group", b"not json")[0] == 400
    assert _call(url, "/destroy_weights_update_group", {"group_name": "not-mine"}) == (200, {"ok": True, "left": False})
    status, answer = _call(url, "/receive_weights_broadcast", {"group_name": "not-mine", "bucket": 1, "size": 8})
    assert status == 409 and "not a member" in answer["error"]
    broadcast = encode_update_message(UpdateMessage(weight_version=1, buffer=BroadcastRef("not-mine", 8, 1)))
    status, answer = _call(url, "/update_weights_from_tensor", broadcast)
    assert status == 400 and "update_weights_from_distributed" in answer["error"]
    status, answer = _call(url, "/update_weights_from_distributed", broadcast)
    assert status == 400 and "not a member" in answer["error"]
    shm = msgpack.packb(dict(protocol_version=2, weight_version=1, flush=False, lora=False, lora_scaling=1.0,
                             target_modules=None, buffer={"kind": "shm", "name": "miles_" + "0" * 32, "size": 8},
                             entries=[]))
    status, answer = _call(url, "/update_weights_from_distributed", shm)
    assert status == 400 and "update_weights_from_tensor" in answer["error"]
    bad_kind = msgpack.packb(dict(protocol_version=2, weight_version=1, flush=False, lora=False, lora_scaling=1.0,
                                  target_modules=None, entries=[],
                                  buffer={"kind": "broadcast", "group_name": "g", "size": 8, "bucket": -1}))
    status, answer = _call(url, "/update_weights_from_distributed", bad_kind)
    assert status == 400 and "bucket" in answer["error"]


def test_transport_choice():
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    mine = device_identity("cpu")
    identities = [mine, "other-host:x/cpu", mine]
    assert split_by_transport(urls, "auto", False, mine, identities) == ([], urls)
    assert split_by_transport(urls, "auto", True, mine, identities) == (["http://a:1", "http://c:3"], ["http://b:2"])
    assert split_by_transport(urls, "ipc", False, mine, identities) == (urls, [])
    assert split_by_transport(urls, "broadcast", True, mine, identities) == ([], urls)


def test_a_trainer_in_host_memory_reaches_the_gpu_engines_of_its_host_by_shared_memory():
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    host = device_identity("cpu").rpartition("/")[0]
    identities = [f"{host}/cuda:GPU-aaaa", "other-host:x/cuda:GPU-bbbb", f"{host}/cuda:GPU-cccc"]
    assert split_by_transport(urls, "auto", True, f"{host}/cpu", identities) == (["http://a:1", "http://c:3"],
                                                                              ["http://b:2"])
    # a trainer on one GPU shares memory with the engine on that GPU only
    assert split_by_transport(urls, "auto", True, f"{host}/cuda:GPU-aaaa", identities) == (
        ["http://a:1"], ["http://b:2", "http://c:3"])


def test_a_join_that_fails_is_reported_and_refuses_receives(engines):
    url = engines[1]
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    status, answer = _call(url, "/init_weights_update_group",
                           _spec(master_port=port, group_name="miles-weights-unreachable", timeout_seconds=2.0))
    assert status == 200 and answer["state"] == "joining"  # answered before joining: HTTP stays responsive
    deadline = time.monotonic() + 60
    while (info := _call(url, "/server_info", method="GET")[1]["weights_update_group"])["state"] == "joining":
        assert time.monotonic() < deadline, info
        time.sleep(0.2)  # the join runs on the engine's background thread; nothing to wait on but its state
    assert info["state"] == "failed" and info["error"]
    status, answer = _call(url, "/receive_weights_broadcast",
                           {"group_name": "miles-weights-unreachable", "bucket": 1, "size": 8})
    assert status == 409 and "failed" in answer["error"]
    assert _call(url, "/destroy_weights_update_group", {"group_name": "miles-weights-unreachable"}) == \
        (200, {"ok": True, "left": True})
