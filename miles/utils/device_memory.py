"""One process's view of its GPU's memory, as the colocation policy (miles/ray/colocation.py) reads it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
