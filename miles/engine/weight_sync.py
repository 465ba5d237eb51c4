"""Weight sync from a trainer process into running engines (`POST /update_weights_from_tensor`).

Sender (`push_weights`, called in the trainer process): named tensors are packed into one flat byte buffer per
bucket of at most `bucket_bytes`; the buffer travels as a *handle*, never as bytes: a CUDA IPC handle when it
lives on a GPU, a shared-memory file handle when it lives on the CPU (both made by
`torch.multiprocessing.reductions.reduce_tensor`, pickled with the multiprocessing `ForkingPickler`, with the
`file_system` sharing strategy in both processes, docs/design.md §6). The control message (names, dtypes, shapes,
byte offsets) is msgpack. The sender keeps the buffer alive until every engine answered, and an engine answers
only after it copied the bucket into its parameters, so the receiver never reads freed memory. Two buffers
alternate: the next bucket is packed while the engines copy the previous one.

Names are `<module>.<parameter name>` (e.g. `transformer.transformer_blocks.0.attn.to_q.weight`), where
`<module>` is a pipeline component (`--update-weight-target-module`).

LoRA (`lora=True`, `--lora-ipc-weight-sync`): the tensors are PEFT A/B pairs
(`<module>.[base_model.model.]<layer>.lora_A[.<adapter>].weight` and the matching `lora_B`); the engine merges
`W = W_base + scaling · B @ A` (in fp32, cast to W's dtype). The engine keeps the unmerged `W_base` of every
merged layer, so the next LoRA update replaces the previous delta instead of adding to it. A full-weight update
of a layer makes the pushed weight its new base.

The receiving side is `WeightReceiver`; `module_checksums` / `named_tensor_checksums` give the same digest on
both sides, so tests can prove the engine holds exactly the trainer's weights (`GET /weights_checksum`).

The handles are pickles: an engine must only listen on an address the trainer side trusts (127.0.0.1 by
default).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import pickle
import re
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.multiprocessing
from torch import nn

from miles.engine.protocol import ProtocolError, packb, unpackb
from miles.utils.async_utils import run_sync

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every tensor starts at a multiple of this inside a bucket (any dtype can view it)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_LORA_NAME = re.compile(
    r"^(?P<module>[^.]+)\.(?:base_model\.model\.)?(?P<layer>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$"
)


def use_file_system_sharing() -> None:
    """Shared-memory tensors between unrelated processes need this strategy on both sides (docs/design.md §6)."""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------------------
# checksums


def _digest_tensor(hasher: Any, name: str, tensor: torch.Tensor) -> None:
    host = tensor.detach().to("cpu").contiguous()
    hasher.update(f"{name}|{_DTYPE_NAMES.get(host.dtype, str(host.dtype))}|{list(host.shape)}|".encode())
    if host.numel():
        hasher.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())


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


class _BucketBuffer:
    """A reusable flat byte buffer on one device, shareable with other processes."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            self.buffer.share_memory_()

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
        entries = []
        offset = 0
        for name, tensor in tensors:
            nbytes = _nbytes(tensor)
            if tensor.dtype not in _DTYPE_NAMES:
                raise TypeError(f"weight {name!r} has dtype {tensor.dtype}, which weight sync does not carry")
            target = self.buffer[offset : offset + nbytes].view(tensor.dtype)
            target.copy_(tensor.detach().reshape(-1), non_blocking=True)
            entries.append([name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape), offset])
            offset = _align(offset + nbytes)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the receiver reads on its own stream
        return entries

    def handle(self) -> bytes:
        """A fresh pickled handle: one per receiving engine and bucket (CUDA IPC counts its consumers)."""
        stream = io.BytesIO()
        ForkingPickler(stream, pickle.HIGHEST_PROTOCOL).dump(self.buffer)
        return stream.getvalue()


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _align(_nbytes(tensor))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, size
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, size


class WeightSyncError(RuntimeError):
    """An engine rejected or failed a weight update; the message names the engine and its reason."""


async def _post_bucket(session, url: str, body: bytes, timeout: float) -> dict:
    import aiohttp

    try:
        async with session.post(
            f"{url}/update_weights_from_tensor",
            data=body,
            headers={"Content-Type": "application/x-msgpack"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            payload = await response.json(content_type=None)
            if response.status != 200:
                raise WeightSyncError(f"engine {url} rejected the weight update: {payload.get('error', payload)}")
            return payload
    except aiohttp.ClientError as err:
        raise WeightSyncError(f"engine {url} unreachable during weight update: {err}") from err


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
) -> dict[str, Any]:
    """See `push_weights`."""
    import aiohttp

    use_file_system_sharing()
    began = time.perf_counter()
    stats = {"num_tensors": 0, "num_buckets": 0, "bytes": 0}
    buffers: dict[tuple[torch.device, int], _BucketBuffer] = {}
    in_flight: asyncio.Future | None = None
    in_flight_slot: int | None = None

    def buffer_for(device: torch.device, size: int, slot: int) -> _BucketBuffer:
        key = (device, slot)
        current = buffers.get(key)
        if current is None or current.capacity < size:
            current = _BucketBuffer(max(size, bucket_bytes), device)
            buffers[key] = current
        return current

    async def send(bodies: Sequence[bytes]) -> list[dict]:
        return await asyncio.gather(
            *(_post_bucket(session, url, body, timeout) for url, body in zip(engine_urls, bodies))
        )

    base = {
        "weight_version": int(weight_version),
        "lora": bool(lora),
        "lora_scaling": float(lora_scaling),
        "target_modules": list(target_modules) if target_modules else None,
    }
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        slot = 0
        for bucket, size in _buckets(named_tensors, bucket_bytes):
            devices = {tensor.device for _, tensor in bucket}
            if len(devices) != 1:  # one buffer per bucket: split a mixed bucket by device
                raise ValueError(f"a weight bucket mixes devices {devices}; put all synced tensors on one device")
            if in_flight is not None and in_flight_slot == slot:
                await in_flight  # this slot's buffer is still being read by the engines
                in_flight = None
            buffer = buffer_for(devices.pop(), size, slot)
            entries = buffer.pack(bucket)
            bodies = [
                packb({**base, "flush": False, "handle": buffer.handle(), "entries": entries}) for _ in engine_urls
            ]
            if in_flight is not None:
                await in_flight
            in_flight = asyncio.ensure_future(send(bodies))
            in_flight_slot = slot
            slot = 1 - slot
            stats["num_tensors"] += len(bucket)
            stats["num_buckets"] += 1
            stats["bytes"] += sum(_nbytes(t) for _, t in bucket)
        if in_flight is not None:
            await in_flight
        # the flush message commits the version (and checks that every LoRA pair arrived)
        flush = packb({**base, "flush": True, "handle": None, "entries": []})
        answers = await send([flush] * len(engine_urls))
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
) -> dict[str, Any]:
    """Push `named_tensors` (`<module>.<param>` names) to every engine, in buckets of at most `bucket_bytes`.

    GPU tensors travel as CUDA IPC handles, CPU tensors as shared-memory handles; every engine receives the
    same handles concurrently. `lora=True` pushes PEFT A/B pairs that the engines merge with `lora_scaling`
    (PEFT's alpha / rank). Returns {"num_tensors", "num_buckets", "bytes", "seconds", "engine_weight_versions"}.
    Raises WeightSyncError naming the engine on any failure. Safe to call from sync code, also while an event
    loop runs in this thread (the push then runs on a helper thread).
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
    )
    return run_sync(coroutine)


# ---------------------------------------------------------------------------------------------------------
# receiver


@dataclass
class _PendingLora:
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None


class WeightReceiver:
    """Engine side: applies buckets to the pipeline's modules; runs on the engine's worker thread."""

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = dict(modules)
        self._tables: dict[str, dict[str, torch.Tensor]] = {}
        self._lora_base: dict[tuple[str, str], torch.Tensor] = {}
        self._pending_lora: dict[tuple[str, str], _PendingLora] = {}
        self._lora_scaling = 1.0
        self.tensors_received = 0
        self.updates_applied = 0
        use_file_system_sharing()

    def _table(self, module_name: str) -> dict[str, torch.Tensor]:
        if module_name not in self._tables:
            module = self.modules[module_name]
            table = {name: p for name, p in module.named_parameters()}
            table.update({name: b for name, b in module.named_buffers()})
            self._tables[module_name] = table
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

    @torch.no_grad()
    def apply(self, message: dict) -> dict[str, Any]:
        """Apply one bucket message (or the final flush); returns what the engine reports back."""
        lora = bool(message.get("lora"))
        target_modules = message.get("target_modules")
        if lora:
            self._lora_scaling = float(message.get("lora_scaling", 1.0))
        applied = 0
        if message.get("handle") is not None:
            flat = pickle.loads(message["handle"])
            try:
                for name, dtype_name, shape, offset in message["entries"]:
                    if dtype_name not in _DTYPES:
                        raise ProtocolError(f"weight {name!r}: unsupported dtype {dtype_name!r}")
                    dtype = _DTYPES[dtype_name]
                    numel = 1
                    for dim in shape:
                        numel *= dim
                    nbytes = numel * torch.empty((), dtype=dtype).element_size()
                    view = flat[offset : offset + nbytes].view(dtype).view(shape)
                    if lora:
                        self._receive_lora(name, view, target_modules)
                    else:
                        self._receive_full(name, view, target_modules)
                    applied += 1
            finally:
                if flat.is_cuda:
                    # the copies above are queued on this process's stream; the sender reuses (or frees) the
                    # buffer as soon as we answer, so they must have finished reading it
                    torch.cuda.current_stream(flat.device).synchronize()
                del flat  # drop the mapping of the sender's memory before answering
        self.tensors_received += applied
        if message.get("flush"):
            if self._pending_lora:
                missing = sorted(f"{m}.{layer}" for m, layer in self._pending_lora)
                self._pending_lora.clear()
                raise ProtocolError(f"LoRA update ended with unpaired lora_A/lora_B for {missing[:5]}")
            self.updates_applied += 1
        return {"applied": applied}

    def _receive_full(self, name: str, view: torch.Tensor, target_modules) -> None:
        module_name, param_name, target = self._resolve(name, target_modules)
        if tuple(target.shape) != tuple(view.shape):
            raise ProtocolError(f"weight {name!r}: shape {list(view.shape)} != engine's {list(target.shape)}")
        target.copy_(view)
        # the pushed weight is the new base for later LoRA merges
        self._lora_base.pop((module_name, param_name), None)

    def _receive_lora(self, name: str, view: torch.Tensor, target_modules) -> None:
        match = _LORA_NAME.match(name)
        if match is None:
            raise ProtocolError(f"LoRA update: {name!r} is not a '<module>.<layer>.lora_A|lora_B[.adapter].weight' name")
        key = (match["module"], match["layer"])
        pending = self._pending_lora.setdefault(key, _PendingLora())
        # the view aliases the sender's buffer, which the next bucket overwrites: keep a copy until paired
        if match["which"] == "A":
            pending.lora_a = view.clone()
        else:
            pending.lora_b = view.clone()
        if pending.lora_a is not None and pending.lora_b is not None:
            del self._pending_lora[key]
            self._merge_lora(key, pending.lora_a, pending.lora_b, target_modules)

    def _merge_lora(self, key: tuple[str, str], lora_a: torch.Tensor, lora_b: torch.Tensor, target_modules) -> None:
        module_name, layer = key
        _, param_name, weight = self._resolve(f"{module_name}.{layer}.weight", target_modules)
        if weight.ndim != 2 or lora_b.shape[0] != weight.shape[0] or lora_a.shape[1] != weight.shape[1]:
            raise ProtocolError(
                f"LoRA pair for {module_name}.{layer}: B{list(lora_b.shape)} @ A{list(lora_a.shape)} does not match "
                f"weight {list(weight.shape)}"
            )
        base_key = (module_name, param_name)
        if base_key not in self._lora_base:
            self._lora_base[base_key] = weight.detach().clone()
        base = self._lora_base[base_key]
        weight.copy_(merge_lora_weight(base, lora_a, lora_b, self._lora_scaling))


def merge_lora_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W = W_base + scaling · B @ A` in fp32, cast to W_base's dtype (the engine's merge, exactly)."""
    delta = lora_b.to(device=base.device, dtype=torch.float32) @ lora_a.to(device=base.device, dtype=torch.float32)
    return (base.to(torch.float32) + scaling * delta).to(base.dtype)


def decode_update_message(body: bytes) -> dict:
    message = unpackb(body)
    if not isinstance(message, dict) or "entries" not in message or "weight_version" not in message:
        raise ProtocolError("update_weights_from_tensor body must be a map with 'entries' and 'weight_version'")
    return message
