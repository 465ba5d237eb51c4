"""Property-based fuzzing (hypothesis) of what the engine parses from the network: the generate request decoder
and the weight-update decoder + validator. Whatever the bytes, the answer is a parsed message or a
ProtocolError (a 400), never another exception; a weight update that is refused changes no parameter, and one
that is accepted copies exactly the bytes it names."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from miles.engine.protocol import GenerateRequest, ProtocolError, RequestLimits, decode_request, encode_request
from miles.engine.weight_sync import (
    WeightReceiver,
    SharedBuffer,
)
from miles.engine.weight_sync_wire import (
    CudaIpcRef,
    UpdateMessage,
    WEIGHT_SYNC_PROTOCOL_VERSION,
    decode_update_message,
    validate_cuda_ipc_fields,
)

# bounded and quiet: ~50 examples each, no example database written into the repository
FUZZ = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# any msgpack value: what a hostile client can put in any field
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _valid_request_body() -> dict:
    request = GenerateRequest(prompt="a cat", num_samples=2, seed=3, num_steps=4, height=32, width=32,
                              sde_step_indices=[1], return_latent_indices=[1, 2])
    return msgpack.unpackb(encode_request(request), raw=False)


REQUEST_FIELDS = sorted(_valid_request_body())


@st.composite
def mutated_request_bodies(draw) -> bytes:
    """A valid body with a few fields replaced by arbitrary values or values near the limits, dropped, or joined
    by unknown ones (biased so that both outcomes, accepted and refused, are common)."""
    body = _valid_request_body()
    for name in draw(st.lists(st.sampled_from(REQUEST_FIELDS), max_size=3, unique=True)):
        action = draw(st.sampled_from(["replace", "drop", "near", "near"]))
        if action == "drop":
            body.pop(name)
        elif action == "near" and type(body[name]) is int:
            body[name] = draw(st.integers(-3, 5000))  # around and beyond the limits
        elif action == "near" and type(body[name]) is float:
            body[name] = draw(st.floats(-1.0, 10.0) | st.integers(0, 10))
        else:
            body[name] = draw(msgpack_values)
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.text(max_size=12))] = draw(msgpack_values)
    return msgpack.packb(body, use_bin_type=True)


@FUZZ
@given(st.one_of(mutated_request_bodies(), st.binary(max_size=200),
                 msgpack_values.map(lambda value: msgpack.packb(value, use_bin_type=True))))
def test_the_request_decoder_answers_a_request_or_a_protocol_error(body):
    limits = RequestLimits()
    try:
        request = decode_request(body, limits)
    except ProtocolError:
        return
    # accepted: every field has its declared type and lies within the limits, and it survives a round trip
    assert type(request.prompt) is str and type(request.num_samples) is int
    assert 1 <= request.num_samples <= limits.max_samples and 1 <= request.num_steps <= limits.max_steps
    assert 0 < request.height <= limits.max_image_size and 0 < request.width <= limits.max_image_size
    assert 0 < request.num_frames <= limits.max_frames
    assert math.isfinite(request.noise_level) and math.isfinite(request.guidance.guidance_scale)
    assert all(type(k) is int and 0 <= k < request.num_steps for k in request.sde_step_indices)
    assert decode_request(encode_request(request), limits) == request


# ---- weight updates ----------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2, bias=False)
        self.register_buffer("table", torch.zeros(3))  # buffers are not writable remotely


MODULE = _Tiny()
PARAMS = dict(MODULE.named_parameters())
BUFFER = SharedBuffer(512, torch.device("cpu"))  # a real /dev/shm bucket, removed at the end of the module
BUFFER.buffer.view(torch.float32).copy_(torch.randn(128, generator=torch.Generator().manual_seed(0)))
NAMES = [f"transformer.{name}" for name in PARAMS] + ["transformer.table", "transformer.nope", "unet.proj.weight",
                                                      "transformer", ""]
SHAPES = [list(p.shape) for p in PARAMS.values()] + [[12], [3, 4, 1], [], [0]]


@pytest.fixture(scope="module", autouse=True)
def _remove_bucket():
    yield
    BUFFER.close()


def _plausible_entry(name: str) -> st.SearchStrategy:
    """A parameter's real shape in an allowed float dtype at an aligned offset: mostly accepted."""
    shape = list(PARAMS[name].shape)
    return st.tuples(st.just(f"transformer.{name}"), st.sampled_from(["float32", "float16", "bfloat16"]),
                     st.just(shape), st.sampled_from([0, 64, 128, 256, 384])).map(list)


any_entry = st.tuples(
    st.sampled_from(NAMES), st.sampled_from(["float32", "float16", "bfloat16", "complex64", "object"]),
    st.sampled_from(SHAPES) | st.lists(st.integers(-2, 6), max_size=3),
    st.sampled_from([0, 16, 64, 256, 384, 500]) | st.integers(-8, 600),
).map(list)


@st.composite
def update_bodies(draw) -> bytes:
    names = draw(st.lists(st.sampled_from(sorted(PARAMS)), max_size=3, unique=True))
    entries = [draw(_plausible_entry(name)) for name in names]
    if draw(st.integers(0, 2)) == 0:
        entries.insert(draw(st.integers(0, len(entries))), draw(any_entry))  # one suspicious entry among them
    body = {
        "protocol_version": WEIGHT_SYNC_PROTOCOL_VERSION,
        "weight_version": draw(st.integers(-2, 10)),
        "flush": False,
        "lora": False,
        "lora_scaling": 1.0,
        "target_modules": draw(st.sampled_from([None, ["transformer"], ["transformer_2"]])),
        "buffer": {"kind": "shm", "name": BUFFER.shm_name, "size": draw(st.sampled_from([512, 512, 256, 0, 4096]))},
        "entries": entries,
    }
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.sampled_from(sorted(body)))] = draw(msgpack_values)  # any field at all may be junk
    return msgpack.packb(body, use_bin_type=True)


@FUZZ
@given(st.one_of(update_bodies(), st.binary(max_size=100)))
def test_a_refused_weight_update_changes_nothing_and_an_accepted_one_copies_exactly(body):
    receiver = WeightReceiver({"transformer": MODULE})
    before = {name: p.detach().clone() for name, p in PARAMS.items()}
    table_before = MODULE.table.clone()
    try:
        message = decode_update_message(body, cuda_device_count=0)
        receiver.apply(message)
    except ProtocolError:
        assert all(torch.equal(PARAMS[name], before[name]) for name in PARAMS)
        assert torch.equal(MODULE.table, table_before)
        return
    assert isinstance(message, UpdateMessage)
    flat = BUFFER.buffer
    written = set()
    for entry in message.entries:
        assert entry.offset + entry.nbytes <= min(message.buffer.size, flat.numel())
        name = entry.name.partition(".")[2]
        expected = flat[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
        assert torch.equal(PARAMS[name], expected.to(PARAMS[name].dtype))
        written.add(name)
    assert all(torch.equal(PARAMS[name], before[name]) for name in PARAMS if name not in written)
    assert torch.equal(MODULE.table, table_before)
    with torch.no_grad():  # restore for the next example
        for name, p in PARAMS.items():
            p.copy_(before[name])


# ---- CUDA IPC fields (checked on CPU: no GPU here) --------------------------------------------------------

GOOD_CUDA_FIELDS = dict(kind="cuda_ipc", device=0, handle=b"\x01" + b"h" * 64, storage_size=1 << 20, storage_offset=0,
                        ref_counter_handle=b"/torch_1234_987654321_0", ref_counter_offset=3,
                        event_handle=b"e" * 64, event_sync_required=True)


def test_well_formed_cuda_ipc_fields_pass_and_name_an_existing_device():
    ref = validate_cuda_ipc_fields(GOOD_CUDA_FIELDS, cuda_device_count=2)
    assert isinstance(ref, CudaIpcRef) and ref.size == 1 << 20 and ref.event_sync_required is True
    with pytest.raises(ProtocolError, match="device"):
        validate_cuda_ipc_fields({**GOOD_CUDA_FIELDS, "device": 2}, cuda_device_count=2)
    with pytest.raises(ProtocolError, match="without a CUDA device"):
        validate_cuda_ipc_fields(GOOD_CUDA_FIELDS, cuda_device_count=0)
    for field, bad in [("handle", "text"), ("handle", b""), ("storage_size", 0), ("storage_size", True),
                       ("storage_offset", -1), ("ref_counter_handle", b"/etc/passwd"),
                       ("ref_counter_handle", b"/torch_1_2/../x"), ("ref_counter_offset", 1.0),
                       ("event_handle", b"e" * 63), ("event_sync_required", 1)]:
        with pytest.raises(ProtocolError, match=field):
            validate_cuda_ipc_fields({**GOOD_CUDA_FIELDS, field: bad}, cuda_device_count=2)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(GOOD_CUDA_FIELDS)), msgpack_values, max_size=4))
def test_fuzzed_cuda_ipc_fields_are_checked_or_refused(overrides):
    body = {"protocol_version": WEIGHT_SYNC_PROTOCOL_VERSION, "weight_version": 1, "flush": False, "lora": False,
            "lora_scaling": 1.0, "target_modules": None, "buffer": {**GOOD_CUDA_FIELDS, **overrides},
            "entries": [["transformer.proj.weight", "float32", [3, 4], 0]]}
    try:
        message = decode_update_message(msgpack.packb(body, use_bin_type=True), cuda_device_count=1)
    except ProtocolError:
        return
    ref = message.buffer
    assert isinstance(ref, CudaIpcRef) and ref.device == 0
    assert type(ref.handle) is bytes and 1 <= len(ref.handle) and len(ref.event_handle) == 64
    assert 1 <= ref.storage_size and ref.storage_offset >= 0 and type(ref.event_sync_required) is bool
    assert ref.ref_counter_handle.startswith(b"/torch_")
