"""A finished request's results on their way to the host, without holding the engine's worker thread.

`ModelRunner.finish_async` queues the VAE decode and a copy to the host of everything the response carries, then
returns a `PendingResponse` at once; the scheduler builds the response (`PendingResponse.result`) on a thread of
its own once the copies have landed. The worker meanwhile admits the next requests and queues their steps, so the
device is not left idle while the host packs a finished request's results, as it was at the end of every wave of a
rollout-gradient rollout (miles/engine/scheduler.py).

On a CPU engine every copy is the tensor itself and nothing waits: the same code, synchronous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from miles.engine.protocol import GenerateResponse


class HostCopies:
    """Device→host copies queued on the current stream into pinned memory, and the event that says they landed.

    A copy's host tensor may be read only after `wait()`; the device tensor may be freed at once (the caching
    allocator hands its memory only to work queued after the copy on the same stream)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._landed: torch.cuda.Event | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def mark(self) -> None:
        """After the last copy: record the event `wait` waits for."""
        if self.cuda:
            self._landed = torch.cuda.Event()
            self._landed.record()

    def wait(self) -> None:
        if self._landed is not None:
            self._landed.synchronize()


class DeviceTimer:
    """Seconds of the work queued between `start` and `stop`: CUDA events on a GPU (read after that work ran,
    `seconds`), the wall clock on a CPU, where the work has run when `stop` returns."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._began = self._ended = 0.0

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        self._began = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._ended = time.perf_counter()

    def seconds(self) -> float:
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000.0  # waits for the stop event
        return self._ended - self._began


@dataclass
class PendingResponse:
    """A finished trajectory whose results are being copied to the host: `result()` waits for the copies and packs
    the response (`pack`, reading only host tensors), its timings completed with the decode's device seconds and
    the packing's own."""

    pack: Callable[[], GenerateResponse]
    copies: HostCopies
    decode: DeviceTimer
    started_at: float  # the trajectory's start (perf_counter): the response's `total` runs from it
    timings: dict[str, float] = field(default_factory=dict)  # measured on the worker (start, denoise, compile)

    def result(self) -> GenerateResponse:
        self.copies.wait()
        began = time.perf_counter()
        response = self.pack()
        response.timings.update(self.timings)
        response.timings["decode"] = self.decode.seconds()
        response.timings["pack"] = time.perf_counter() - began
        response.timings["total"] = time.perf_counter() - self.started_at
        return response
