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
- else both keep taking turns.
`always` takes turns at every iteration (the reference's behaviour).
"""

from __future__ import annotations

import logging

from miles.utils.device_memory import DeviceMemory

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _fits(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int, trainer_at_peak: bool) -> bool:
    """On each shared GPU, the memory free now less the engine's growth to its generation peak (and, with
    `trainer_at_peak`, the trainer's growth back to its training peak) leaves `margin_bytes`. Measured with the
    trainer at rest (its cache emptied) and the engine resumed but idle (weights only). Ranks and engines pair up
    by position (one engine per trainer GPU under --colocate); with fewer engines the largest need is used."""
    if not trainers or not engines:
        return False
    engine_growth = max(e.peak_reserved - e.reserved for e in engines)
    for trainer in trainers:
        trainer_growth = max(0, trainer.peak_reserved - trainer.reserved) if trainer_at_peak else 0
        if trainer.free - trainer_growth - engine_growth < margin_bytes:
            return False
    return True


def fits_resident(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int) -> bool:
    """Both peaks fit together. Counting only the engine's growth kept a full fine-tune's trainer resident beside
    an engine with no room left for its activations (an H100, bench/RESULTS.md, nineteenth session)."""
    return _fits(trainers, engines, margin_bytes, trainer_at_peak=True)


def engine_fits_beside_resting_trainer(trainers: list[DeviceMemory], engines: list[DeviceMemory],
                                       margin_bytes: int) -> bool:
    """The engine's generation peak fits beside the trainer at rest. The trainer's own peak, with the engines
    released, fit in the first iteration, which took turns."""
    return _fits(trainers, engines, margin_bytes, trainer_at_peak=False)


class ColocationPolicy:
    """Answers, each iteration, whether the trainer offloads, whether the engines release their memory, and
    whether the trainer empties its cache before the engines resume."""

    def __init__(self, policy: str, offload_train: bool, offload_rollout: bool, margin_gb: float):
        if policy not in ("auto", "always"):
            raise ValueError(f"colocate offload policy {policy!r}: expected auto or always")
        self.policy = policy
        self.offload_train = offload_train
        self.offload_rollout = offload_rollout
        self.margin_bytes = int(margin_gb * GIB)
        self.trainer_stays = False  # set once measurements show the engines' peak fits beside the resting trainer
        self.engines_stay = False  # set once measurements show both peaks fit together
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
        if fits_resident(trainers, engines, self.margin_bytes):
            self.trainer_stays = self.engines_stay = True
        elif self.offload_rollout and engine_fits_beside_resting_trainer(trainers, engines, self.margin_bytes):
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
        if self.resident:
            logger.info("colocation: %s: both stay resident (no offload from now on; --colocate-offload-policy "
                        "always to force it)", sizes)
        elif self.trainer_stays:
            logger.info("colocation: %s: the trainer stays resident and empties its cache after training; the "
                        "engines release their memory while it trains", sizes)
        else:
            logger.info("colocation: %s: trainer and engines keep taking turns", sizes)
