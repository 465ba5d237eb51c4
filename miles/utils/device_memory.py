"""One process's view of its GPU's memory: what the colocation policy (miles/ray/colocation.py) reads, and the
caching allocator's counts a train step reports (`perf/train_cuda_mallocs`, `perf/train_alloc_retries`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes: free on the whole device now, its total, and this process's caching allocator now and at peak."""

    free: int
    total: int
    reserved: int
    peak_reserved: int

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
    )


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's running counts: `cuda_mallocs` (device allocations; a warm cache makes none,
    and each one may synchronise the device) and `alloc_retries` (allocations that freed the cache and retried:
    memory pressure). Empty off CUDA."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}
