"""The optimizer state waits on the host through the forwards and backwards when the GPU cannot hold it beside
their peak.

AdamW creates its two moments in the first optimizer step, after that step's forwards and backwards reached their
peak. So a first training fits where every later one, which carries the moments through the same peak, may not: a
full fine-tune at SD3.5-Medium size peaked at 61.5 GiB in its first iteration on one H100 and needed 16.7 GiB more
in its second, past the device's 79 GiB (bench/RESULTS.md, twenty-first session), while the plain loop, which also
carries them, just fits in one process.

After its first training the trainer projects its next peak (the first one plus the moments). Where that would
leave less than `--colocate-memory-margin-gb` of what it could use when the first training began, it parks the
moments in host memory before each window's forwards and brings them back for the optimizer step. The copies are
stream-ordered and asynchronous (the host side comes from PyTorch's pinned-memory cache): two copies of the moments
per optimizer step over PCIe, against not training at all. Between trainings the moments stay on the GPU, so
checkpoints, exports and the colocation turns see them where they always were.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """(state, key, tensor) for every state tensor but the step counters (AdamW's moments)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                yield state, key, value


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Every state tensor but the step counters to `device`, asynchronously where the copy allows it (a copy to
    the host lands in pinned memory)."""
    for state, key, value in list(_state_tensors(optimizer)):
        state[key] = value.to(device, non_blocking=True)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """Bytes of optimizer state this rank holds on devices of `device_type` (its shard of each DTensor)."""
    total = 0
    for _, _, value in _state_tensors(optimizer):
        if value.device.type == device_type:
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


@dataclass(frozen=True)
class RoomAtStart:
    """What this process could use when its first training began: the device's free memory and what its own
    caching allocator held; and the optimizer state it held then (a resumed run's moments), all in bytes."""

    free: int
    reserved: int
    state: int = 0


def next_peak_leaves(room: RoomAtStart, first_peak: int, created_bytes: int) -> int:
    """Bytes left free at the next training's peak, which carries the moments the first one created."""
    return room.free + room.reserved - (first_peak + created_bytes)


class OptimizerParking:
    """Decides once, after the first training, whether the moments wait on the host during forwards and backwards;
    then `park` before a window's forwards and `unpark` before its optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, margin_bytes: int):
        self.optimizer = optimizer
        self.device = device
        self.margin_bytes = margin_bytes
        self.enabled = False
        self.decided = False
        self.room: RoomAtStart | None = None
        self.created = 0  # bytes of optimizer state the first training created

    @property
    def next_peak_extra(self) -> int:
        """Bytes the next training's peak adds to the first one's: the moments it carries through it, unless
        they are parked (0 before the decision: nothing measured yet)."""
        return self.created if self.decided and not self.enabled else 0

    def before_first_training(self) -> None:
        if self.device.type != "cuda" or self.decided or self.room is not None:  # measured on GPUs only
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        self.room = RoomAtStart(free=int(free), reserved=int(torch.cuda.memory_reserved(self.device)),
                                state=optimizer_state_bytes(self.optimizer, self.device.type))

    def after_first_training(self) -> None:
        """Decide from the first training's peak and the moments its step created."""
        if self.decided or self.room is None:
            return
        self.decide(self.room, int(torch.cuda.max_memory_reserved(self.device)),
                    optimizer_state_bytes(self.optimizer, self.device.type))

    def decide(self, room: RoomAtStart, first_peak: int, state_bytes: int) -> None:
        """Park from now on when the next peak would leave less than the margin of `room`. `state_bytes`: the
        optimizer state held now, after the first training."""
        if state_bytes == 0:  # no step was taken (skipped, or nothing to train on): decide after the next
            self.room = None
            return
        self.decided = True
        created = self.created = max(0, state_bytes - room.state)
        left = next_peak_leaves(room, first_peak, created)
        self.enabled = left < self.margin_bytes
        if self.enabled:
            logger.info(
                "trainer: the next training's peak (the first's %.1f GiB + %.1f GiB of optimizer state) would leave "
                "%.1f GiB free (--colocate-memory-margin-gb %.1f): the optimizer state waits on the host through "
                "each window's forwards and backwards and comes back for its step",
                first_peak / GIB, created / GIB, left / GIB, self.margin_bytes / GIB)

    def park(self) -> int:
        """Moments to the host; returns the bytes moved (0 when parking is off or there is no state yet)."""
        if not self.enabled:
            return 0
        moved = optimizer_state_bytes(self.optimizer, self.device.type)
        move_optimizer_state(self.optimizer, "cpu")
        return moved

    def unpark(self) -> None:
        if self.enabled:
            move_optimizer_state(self.optimizer, self.device)
