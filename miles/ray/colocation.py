"""Colocated runs: whether the trainer and the engines must take turns on the GPUs, decided from measurements.

Under `--colocate` the trainer offloads while the engines generate and the engines release their memory while
the trainer trains (`--offload-train`, `--offload-rollout`). Each turn moves every weight, optimizer state and
text encoder over PCIe: ~7 s per iteration at SD3.5-Medium size on an H200, for memory that is often not
needed, since both sides together fit on a 141 GB device.

`--colocate-offload-policy auto` (the default) keeps the turns only while they are needed. The first iteration
always takes turns (the safe order) and measures on every GPU what each side holds at rest and at its peak (the
trainer's in training, the engine's in generation). Then, from cheapest to dearest:
- both stay resident when both peaks fit together, with `--colocate-memory-margin-gb` to spare;
- else the trainer stays and only the engines release (their weights, a few GB) while it trains, when the
  engine's peak fits beside the trainer at rest: the trainer empties its allocator cache (its activations)
  before the engines resume, and never moves its weights and optimizer state over PCIe. A full fine-tune whose
  training peak fills the GPU is this case (one H100 at SD3.5-Medium size, bench/RESULTS.md, nineteenth session);
- else both stay resident when they fit once the trainer parks more of its optimizer state on the host during
  trainings (miles/backends/fsdp_utils/optimizer_parking.py): one copy of the parked bytes each way per optimizer
  step (0.3 s per 15 GiB each way on an H100);
- else both keep taking turns.
`park` puts the parking before the engines' release: one more copy each way per optimizer step against a release and
resume (0.34 s per iteration on an H100 with pinned buffers) and a refilled trainer cache; not yet measured against
it (bench/RESULTS.md, twenty-third session), hence not the default.
`always` takes turns at every iteration (the reference's behaviour).
"""

from __future__ import annotations

import logging

from miles.utils.device_memory import DeviceMemory

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _shortfalls(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int,
                trainer_at_peak: bool) -> list[int]:
    """Per shared GPU, by how many bytes the memory free now, less the engine's growth to its generation peak
    (and, with `trainer_at_peak`, the trainer's growth back to its training peak), falls short of `margin_bytes`
    (≤ 0: it fits). Measured with the trainer at rest (its cache emptied) and the engine resumed but idle (weights
    only). Ranks and engines pair up by position (one engine per trainer GPU under --colocate); with fewer engines
    the largest need is used. Empty without readings (a CPU run)."""
    if not trainers or not engines:
        return []
    engine_growth = max(e.peak_reserved - e.reserved for e in engines)
    return [margin_bytes - (t.free - engine_growth - (max(0, t.peak_reserved - t.reserved) if trainer_at_peak else 0))
            for t in trainers]


def fits_resident(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int) -> bool:
    """Both peaks fit together. Counting only the engine's growth kept a full fine-tune's trainer resident beside
    an engine with no room left for its activations (an H100, bench/RESULTS.md, nineteenth session)."""
    return parking_to_fit_resident(trainers, engines, margin_bytes) == 0


def parking_to_fit_resident(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int) -> int | None:
    """Bytes of optimizer state each trainer parks during trainings for both peaks to fit together (0: they fit
    as they are), or None when parking all it can (its `parkable`) is not enough on some GPU, or without readings."""
    shorts = _shortfalls(trainers, engines, margin_bytes, trainer_at_peak=True)
    if not shorts or any(short > t.parkable for short, t in zip(shorts, trainers)):
        return None
    return max(0, max(shorts))


def engine_fits_beside_resting_trainer(trainers: list[DeviceMemory], engines: list[DeviceMemory],
                                       margin_bytes: int) -> bool:
    """The engine's generation peak fits beside the trainer at rest. The trainer's own peak, with the engines
    released, fit in the first iteration, which took turns."""
    shorts = _shortfalls(trainers, engines, margin_bytes, trainer_at_peak=False)
    return bool(shorts) and max(shorts) <= 0


class ColocationPolicy:
    """Answers, each iteration, whether the trainer offloads, whether the engines release their memory, and
    whether the trainer empties its cache before the engines resume."""

    def __init__(self, policy: str, offload_train: bool, offload_rollout: bool, margin_gb: float):
        if policy not in ("auto", "park", "always"):
            raise ValueError(f"colocate offload policy {policy!r}: expected auto, park or always")
        self.policy = policy
        self.offload_train = offload_train
        self.offload_rollout = offload_rollout
        self.margin_bytes = int(margin_gb * GIB)
        self.trainer_stays = False  # set once measurements show the engines' peak fits beside the resting trainer
        self.engines_stay = False  # set once measurements show both peaks fit together
        self.trainer_parks = 0  # bytes more of optimizer state the trainer parks during trainings for that
        self.decided = policy == "always" or not (offload_train or offload_rollout)

    @property
    def resident(self) -> bool:
        """Both sides stay: no turns at all."""
        return self.trainer_stays and self.engines_stay

    @property
    def trainer_offloads(self) -> bool:
        return self.offload_train and not self.trainer_stays

    @property
    def engines_release(self) -> bool:
        return self.offload_rollout and not self.engines_stay

    @property
    def trainer_empties_cache(self) -> bool:
        """The trainer stays but the engines release: it gives back its training cache before they resume."""
        return self.trainer_stays and self.engines_release

    def decide(self, trainers: list[DeviceMemory], engines: list[DeviceMemory]) -> None:
        """After the first iteration's weight sync, the trainer at rest (cache emptied), the engines resumed."""
        if self.decided:
            return
        self.decided = True
        parking = parking_to_fit_resident(trainers, engines, self.margin_bytes)
        middle_way = self.offload_rollout and engine_fits_beside_resting_trainer(trainers, engines, self.margin_bytes)
        if parking is not None and (parking == 0 or self.policy == "park" or not middle_way):
            self.trainer_stays = self.engines_stay = True
            self.trainer_parks = parking
        elif middle_way:
            self.trainer_stays = True
        if not trainers:  # a CPU run: no device memory to measure, so the turns stay (they cost little there)
            logger.debug("colocation: no GPU memory readings; trainer and engines keep taking turns")
            return
        trainer_gib = max(t.peak_reserved for t in trainers) / GIB
        resting_gib = max(t.reserved for t in trainers) / GIB
        engine_gib = max(e.peak_reserved for e in engines) / GIB if engines else 0.0
        total_gib = min(t.total for t in trainers) / GIB
        sizes = (f"trainer peak {trainer_gib:.1f} GiB (at rest {resting_gib:.1f}) + engine peak {engine_gib:.1f} GiB "
                 f"on {total_gib:.0f} GiB with {self.margin_bytes / GIB:.1f} GiB to spare")
        if self.resident and self.trainer_parks:
            logger.info("colocation: %s: both stay resident, the trainer parking %.1f GiB more of its optimizer "
                        "state on the host while it trains (no offload from now on; --colocate-offload-policy "
                        "always to force it)", sizes, self.trainer_parks / GIB)
        elif self.resident:
            logger.info("colocation: %s: both stay resident (no offload from now on; --colocate-offload-policy "
                        "always to force it)", sizes)
        elif self.trainer_stays:
            logger.info("colocation: %s: the trainer stays resident and empties its cache after training; the "
                        "engines release their memory while it trains", sizes)
        else:
            logger.info("colocation: %s: trainer and engines keep taking turns", sizes)
