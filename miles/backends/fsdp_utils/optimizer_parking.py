"""The optimizer state waits on the host through the forwards and backwards when the GPU cannot hold it beside
their peak.

AdamW creates its two moments in the first optimizer step, after that step's forwards and backwards reached their
peak. So a first training fits where every later one, which carries the moments through the same peak, may not: a
full fine-tune at SD3.5-Medium size peaked at 61.5 GiB in its first iteration on one H100 and needed 16.7 GiB more
in its second, past the device's 79 GiB (bench/RESULTS.md, twenty-first session), while the plain loop, which also
carries them, just fits in one process.

After its first training the trainer projects its next peak (the first one plus the moments). Where that would
leave less than `--colocate-memory-margin-gb` of what it could use when the first training began, it parks the
largest moments, just enough of them to leave the margin, in host memory through each window's forwards and
backwards, and brings them back for the optimizer step. Each parked moment has one pinned host buffer, allocated
once and reused (miles/utils/pinned.py); both copies then run at PCIe speed (0.3 s each way for 15 GiB on an
H100). Pinning runs at ≈ 2 GB/s, so the buffers are allocated by a background thread as soon as the moments are
chosen, while the run syncs weights and rolls out, instead of in the next training's first parking: on an H100
the first training that parked 7 GiB ran 4.7 s longer than the next, ≈ 3.5 s of it this pinning at that rate
(bench/RESULTS.md, twenty-fourth session). Between trainings the moments stay on the GPU, so checkpoints,
exports and the colocation turns see them where they always were.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from miles.utils.pinned import PinnedBuffers

logger = logging.getLogger(__name__)

GIB = 1 << 30


def moments(optimizer: torch.optim.Optimizer) -> Iterator[tuple[tuple[int, str], dict, torch.Tensor]]:
    """(key, the state dict holding it, tensor) for every state tensor but the step counters (AdamW's moments).
    The key, (its parameter's index in the optimizer's groups, its state key), is stable across steps."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        state = optimizer.state.get(param, {})
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and name != "step":
                yield (index, name), state, value


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """Bytes of optimizer state this rank holds on devices of `device_type` (its shard of each DTensor)."""
    return sum(_nbytes(value) for _, _, value in moments(optimizer) if value.device.type == device_type)


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


def choose_parked(sizes: dict[tuple[int, str], int], shortfall: int) -> list[tuple[int, str]]:
    """The largest state tensors (by `sizes`, bytes keyed by (param index, state key)) whose bytes reach
    `shortfall`: the fewest copies that leave the margin."""
    chosen, total = [], 0
    for key, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        if total >= shortfall:
            break
        chosen.append(key)
        total += size
    return chosen


class OptimizerParking:
    """Decides once, after the first training, which moments wait on the host during forwards and backwards;
    then `park` before a window's forwards and `unpark` before its optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, margin_bytes: int):
        self.optimizer = optimizer
        self.device = device
        self.margin_bytes = margin_bytes
        self.decided = False
        self.room: RoomAtStart | None = None
        self.created = 0  # bytes of optimizer state the first training created
        self.state_bytes = 0  # bytes of optimizer state on the device after it
        self.chosen: frozenset[tuple[int, str]] = frozenset()  # (param index, state key) of the parked moments
        self.chosen_bytes = 0
        self._host = PinnedBuffers(pin=device.type == "cuda")  # one buffer per parked moment, pinned once

    @property
    def enabled(self) -> bool:
        return bool(self.chosen)

    @property
    def next_peak_extra(self) -> int:
        """Bytes the next training's peak adds to the first one's: the moments the first step created, less the
        parked ones (negative when a resumed run parks moments its first peak carried; 0 before the decision:
        nothing measured yet)."""
        return self.created - self.chosen_bytes if self.decided else 0

    @property
    def parkable(self) -> int:
        """Bytes of that next peak parking every moment would shed."""
        return self.state_bytes - self.chosen_bytes if self.decided else 0

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
        """Park from now on the fewest moments that leave the margin of `room` at the next peak. `state_bytes`:
        the optimizer state held now, after the first training."""
        if state_bytes == 0:  # no step was taken (skipped, or nothing to train on): decide after the next
            self.room = None
            return
        self.decided = True
        self.state_bytes = state_bytes
        created = self.created = max(0, state_bytes - room.state)
        left = next_peak_leaves(room, first_peak, created)
        if left >= self.margin_bytes:
            return
        self._choose(self.margin_bytes - left, "the next training's peak (the first's %.1f GiB + %.1f GiB of "
                     "optimizer state) would leave %.1f GiB free (--colocate-memory-margin-gb %.1f)"
                     % (first_peak / GIB, created / GIB, left / GIB, self.margin_bytes / GIB))

    def park_more(self, more_bytes: int) -> None:
        """Park at least `more_bytes` beyond what is parked now (the colocation policy's ask, so that the engines
        stay resident beside the trainer)."""
        if more_bytes > 0 and self.decided:
            self._choose(self.chosen_bytes + more_bytes, "the engines stay resident beside it")

    def _choose(self, shortfall: int, why: str) -> None:
        # the largest first: a larger shortfall parks a superset of a smaller one's moments
        sizes = {key: _nbytes(value) for key, _, value in moments(self.optimizer)}
        self.chosen = frozenset(choose_parked(sizes, shortfall))
        self.chosen_bytes = sum(sizes[key] for key in self.chosen)
        logger.info("trainer: %s: %.1f GiB of the optimizer state (%d of its %d tensors) waits on the host through "
                    "each window's forwards and backwards and comes back for its step",
                    why, self.chosen_bytes / GIB, len(self.chosen), len(sizes))
        # pinned while the run syncs and rolls out, not in the next training's first parking
        self._host.reserve_in_background({key: (_local(value).shape, _local(value).dtype)
                                          for key, _, value in moments(self.optimizer) if key in self.chosen},
                                         self.device)

    def park(self) -> int:
        """The chosen moments to their host buffers; returns the bytes moved (0 when parking is off).

        The copies run on the current stream, before the forwards: on a side stream beside them, the first
        micro-batch's activations took fresh memory while the moments still held theirs, and a full fine-tune
        whose margin this parking had just made ran out of memory on an H100 (bench/RESULTS.md, twenty-second
        session)."""
        if not self.enabled:
            return 0
        moved = 0
        for key, state, value in moments(self.optimizer):
            local = _local(value)
            if key not in self.chosen or local.device.type == "cpu":  # an offload left it on the host
                continue
            state[key[1]] = _rewrap(value, self._host.to_host(key, local))
            moved += _nbytes(local)
        return moved

    def unpark(self) -> None:
        """The chosen moments back to the device, before the step (which reads them)."""
        if not self.enabled:
            return
        for key, state, value in moments(self.optimizer):
            if key in self.chosen:
                state[key[1]] = _rewrap(value, _local(value).to(self.device, non_blocking=True))

    def state_to(self, device: torch.device | str) -> None:
        """A colocation turn's move of the optimizer state: all of it to the host, or all of it back to the
        device but the parked moments (they return only for the step)."""
        to_host = torch.device(device).type == "cpu"
        for key, state, value in moments(self.optimizer):
            if to_host or key not in self.chosen:
                state[key[1]] = value.to(device, non_blocking=True)


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of `value` (its shard of a DTensor)."""
    return value.to_local() if hasattr(value, "to_local") else value


def _nbytes(value: torch.Tensor) -> int:
    local = _local(value)
    return local.numel() * local.element_size()


def _rewrap(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in the place of `value`'s local tensor (a DTensor keeps its mesh, placements and global shape)."""
    if not hasattr(value, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())
