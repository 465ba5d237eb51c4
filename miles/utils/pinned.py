"""Tensors parked in host memory and brought back at PCIe speed: one pinned buffer per tensor, allocated once.

A copy between the GPU and pageable host memory runs at a few GB/s (the driver stages it through a pinned bounce
buffer); into pinned memory it runs at the link's speed, 54.5 GB/s on an H100 (bench/bench_optimizer_parking.py).
Pinning itself is slow, ≈ 2 GB/s, so each buffer is allocated once and reused by every later parking, and
`reserve_in_background` can allocate them where nothing waits (seconds for a model's weights): the trainer's parked
optimizer moments (miles/backends/fsdp_utils/optimizer_parking.py) and a colocated engine's weights while the trainer
trains (miles/engine/model_runner.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch
from torch import nn


class PinnedBuffers:
    """One host buffer per key (pinned when `pin`), reused while the tensor parked under that key keeps its shape
    and dtype."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    def reserve(self, key: Hashable, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The buffer of `key` for a tensor of `shape` and `dtype`, allocated unless it is there."""
        host = self._buffers.get(key)
        if host is None or host.shape != shape or host.dtype != dtype:
            host = self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        return host

    def reserve_in_background(self, layouts: dict[Hashable, tuple[torch.Size, torch.dtype]],
                              device: torch.device) -> None:
        """`reserve` every (shape, dtype) of `layouts` on a thread of its own; every later call waits for it, and
        `wait` raises what the thread raised."""
        self.wait()
        if device.type == "cuda" and device.index is None:
            # a new thread starts on device 0: pinning there would make a context on another rank's GPU
            device = torch.device("cuda", torch.cuda.current_device())

        def reserve_all() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                for key, (shape, dtype) in layouts.items():
                    self.reserve(key, shape, dtype)
            except BaseException as error:  # raised again by `wait` in the caller's thread
                self._reserve_error = error

        self._reserving = threading.Thread(target=reserve_all, name="pinned-buffers", daemon=True)
        self._reserving.start()

    def wait(self) -> None:
        """Until `reserve_in_background` is done; raises what it raised (as `reserve` in this thread would have)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        error, self._reserve_error = self._reserve_error, None
        if error is not None:
            raise RuntimeError(f"pinning host buffers in the background failed: {error}") from error

    def to_host(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into the buffer of `key`, asynchronously (in stream order: work queued after the copy
        may reuse `tensor`'s memory, and a copy back queued later reads the landed values)."""
        self.wait()
        host = self.reserve(key, tensor.shape, tensor.dtype)
        host.copy_(tensor, non_blocking=True)
        return host

    @property
    def nbytes(self) -> int:
        self.wait()
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def replace_module_tensors(module: nn.Module, replace: Callable[[str, torch.Tensor], torch.Tensor | None]) -> None:
    """Every parameter (and its gradient) and buffer of `module`, each once, handed to `replace(qualified name,
    tensor)`; a returned tensor takes its place in place (a parameter keeps its identity, as `Module.to` keeps it),
    None leaves it."""
    seen: set[int] = set()  # parameters: one object wherever it is registered, so changed once
    # a buffer registered twice gets the same replacement (the original kept alive here, so its id stays its own)
    moved_buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for owner_name, owner in module.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        for attr, param in owner._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            new = replace(prefix + attr, param.data)
            if new is not None:
                param.data = new
            if param.grad is not None:
                new = replace(f"{prefix}{attr}.grad", param.grad)
                if new is not None:
                    param.grad = new
        for attr, buffer in owner._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in moved_buffers:
                moved_buffers[id(buffer)] = (buffer, replace(prefix + attr, buffer))
            new = moved_buffers[id(buffer)][1]
            if new is not None:
                owner._buffers[attr] = new
