"""The wire format of a weight update (`POST /update_weights_from_tensor`): the message, its encoding and its
defensive decoding (miles/engine/weight_sync.py sends and receives it).

The message is plain msgpack: no pickle, no msgpack extensions, only known keys of known types, every integer in
range, every name and handle checked against its pattern, so that what an endpoint accepts is exactly a list of
tensor entries (name, dtype, shape, byte offset) inside one buffer named by reference: a shared-memory file on
CPU, a CUDA IPC handle's raw fields on GPU, or a broadcast over the run's weight-sync group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack
import torch

from miles.engine.protocol import ProtocolError

WEIGHT_SYNC_PROTOCOL_VERSION = 2  # 1 carried pickled handles; a version-1 sender is refused
ALIGN_BYTES = 256  # every tensor starts at a multiple of this inside a bucket (any dtype can view it)
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"miles_[0-9a-f]{32}")
# torch names its CUDA IPC ref-counter files /torch_<pid>_<random>_<counter> (older releases: /torch_<pid>_<n>)
REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}(?:_[0-9]{1,20}){1,2}")
CUDA_IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
MAX_IPC_HANDLE_BYTES = 1 << 16  # a cudaIpcMemHandle_t is 64 bytes (+1 type byte); expandable segments add more
MAX_BUFFER_BYTES = 1 << 40
MAX_ENTRIES = 1 << 20
MAX_NAME_CHARS = 1024
MAX_NDIM = 8
MAX_WEIGHT_VERSION = (1 << 63) - 1
GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a weight-sync broadcast group (weight_broadcast.py names them)
WIRE_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
WIRE_DTYPES = {name: dtype for dtype, name in WIRE_DTYPE_NAMES.items()}


class WeightSyncError(RuntimeError):
    """An engine rejected or failed a weight update; the message names the engine and its reason. The trainer's
    side of every transport raises it (weight_sync.py, weight_broadcast.py), so it sits below both."""


def aligned_size(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------------------
# the wire message


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a bucket: `nbytes` bytes at `offset` of the bucket's buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class SharedMemoryRef:
    """A CPU bucket: the shared-memory file `SHM_DIR/<name>` of at least `size` bytes."""

    name: str
    size: int


@dataclass(frozen=True)
class CudaIpcRef:
    """A GPU bucket: the fields of `UntypedStorage._share_cuda_()`, in its order."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def size(self) -> int:
        return self.storage_size


@dataclass(frozen=True)
class BroadcastRef:
    """A bucket that arrives by broadcast over the weight group `group_name` (`size` bytes, the trainer's bucket
    number `bucket`), staged by `POST /update_weights_from_distributed` (miles.engine.weight_broadcast)."""

    group_name: str
    size: int
    bucket: int


@dataclass(frozen=True)
class UpdateMessage:
    """One bucket (entries in `buffer`) or the final flush that commits `weight_version`."""

    weight_version: int
    flush: bool = False
    lora: bool = False
    lora_scaling: float = 1.0
    target_modules: tuple[str, ...] | None = None
    buffer: SharedMemoryRef | CudaIpcRef | BroadcastRef | None = None
    entries: tuple[TensorEntry, ...] = ()


def encode_buffer_ref(ref: SharedMemoryRef | CudaIpcRef | BroadcastRef) -> dict[str, Any]:
    """A buffer reference as the plain msgpack map `decode_buffer_ref` reads."""
    if isinstance(ref, SharedMemoryRef):
        return {"kind": "shm", "name": ref.name, "size": ref.size}
    if isinstance(ref, CudaIpcRef):
        return {
            "kind": "cuda_ipc",
            "device": ref.device,
            "handle": ref.handle,
            "storage_size": ref.storage_size,
            "storage_offset": ref.storage_offset,
            "ref_counter_handle": ref.ref_counter_handle,
            "ref_counter_offset": ref.ref_counter_offset,
            "event_handle": ref.event_handle,
            "event_sync_required": ref.event_sync_required,
        }
    return {"kind": "broadcast", "group_name": ref.group_name, "size": ref.size, "bucket": ref.bucket}


def encode_update_message(message: UpdateMessage) -> bytes:
    buffer = None if message.buffer is None else encode_buffer_ref(message.buffer)
    body = {
        "protocol_version": WEIGHT_SYNC_PROTOCOL_VERSION,
        "weight_version": message.weight_version,
        "flush": message.flush,
        "lora": message.lora,
        "lora_scaling": message.lora_scaling,
        "target_modules": list(message.target_modules) if message.target_modules is not None else None,
        "buffer": buffer,
        "entries": [[e.name, WIRE_DTYPE_NAMES[e.dtype], list(e.shape), e.offset] for e in message.entries],
    }
    return msgpack.packb(body, use_bin_type=True)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expect_int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:  # type(...) is int: a bool is not a number here
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}], got {_short(value)}")
    return value


def _expect_bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{what} must be a boolean, got {_short(value)}")
    return value


def _expect_bytes(value: Any, what: str, lo: int, hi: int) -> bytes:
    if type(value) is not bytes or not lo <= len(value) <= hi:
        raise ProtocolError(f"{what} must be {lo}..{hi} raw bytes, got {_short(value)}")
    return value


def _expect_map(value: Any, what: str, keys: set[str]) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a map, got {_short(value)}")
    if set(value) != keys:
        raise ProtocolError(
            f"{what} must have exactly the keys {sorted(keys)}; unknown {sorted(map(str, set(value) - keys))}, "
            f"missing {sorted(keys - set(value))}"
        )
    return value


_MESSAGE_KEYS = {"protocol_version", "weight_version", "flush", "lora", "lora_scaling", "target_modules", "buffer",
                 "entries"}
_SHM_KEYS = {"kind", "name", "size"}
_BROADCAST_KEYS = {"kind", "group_name", "size", "bucket"}
_CUDA_KEYS = {"kind", "device", "handle", "storage_size", "storage_offset", "ref_counter_handle",
              "ref_counter_offset", "event_handle", "event_sync_required"}


def _reject_extension(code: int, data: bytes) -> Any:
    raise ProtocolError(f"weight update bodies carry no msgpack extensions (got code {code})")


def decode_update_message(body: bytes, cuda_device_count: int | None = None) -> UpdateMessage:
    """Parse and check one body; raises ProtocolError (a 400) for anything but a well-formed message.

    `cuda_device_count`: the devices a CUDA IPC handle may name (default: this process's count)."""
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_reject_extension)
    except ProtocolError:
        raise
    except Exception as err:  # msgpack raises several unrelated types for a broken body
        raise ProtocolError(f"weight update body is not valid msgpack: {type(err).__name__}: {err}") from err
    raw = _expect_map(raw, "weight update message", _MESSAGE_KEYS)
    if type(raw["protocol_version"]) is not int or raw["protocol_version"] != WEIGHT_SYNC_PROTOCOL_VERSION:
        raise ProtocolError(f"weight update protocol_version {_short(raw['protocol_version'])}; this engine speaks "
                            f"{WEIGHT_SYNC_PROTOCOL_VERSION}")
    lora_scaling = raw["lora_scaling"]
    if type(lora_scaling) not in (int, float) or not abs(lora_scaling) < float("inf"):
        raise ProtocolError(f"lora_scaling must be a finite number, got {_short(lora_scaling)}")
    target_modules = raw["target_modules"]
    if target_modules is not None:
        if not isinstance(target_modules, list) or not all(
            isinstance(m, str) and 0 < len(m) <= MAX_NAME_CHARS for m in target_modules
        ):
            raise ProtocolError(f"target_modules must be a list of module names, got {_short(target_modules)}")
        target_modules = tuple(target_modules)
    flush = _expect_bool(raw["flush"], "flush")
    buffer = None if raw["buffer"] is None else decode_buffer_ref(raw["buffer"], cuda_device_count)
    entries = _decode_entries(raw["entries"], buffer)
    if flush and (buffer is not None or entries):
        raise ProtocolError("a flush message carries no buffer and no entries")
    return UpdateMessage(
        weight_version=_expect_int(raw["weight_version"], "weight_version", 0, MAX_WEIGHT_VERSION),
        flush=flush,
        lora=_expect_bool(raw["lora"], "lora"),
        lora_scaling=float(lora_scaling),
        target_modules=target_modules,
        buffer=buffer,
        entries=entries,
    )


def decode_buffer_ref(raw: Any, cuda_device_count: int | None, by_reference_only: bool = False
                      ) -> SharedMemoryRef | CudaIpcRef | BroadcastRef:
    """The checked reference of `encode_buffer_ref`'s map (ProtocolError otherwise). `by_reference_only`: a
    shared-memory file or a CUDA IPC handle, never a broadcast."""
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if by_reference_only and kind == "broadcast":
        raise ProtocolError("this buffer must be a shared-memory file or a CUDA IPC handle, not a broadcast")
    if kind == "shm":
        raw = _expect_map(raw, "shm buffer", _SHM_KEYS)
        name = raw["name"]
        if not isinstance(name, str) or SHM_NAME.fullmatch(name) is None:
            raise ProtocolError(f"shm buffer name must match {SHM_NAME.pattern}, got {_short(name)}")
        return SharedMemoryRef(name, _expect_int(raw["size"], "shm buffer size", 1, MAX_BUFFER_BYTES))
    if kind == "cuda_ipc":
        if cuda_device_count is None:
            cuda_device_count = torch.cuda.device_count()
        return validate_cuda_ipc_fields(_expect_map(raw, "cuda_ipc buffer", _CUDA_KEYS), cuda_device_count)
    if kind == "broadcast":
        raw = _expect_map(raw, "broadcast buffer", _BROADCAST_KEYS)
        name = raw["group_name"]
        if not isinstance(name, str) or GROUP_NAME.fullmatch(name) is None:
            raise ProtocolError(f"broadcast buffer group_name must match {GROUP_NAME.pattern}, got {_short(name)}")
        return BroadcastRef(name, _expect_int(raw["size"], "broadcast buffer size", 1, MAX_BUFFER_BYTES),
                            _expect_int(raw["bucket"], "broadcast buffer bucket", 0, MAX_WEIGHT_VERSION))
    raise ProtocolError(f"buffer must be a map with kind 'shm', 'cuda_ipc' or 'broadcast', got {_short(raw)}")


def validate_cuda_ipc_fields(raw: Mapping[str, Any], cuda_device_count: int) -> CudaIpcRef:
    """Type- and range-check the raw CUDA IPC fields before anything is handed to the CUDA driver."""
    if cuda_device_count < 1:
        raise ProtocolError("a cuda_ipc buffer was sent to an engine without a CUDA device")
    ref_counter_handle = _expect_bytes(raw["ref_counter_handle"], "cuda_ipc ref_counter_handle", 1, 256)
    if REF_COUNTER_NAME.fullmatch(ref_counter_handle) is None:
        raise ProtocolError(f"cuda_ipc ref_counter_handle must name a torch ref-counter file, got "
                            f"{_short(ref_counter_handle)}")
    return CudaIpcRef(
        device=_expect_int(raw["device"], "cuda_ipc device", 0, cuda_device_count - 1),
        handle=_expect_bytes(raw["handle"], "cuda_ipc handle", 1, MAX_IPC_HANDLE_BYTES),
        storage_size=_expect_int(raw["storage_size"], "cuda_ipc storage_size", 1, MAX_BUFFER_BYTES),
        storage_offset=_expect_int(raw["storage_offset"], "cuda_ipc storage_offset", 0, MAX_BUFFER_BYTES),
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=_expect_int(raw["ref_counter_offset"], "cuda_ipc ref_counter_offset", 0, 1 << 32),
        event_handle=_expect_bytes(raw["event_handle"], "cuda_ipc event_handle", CUDA_IPC_EVENT_HANDLE_BYTES,
                                   CUDA_IPC_EVENT_HANDLE_BYTES),
        event_sync_required=_expect_bool(raw["event_sync_required"], "cuda_ipc event_sync_required"),
    )


def _decode_entries(raw: Any, buffer: SharedMemoryRef | CudaIpcRef | BroadcastRef | None) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise ProtocolError(f"entries must be a list of at most {MAX_ENTRIES} [name, dtype, shape, offset]")
    if raw and buffer is None:
        raise ProtocolError("entries without a buffer")
    entries = []
    names: set[str] = set()
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            raise ProtocolError(f"an entry must be [name, dtype, shape, offset], got {_short(item)}")
        name, dtype_name, shape, offset = item
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ProtocolError(f"entry name must be a string of 1..{MAX_NAME_CHARS} characters, got {_short(name)}")
        if name in names:
            raise ProtocolError(f"weight {name!r} appears twice in one bucket")
        names.add(name)
        if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
            raise ProtocolError(f"weight {name!r}: dtype {_short(dtype_name)} is not one of {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise ProtocolError(f"weight {name!r}: shape must be a list of at most {MAX_NDIM} sizes")
        dims = tuple(_expect_int(dim, f"weight {name!r} shape entry", 0, MAX_BUFFER_BYTES) for dim in shape)
        entry = TensorEntry(name, WIRE_DTYPES[dtype_name], dims, _expect_int(offset, f"weight {name!r} offset", 0,
                                                                         MAX_BUFFER_BYTES))
        if entry.offset % entry.dtype.itemsize:
            raise ProtocolError(f"weight {name!r}: offset {entry.offset} is not a multiple of its element size")
        assert buffer is not None
        if entry.offset + entry.nbytes > buffer.size:
            raise ProtocolError(f"weight {name!r}: bytes [{entry.offset}, {entry.offset + entry.nbytes}) lie outside "
                                f"the {buffer.size}-byte buffer")
        entries.append(entry)
    return tuple(entries)


# ---------------------------------------------------------------------------------------------------------
# checksums
