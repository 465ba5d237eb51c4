"""Weight sync from a trainer process into running engines (`POST /update_weights_from_tensor`).

Sender (`push_weights`, called in the trainer process): named tensors are packed into one flat byte buffer per
bucket of at most `bucket_bytes`; the buffer travels by reference, never as bytes:

- CPU: a shared-memory file `/dev/shm/miles_<32 hex>` that the sender creates (mode 0600) and unlinks when the
  push ends; the message names it and gives its size.
- GPU: a CUDA IPC handle, sent as its raw fields (what `UntypedStorage._share_cuda_()` returns: device index,
  memory handle bytes, storage size and offset, ref-counter file and offset, event handle, event_sync_required)
  and rebuilt engine-side with `UntypedStorage._new_shared_cuda` once every field passed its type and range
  check. Every engine gets its own handle per bucket (CUDA IPC counts its consumers).

The message is plain msgpack (miles/engine/weight_sync_wire.py: `encode_update_message` /
`decode_update_message`): no pickle, no msgpack extensions, only known keys of known types. Per tensor it carries name, dtype, shape and byte offset. The sender
keeps the buffer alive until every engine answered, and an engine answers only after it copied the bucket into
its parameters, so the receiver never reads freed memory. Two buffers alternate: the next bucket is packed
while the engines copy the previous one.

Names are `<module>.<parameter name>` (e.g. `transformer.transformer_blocks.0.attn.to_q.weight`), where
`<module>` is a pipeline component (`--update-weight-target-module`).

LoRA (`lora=True`, `--lora-ipc-weight-sync`): the tensors are PEFT A/B pairs
(`<module>.[base_model.model.]<layer>.lora_A[.<adapter>].weight` and the matching `lora_B`); the engine merges
`W = W_base + scaling · B @ A` (in fp32, cast to W's dtype). The engine keeps the unmerged `W_base` of every
merged layer (in host memory, pinned on a GPU engine), so the next LoRA update replaces the previous delta
instead of adding to it. A full-weight update of a layer makes the pushed weight its new base.

The receiving side is `WeightReceiver`: it checks every entry of a bucket (known parameter of an allowed
module, dtype in the allow-list, shape equal to the parameter's, bytes inside the buffer) before it copies
anything, so a rejected bucket changes nothing. `module_checksums` / `named_tensor_checksums` give the same
digest on both sides, so tests can prove the engine holds exactly the trainer's weights (`GET
/weights_checksum`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import mmap
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from miles.engine.protocol import ProtocolError
from miles.engine.weight_sync_wire import (
    SHM_DIR,
    SHM_NAME,
    WIRE_DTYPE_NAMES,
    BroadcastRef,
    CudaIpcRef,
    SharedMemoryRef,
    TensorEntry,
    UpdateMessage,
    WeightSyncError,
    aligned_size,
    encode_update_message,
    tensor_nbytes,
)
from miles.utils.async_utils import run_sync
from miles.utils.auth import auth_headers
from miles.utils.cuda_allocator import fixed_segments
from miles.utils.device_memory import host_copy

if TYPE_CHECKING:
    from miles.engine.weight_broadcast import WeightBroadcastGroup

logger = logging.getLogger(__name__)

_LORA_NAME = re.compile(
    r"^(?P<module>[^.]+)\.(?:base_model\.model\.)?(?P<layer>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$"
)


def canonical_lora_name(name: str) -> str:
    """`<module>.[base_model.model.]<layer>.lora_A[.<adapter>].weight` -> `<module>.<layer>.lora_A.weight`: the
    name a pushed LoRA factor is known by on both sides."""
    match = _LORA_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA factor's name")
    return f"{match['module']}.{match['layer']}.lora_{match['which']}.weight"


def _digest_tensor(hasher: Any, name: str, tensor: torch.Tensor) -> None:
    host = tensor.detach().to("cpu").contiguous()
    hasher.update(f"{name}|{WIRE_DTYPE_NAMES.get(host.dtype, str(host.dtype))}|{list(host.shape)}|".encode())
    if host.numel():
        hasher.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_checksum(name: str, tensor: torch.Tensor) -> str:
    """One tensor's digest as `GET /weights_checksum?per_tensor=1` reports it (`name` without the module)."""
    hasher = hashlib.sha256()
    _digest_tensor(hasher, name, tensor)
    return hasher.hexdigest()


def module_checksums(
    modules: Mapping[str, nn.Module], per_tensor: bool = False, include_buffers: bool = False
) -> dict[str, Any]:
    """Engine side: sha256 per module over its parameters (sorted by name; name, dtype, shape and bytes of each).

    Parameters are what a trainer syncs; `include_buffers` adds the buffers (e.g. fixed positional tables)."""
    result: dict[str, Any] = {}
    for module_name, module in modules.items():
        tensors = dict(module.named_parameters())
        if include_buffers:
            tensors.update(dict(module.named_buffers()))
        result[module_name] = _checksum_dict(tensors, per_tensor)
    return result


def named_tensor_checksums(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None, per_tensor: bool = False
) -> dict[str, Any]:
    """Trainer side: the same digest from `<module>.<name>` tensors (cast to `dtype`, the engine's, when given).
    Pass every parameter of each module (and its buffers to compare with `include_buffers`)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for full_name, tensor in named_tensors:
        module_name, _, name = full_name.partition(".")
        grouped.setdefault(module_name, {})[name] = tensor if dtype is None else tensor.to(dtype)
    return {module_name: _checksum_dict(tensors, per_tensor) for module_name, tensors in grouped.items()}


def _checksum_dict(tensors: Mapping[str, torch.Tensor], per_tensor: bool) -> Any:
    if per_tensor:
        out = {}
        for name in sorted(tensors):
            hasher = hashlib.sha256()
            _digest_tensor(hasher, name, tensors[name])
            out[name] = hasher.hexdigest()
        return out
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        _digest_tensor(hasher, name, tensors[name])
    return hasher.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# sender


class SharedBuffer:
    """A reusable flat byte buffer on one device that engine processes can map: a /dev/shm file on the CPU,
    a CUDA allocation (shared through CUDA IPC) on a GPU. `shared=False`: plain host memory (a CPU buffer that
    only travels by broadcast needs no file)."""

    def __init__(self, nbytes: int, device: torch.device, shared: bool = True):
        self.device = device
        self.shm_name: str | None = None
        self._mapping: mmap.mmap | None = None
        nbytes = max(1, nbytes)
        if device.type == "cuda" or not shared:
            with fixed_segments():  # engines open it by CUDA IPC (miles/utils/cuda_allocator.py)
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return
        self.shm_name = f"miles_{secrets.token_hex(16)}"
        # O_EXCL: never adopt a file someone else planted under that name; 0600: only this user's engines read it
        fd = os.open(self._shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(self._shm_path)
            raise
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mapping, dtype=torch.uint8)

    @property
    def _shm_path(self) -> str:
        assert self.shm_name is not None
        return os.path.join(SHM_DIR, self.shm_name)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[TensorEntry, ...]:
        entries = []
        offset = 0
        for name, tensor in tensors:
            nbytes = tensor_nbytes(tensor)
            if tensor.dtype not in WIRE_DTYPE_NAMES:
                raise TypeError(f"weight {name!r} has dtype {tensor.dtype}, which weight sync does not carry")
            target = self.buffer[offset : offset + nbytes].view(tensor.dtype)
            target.copy_(tensor.detach().reshape(-1), non_blocking=True)
            entries.append(TensorEntry(name, tensor.dtype, tuple(tensor.shape), offset))
            offset = aligned_size(offset + nbytes)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the receiver reads on its own stream
        return tuple(entries)

    def describe(self) -> SharedMemoryRef | CudaIpcRef:
        """How an engine finds this buffer; on CUDA a fresh IPC handle per receiving engine and bucket."""
        if self.shm_name is not None:
            return SharedMemoryRef(self.shm_name, self.capacity)
        (device, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = self.buffer.untyped_storage()._share_cuda_()
        return CudaIpcRef(int(device), bytes(handle), int(storage_size), int(storage_offset),
                          bytes(ref_counter_handle), int(ref_counter_offset), bytes(event_handle),
                          bool(event_sync_required))

    def close(self) -> None:
        """Unlink the shared-memory file (engines that still map it keep their mapping until they drop it)."""
        if self.shm_name is None:
            return
        del self.buffer  # the tensor exports the mapping's buffer; drop it before closing the mapping
        assert self._mapping is not None
        with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped when the last one goes
            self._mapping.close()
        with contextlib.suppress(FileNotFoundError):  # already gone: someone cleaned /dev/shm; nothing to undo
            os.unlink(self._shm_path)
        self.shm_name = None


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = aligned_size(tensor_nbytes(tensor))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, size
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, size


def _timed(named_tensors: Iterable[tuple[str, torch.Tensor]], stats: dict[str, Any]):
    """The tensors as they come, adding the time spent producing them (the trainer gathering and casting its
    weights) to `stats["gather_seconds"]`."""
    iterator = iter(named_tensors)
    while True:
        began = time.perf_counter()
        item = next(iterator, None)
        stats["gather_seconds"] += time.perf_counter() - began
        if item is None:
            return
        yield item


def add_engine_seconds(stats: dict[str, Any], answers: Sequence[dict]) -> None:
    """Add one message's engine times to the push report: the slowest engine's wait for its worker thread and
    its apply (the engines take a bucket concurrently, so the push waits for the slowest)."""
    for key in ("wait_seconds", "apply_seconds"):
        stats[f"engine_{key}"] += max((float(a.get(key, 0.0)) for a in answers), default=0.0)


async def _post_bucket(session, url: str, body: bytes, timeout: float, headers: dict[str, str],
                       path: str = "/update_weights_from_tensor") -> dict:
    import aiohttp

    try:
        async with session.post(
            f"{url}{path}",
            data=body,
            headers={"Content-Type": "application/x-msgpack", **headers},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            payload = await response.json(content_type=None)
            if response.status != 200:
                raise WeightSyncError(f"engine {url} rejected the weight update: {payload.get('error', payload)}")
            return payload
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise WeightSyncError(f"engine {url} unreachable during weight update: {type(err).__name__}: {err}") from err


async def _post_receive(session, url: str, group_name: str, bucket: int, size: int, timeout: float,
                        headers: dict[str, str]) -> dict:
    import aiohttp

    try:
        async with session.post(
            f"{url}/receive_weights_broadcast",
            json={"group_name": group_name, "bucket": bucket, "size": size},
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            payload = await response.json(content_type=None)
            if response.status != 200:
                raise WeightSyncError(f"engine {url} failed to receive broadcast bucket {bucket}: "
                                      f"{payload.get('error', payload)}")
            return payload
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise WeightSyncError(f"engine {url} unreachable during weight broadcast: {type(err).__name__}: {err}") from err


async def push_weights_async(
    engine_urls: Sequence[str],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    weight_version: int,
    lora: bool = False,
    *,
    lora_scaling: float = 1.0,
    target_modules: Sequence[str] | None = None,
    timeout: float = 600.0,
    api_key: str | None = None,
    broadcast_group: "WeightBroadcastGroup | None" = None,
) -> dict[str, Any]:
    """See `push_weights`."""
    import aiohttp

    began = time.perf_counter()
    group = broadcast_group
    if group is not None and (group.broken or set(group.engine_urls) & set(engine_urls)):
        raise ValueError("an engine is reached either by shared memory / CUDA IPC or by broadcast, not both, and a "
                         "broken broadcast group must be built again")
    group_urls = list(group.engine_urls) if group is not None else []
    stats: dict[str, Any] = {"num_tensors": 0, "num_buckets": 0, "bytes": 0, "ipc_engines": len(engine_urls),
                             "broadcast_engines": len(group_urls), "gather_seconds": 0.0,
                             "engine_wait_seconds": 0.0, "engine_apply_seconds": 0.0}
    buffers: dict[tuple[torch.device, int], SharedBuffer] = {}
    in_flight: asyncio.Future | None = None
    in_flight_slot: int | None = None
    headers = auth_headers(api_key)
    loop = asyncio.get_running_loop()

    def buffer_for(device: torch.device, size: int, slot: int) -> SharedBuffer:
        key = (device, slot)
        current = buffers.get(key)
        if current is None or current.capacity < size:
            # the bucket's own size, not `bucket_bytes`: a LoRA push of 75 MB took a 512 MiB GPU buffer that
            # the trainer's allocator then kept beside the engine; a bigger bucket later grows it once
            capacity = size if current is None else max(size, min(bucket_bytes, 2 * current.capacity))
            if current is not None:
                current.close()
            # engines reached by IPC map the buffer; a broadcast-only buffer is plain memory
            current = SharedBuffer(capacity, device, shared=bool(engine_urls))
            buffers[key] = current
        stats["buffer_bytes"] = sum(buffer.capacity for buffer in buffers.values())
        return current

    def message(**fields) -> bytes:
        return encode_update_message(
            UpdateMessage(
                weight_version=int(weight_version),
                lora=bool(lora),
                lora_scaling=float(lora_scaling),
                target_modules=tuple(target_modules) if target_modules else None,
                **fields,
            )
        )

    async def send_ipc(buffer: SharedBuffer, entries: tuple[TensorEntry, ...]) -> None:
        bodies = [message(buffer=buffer.describe(), entries=entries) for _ in engine_urls]
        add_engine_seconds(stats, await asyncio.gather(*(_post_bucket(session, url, body, timeout, headers)
                                                         for url, body in zip(engine_urls, bodies))))

    async def send_broadcast(buffer: SharedBuffer, entries: tuple[TensorEntry, ...], size: int) -> None:
        assert group is not None
        bucket = group.next_bucket_id()
        body = message(buffer=BroadcastRef(group.name, size, bucket), entries=entries)
        # phase 1: every engine checks the entries and stages the bucket; a refusal stops here, nothing written
        await asyncio.gather(*(_post_bucket(session, url, body, timeout, headers, "/update_weights_from_distributed")
                               for url in group_urls))
        # phase 2: every engine receives while we broadcast
        receives = asyncio.gather(*(_post_receive(session, url, group.name, bucket, size, timeout, headers)
                                    for url in group_urls))
        sent = loop.run_in_executor(None, group.broadcast, buffer.buffer[:size])
        results = await asyncio.gather(receives, sent, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            group.broken = True  # a member may be stuck or gone: the group is rebuilt before the next push
            if isinstance(failures[0], WeightSyncError):
                raise failures[0]
            raise WeightSyncError(f"weight broadcast of bucket {bucket} over {group.name} failed: "
                                  f"{type(failures[0]).__name__}: {failures[0]}") from failures[0]

    async def transfer(buffer: SharedBuffer, entries: tuple[TensorEntry, ...], size: int) -> None:
        parts = []
        if engine_urls:
            parts.append(send_ipc(buffer, entries))
        if group_urls:
            parts.append(send_broadcast(buffer, entries, size))
        await asyncio.gather(*parts)

    async def flush() -> list[dict]:
        body = message(flush=True)
        return await asyncio.gather(
            *(_post_bucket(session, url, body, timeout, headers) for url in engine_urls),
            *(_post_bucket(session, url, body, timeout, headers, "/update_weights_from_distributed")
              for url in group_urls),
        )

    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            slot = 0
            for bucket, size in _buckets(_timed(named_tensors, stats), bucket_bytes):
                devices = {tensor.device for _, tensor in bucket}
                if len(devices) != 1:  # one buffer per bucket: split a mixed bucket by device
                    raise ValueError(f"a weight bucket mixes devices {devices}; put all synced tensors on one device")
                if in_flight is not None and in_flight_slot == slot:
                    await in_flight  # this slot's buffer is still being read by the engines
                    in_flight = None
                # a broadcast sends from the group's device (the GPU for NCCL, even for host tensors)
                device = group.device if group is not None else devices.pop()
                buffer = buffer_for(device, size, slot)
                entries = buffer.pack(bucket)
                if in_flight is not None:
                    await in_flight
                in_flight = asyncio.ensure_future(transfer(buffer, entries, size))
                in_flight_slot = slot
                slot = 1 - slot
                stats["num_tensors"] += len(bucket)
                stats["num_buckets"] += 1
                stats["bytes"] += sum(tensor_nbytes(t) for _, t in bucket)
            if in_flight is not None:
                await in_flight
                in_flight = None
            # the flush message commits the version (and checks that every LoRA pair arrived)
            answers = await flush()
            add_engine_seconds(stats, answers)
    finally:
        if in_flight is not None:
            # a failed push: let the engines finish with the buffers before they are unmapped and unlinked
            await asyncio.gather(in_flight, return_exceptions=True)
        for buffer in buffers.values():
            buffer.close()
    stats["seconds"] = time.perf_counter() - began
    stats["engine_weight_versions"] = [answer.get("weight_version") for answer in answers]
    return stats


def push_weights(
    engine_urls: Sequence[str],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    weight_version: int,
    lora: bool = False,
    *,
    lora_scaling: float = 1.0,
    target_modules: Sequence[str] | None = None,
    timeout: float = 600.0,
    api_key: str | None = None,
    broadcast_group: "WeightBroadcastGroup | None" = None,
) -> dict[str, Any]:
    """Push `named_tensors` (`<module>.<param>` names) to every engine, in buckets of at most `bucket_bytes`.

    `engine_urls` receive by reference: GPU tensors as CUDA IPC handles, CPU tensors through shared-memory
    files. `broadcast_group` (a `miles.engine.weight_broadcast.WeightBroadcastGroup`) reaches its engines by
    broadcast, each bucket validated by every engine before it is sent. Both can be used in one push; every
    engine receives the same buckets concurrently. `lora=True` pushes PEFT A/B pairs that the engines merge
    with `lora_scaling` (PEFT's alpha / rank). `api_key`: the engines' key (default $MILES_API_KEY). Returns
    {"num_tensors", "num_buckets", "bytes", "buffer_bytes" (the send buffers' total), "seconds",
    "engine_weight_versions" (IPC engines first), "ipc_engines", "broadcast_engines"}. Raises WeightSyncError
    naming the engine on any failure (a failed broadcast also marks the group `broken`). Safe to call from sync
    code, also while an event loop runs in this thread (the push then runs on a helper thread).
    """
    coroutine = push_weights_async(
        engine_urls,
        named_tensors,
        bucket_bytes,
        weight_version,
        lora,
        lora_scaling=lora_scaling,
        target_modules=target_modules,
        timeout=timeout,
        api_key=api_key,
        broadcast_group=broadcast_group,
    )
    return run_sync(coroutine)


# ---------------------------------------------------------------------------------------------------------
# receiver


@contextlib.contextmanager
def _map_shared_memory(ref: SharedMemoryRef, writable: bool = False) -> Iterator[torch.Tensor]:
    """The sender's /dev/shm file as a flat uint8 tensor: a private, copy-on-write view to read, or (`writable`)
    the file itself, for a buffer the other process gave us to fill."""
    if SHM_NAME.fullmatch(ref.name) is None:  # decode_buffer_ref checked it; this is the last line
        raise ProtocolError(f"shm buffer name {ref.name!r} is not a miles bucket")
    try:
        # O_NOFOLLOW: a symlink planted under that name is refused rather than followed
        fd = os.open(os.path.join(SHM_DIR, ref.name), (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW
                     | os.O_CLOEXEC)
    except OSError as err:
        raise ProtocolError(f"shm buffer {ref.name!r} cannot be opened: {err.strerror}") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ProtocolError(f"shm buffer {ref.name!r} is not a regular file owned by this engine's user")
        if info.st_size < ref.size:
            raise ProtocolError(f"shm buffer {ref.name!r} has {info.st_size} bytes, the message claims {ref.size}")
        mapping = mmap.mmap(fd, ref.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    # the mapping is unmapped when the last tensor viewing it is gone (after the copies; see apply)
    yield torch.frombuffer(mapping, dtype=torch.uint8)


@contextlib.contextmanager
def _map_cuda_ipc(ref: CudaIpcRef) -> Iterator[torch.Tensor]:
    """The sender's CUDA allocation as a flat uint8 tensor on its device (fields checked by the decoder)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        ref.device, ref.handle, ref.storage_size, ref.storage_offset, ref.ref_counter_handle, ref.ref_counter_offset,
        ref.event_handle, ref.event_sync_required,
    )
    device = torch.device("cuda", ref.device)
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (ref.storage_size,), (1,))
    try:
        yield flat
    finally:
        # the copies are queued on this process's stream; the sender reuses (or frees) the buffer as soon as
        # we answer, so they must have finished reading it
        torch.cuda.current_stream(device).synchronize()


def map_buffer(ref: SharedMemoryRef | CudaIpcRef, writable: bool = False):
    """A context giving another process's buffer as a flat uint8 tensor (on its GPU for a CUDA IPC handle, where
    the work queued on it has finished when the context exits). `writable`: we fill it (a shared-memory file is
    then mapped shared, not copy-on-write)."""
    return _map_shared_memory(ref, writable) if isinstance(ref, SharedMemoryRef) else _map_cuda_ipc(ref)


@dataclass
class _PendingLora:
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None


@dataclass(frozen=True)
class _FullCopy:
    entry: TensorEntry
    module_name: str
    param_name: str
    target: torch.Tensor


@dataclass(frozen=True)
class _LoraPart:
    entry: TensorEntry
    key: tuple[str, str]  # (module, layer)
    which: str  # "A" or "B"


class WeightReceiver:
    """Engine side: applies buckets to the pipeline's modules; runs on the engine's worker thread."""

    def __init__(self, modules: Mapping[str, nn.Module], on_lora_pair=None):
        """`on_lora_pair(module, layer, lora_a, lora_b, scaling)`: told every merged pair (the engine's
        rollout_gradients keeps the factors)."""
        self.modules = dict(modules)
        self.on_lora_pair = on_lora_pair
        self._tables: dict[str, dict[str, torch.Tensor]] = {}
        self._lora_base: dict[tuple[str, str], torch.Tensor] = {}
        self._staged_base: dict[tuple[str, str], torch.Tensor] = {}  # copies on the device for the next merge
        self._pending_lora: dict[tuple[str, str], _PendingLora] = {}
        self._lora_scaling = 1.0
        self.tensors_received = 0
        self.updates_applied = 0

    def _table(self, module_name: str) -> dict[str, torch.Tensor]:
        # parameters only: what a trainer syncs; buffers (fixed tables, running stats) are not writable remotely
        if module_name not in self._tables:
            self._tables[module_name] = dict(self.modules[module_name].named_parameters())
        return self._tables[module_name]

    def _resolve(self, full_name: str, target_modules: Sequence[str] | None) -> tuple[str, str, torch.Tensor]:
        module_name, _, name = full_name.partition(".")
        if module_name not in self.modules:
            raise ProtocolError(f"weight {full_name!r}: no module {module_name!r} in this engine ({sorted(self.modules)})")
        if target_modules and module_name not in target_modules:
            raise ProtocolError(f"weight {full_name!r} is outside target_modules {list(target_modules)}")
        table = self._table(module_name)
        if name not in table:
            raise ProtocolError(f"weight {full_name!r}: module {module_name!r} has no parameter {name!r}")
        return module_name, name, table[name]

    def plan(self, message: UpdateMessage) -> list[_FullCopy | _LoraPart]:
        """Check every entry against this engine's modules; nothing is read or written (a bad bucket is
        rejected whole)."""
        steps: list[_FullCopy | _LoraPart] = []
        # LoRA ranks seen so far per (module, layer): the halves of a pair may arrive in different buckets
        ranks: dict[tuple[str, str], dict[str, int]] = {
            key: {which: t.shape[0 if which == "A" else 1] for which, t in (("A", p.lora_a), ("B", p.lora_b))
                  if t is not None}
            for key, p in self._pending_lora.items()
        }
        in_bucket: set[tuple[tuple[str, str], str]] = set()
        for entry in message.entries:
            if not message.lora:
                module_name, param_name, target = self._resolve(entry.name, message.target_modules)
                if tuple(target.shape) != entry.shape:
                    raise ProtocolError(f"weight {entry.name!r}: shape {list(entry.shape)} != engine's "
                                        f"{list(target.shape)}")
                steps.append(_FullCopy(entry, module_name, param_name, target))
                continue
            match = _LORA_NAME.match(entry.name)
            if match is None:
                raise ProtocolError(f"LoRA update: {entry.name!r} is not a "
                                    "'<module>.<layer>.lora_A|lora_B[.adapter].weight' name")
            key, which = (match["module"], match["layer"]), match["which"]
            _, _, weight = self._resolve(f"{key[0]}.{key[1]}.weight", message.target_modules)
            if (key, which) in in_bucket:
                raise ProtocolError(f"LoRA update: two lora_{which} tensors for {key[0]}.{key[1]} in one bucket")
            in_bucket.add((key, which))
            if weight.ndim != 2 or len(entry.shape) != 2:
                raise ProtocolError(f"LoRA {entry.name!r}: shape {list(entry.shape)} for weight {list(weight.shape)}; "
                                    "LoRA pairs merge into 2-D weights only")
            rank, matched = (entry.shape[0], entry.shape[1] == weight.shape[1]) if which == "A" else (
                entry.shape[1], entry.shape[0] == weight.shape[0])
            other = ranks.setdefault(key, {}).get("B" if which == "A" else "A")
            if not matched or (other is not None and other != rank):
                raise ProtocolError(f"LoRA {entry.name!r}: shape {list(entry.shape)} does not fit weight "
                                    f"{list(weight.shape)}" + (f" with rank {other}" if other is not None else ""))
            ranks[key][which] = rank
            steps.append(_LoraPart(entry, key, which))
        return steps

    @torch.no_grad()
    def apply(self, message: UpdateMessage, received: torch.Tensor | None = None) -> dict[str, Any]:
        """Apply one bucket message (or the final flush); returns what the engine reports back.

        `received`: the bucket's bytes for a broadcast bucket (the other kinds name memory the engine maps)."""
        steps = self.plan(message)
        if message.flush and self._pending_lora:
            missing = sorted(f"{m}.{layer}" for m, layer in self._pending_lora)
            self._pending_lora.clear()  # the update is broken either way; the next one starts clean
            raise ProtocolError(f"LoRA update ended with unpaired lora_A/lora_B for {missing[:5]}")
        if message.lora:
            self._lora_scaling = message.lora_scaling
        if steps:
            assert message.buffer is not None
            if isinstance(message.buffer, BroadcastRef):
                if received is None or received.numel() < message.buffer.size:
                    raise ProtocolError("a broadcast bucket is applied from the bytes the engine received")
                self._copy(steps, received, message.target_modules)
            else:
                with map_buffer(message.buffer) as flat:
                    self._copy(steps, flat, message.target_modules)
                    del flat  # drop the mapping of the sender's memory before answering
        self.tensors_received += len(steps)
        if message.flush:
            self.updates_applied += 1
            self.drop_staged_lora_bases()  # what this update did not merge
        return {"applied": len(steps)}

    def _copy(self, steps: list[_FullCopy | _LoraPart], flat: torch.Tensor, target_modules) -> None:
        for step in steps:
            entry = step.entry
            view = flat[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            if isinstance(step, _FullCopy):
                step.target.copy_(view)
                # the pushed weight is the new base for later LoRA merges
                self._lora_base.pop((step.module_name, step.param_name), None)
                self._staged_base.pop((step.module_name, step.param_name), None)
            else:
                self._receive_lora(step, view, target_modules)

    def _receive_lora(self, step: _LoraPart, view: torch.Tensor, target_modules) -> None:
        pending = self._pending_lora.setdefault(step.key, _PendingLora())
        # the view aliases the sender's buffer, which the next bucket overwrites: keep a copy until paired
        if step.which == "A":
            pending.lora_a = view.clone()
        else:
            pending.lora_b = view.clone()
        if pending.lora_a is not None and pending.lora_b is not None:
            del self._pending_lora[step.key]
            self._merge_lora(step.key, pending.lora_a, pending.lora_b, target_modules)

    def stage_lora_bases(self) -> None:
        """Copy every kept LoRA base to its weight's device ahead of the next merge (queued on the current
        stream): after a rollout's last wave, while its results are scored, so that the merge of the coming
        weights reads the device instead of the host link (0.9 GB at SD3.5-Medium: ≈ 0.05 s on an H100). The
        merge takes each copy; `drop_staged_lora_bases` frees what no merge took."""
        for (module_name, param_name), base in self._lora_base.items():
            device = self._table(module_name)[param_name].device
            self._staged_base[(module_name, param_name)] = base.to(device, non_blocking=True)

    def drop_staged_lora_bases(self) -> None:
        self._staged_base.clear()

    @torch.no_grad()
    def merge_adapter(self, module_name: str, layer: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """One layer's new factors merged as a pushed pair of them would be: the engine's own optimizer step
        (miles/engine/adapter_step.py), at the scaling of the last LoRA push."""
        self._merge_lora((module_name, layer), lora_a, lora_b, None)

    def _merge_lora(self, key: tuple[str, str], lora_a: torch.Tensor, lora_b: torch.Tensor, target_modules) -> None:
        module_name, layer = key
        _, param_name, weight = self._resolve(f"{module_name}.{layer}.weight", target_modules)
        base_key = (module_name, param_name)
        if base_key not in self._lora_base:
            # in host memory (pinned on a GPU engine): 0.9 GB at SD3.5-Medium's 191 LoRA layers in bf16 that
            # would sit beside the model; each update reads it back, a few tens of milliseconds over PCIe
            self._lora_base[base_key] = host_copy(weight.detach())
        base = self._staged_base.pop(base_key, None)
        if base is None:
            base = self._lora_base[base_key].to(weight.device, non_blocking=True)
        weight.copy_(merge_lora_weight(base, lora_a, lora_b, self._lora_scaling))
        if self.on_lora_pair is not None:
            self.on_lora_pair(module_name, layer, lora_a, lora_b, self._lora_scaling)


def merge_lora_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W = W_base + scaling · B @ A` in fp32, cast to W_base's dtype (the engine's merge, exactly)."""
    delta = lora_b.to(device=base.device, dtype=torch.float32) @ lora_a.to(device=base.device, dtype=torch.float32)
    return (base.to(torch.float32) + scaling * delta).to(base.dtype)
