"""One process's view of its GPU's memory: what the colocation policy (miles/ray/colocation.py) reads, and the
caching allocator's counts a train step reports (`perf/train_cuda_mallocs`, `perf/train_alloc_retries`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes: free on the whole device now, its total, and this process's caching allocator now and at peak
    (reserved: what the allocator holds from the device; allocated: what live tensors use of it). A trainer's
    `parkable`: how much of that peak parking more of its optimizer state on the host would shed
    (miles/backends/fsdp_utils/optimizer_parking.py)."""

    free: int
    total: int
    reserved: int
    peak_reserved: int
    peak_allocated: int = 0
    parkable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def current_device_memory() -> DeviceMemory | None:
    """This process's GPU memory, None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return DeviceMemory(
        free=int(free),
        total=int(total),
        reserved=int(torch.cuda.memory_reserved()),
        peak_reserved=int(torch.cuda.max_memory_reserved()),
        peak_allocated=int(torch.cuda.max_memory_allocated()),
    )


def peak_memory_metrics(prefix: str, readings: list[DeviceMemory]) -> dict[str, float]:
    """`<prefix>_peak_reserved_gib` / `<prefix>_peak_allocated_gib`: the largest process peak among `readings`
    since that process started (empty without readings, i.e. off CUDA). Beside a device-wide peak they say
    which process holds the memory and how much of it the allocator keeps but no tensor uses."""
    if not readings:
        return {}
    return {f"{prefix}_peak_reserved_gib": max(r.peak_reserved for r in readings) / 2**30,
            f"{prefix}_peak_allocated_gib": max(r.peak_allocated for r in readings) / 2**30}


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's running counts: `cuda_mallocs` (device allocations; a warm cache makes none,
    and each one may synchronise the device) and `alloc_retries` (allocations that freed the cache and retried:
    memory pressure). Empty off CUDA."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory, pinned when it comes from a GPU (so copying it back is asynchronous):
    where the engine keeps what it only needs between steps, not beside the model."""
    import torch

    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host
