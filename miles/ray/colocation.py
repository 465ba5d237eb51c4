"""Colocated runs: whether the trainer and the engines must take turns on the GPUs, decided from measurements.

Under `--colocate` the trainer offloads while the engines generate and the engines release their memory while
the trainer trains (`--offload-train`, `--offload-rollout`). Each turn moves every weight, optimizer state and
text encoder over PCIe: ~7 s per iteration at SD3.5-Medium size on an H200, for memory that is often not
needed, since both sides together fit on a 141 GB device.

`--colocate-offload-policy auto` (the default) keeps the turns only while they are needed: the first
iteration always takes turns (the safe order), and measures on every GPU the trainer's reserved memory at its
peak and the engine's peak reserved memory during generation. When the engine's peak fits in the memory left
free with the trainer resident, with `--colocate-memory-margin-gb` to spare, both stay resident from then on
and the turns cost nothing. `always` takes turns at every iteration (the reference's behaviour).
"""

from __future__ import annotations

import logging

from miles.utils.device_memory import DeviceMemory

logger = logging.getLogger(__name__)

GIB = 1 << 30


def fits_resident(trainers: list[DeviceMemory], engines: list[DeviceMemory], margin_bytes: int) -> bool:
    """True when, on each shared GPU, the trainer's and the engine's peaks fit together with margin to spare.

    Measured with the trainer resident and the engine resumed but idle (weights only): each side will grow by
    its peak minus what it holds now. The trainer's cache is often below its peak by then (an allocation that
    failed beside the resuming engine empties it; growing segments give pages back), and counting only the
    engine's growth once kept a full fine-tune's trainer resident beside an engine with no room left for its
    activations (an H100, bench/RESULTS.md, nineteenth session). Ranks and engines pair up by position (one engine
    per trainer GPU under --colocate); with fewer engines the largest need is used.
    """
    if not trainers or not engines:
        return False
    worst_engine_growth = max(e.peak_reserved - e.reserved for e in engines)
    for trainer in trainers:
        trainer_growth = max(0, trainer.peak_reserved - trainer.reserved)
        if trainer.free - trainer_growth - worst_engine_growth < margin_bytes:
            return False
    return True


class ColocationPolicy:
    """Answers, each iteration, whether the trainer offloads and the engines release their memory."""

    def __init__(self, policy: str, offload_train: bool, offload_rollout: bool, margin_gb: float):
        if policy not in ("auto", "always"):
            raise ValueError(f"colocate offload policy {policy!r}: expected auto or always")
        self.policy = policy
        self.offload_train = offload_train
        self.offload_rollout = offload_rollout
        self.margin_bytes = int(margin_gb * GIB)
        self.resident = False  # set once measurements show both sides fit
        self.decided = policy == "always" or not (offload_train or offload_rollout)

    @property
    def trainer_offloads(self) -> bool:
        return self.offload_train and not self.resident

    @property
    def engines_release(self) -> bool:
        return self.offload_rollout and not self.resident

    def decide(self, trainers: list[DeviceMemory], engines: list[DeviceMemory]) -> None:
        """After the first iteration's weight sync (trainer resident, engines resumed): keep both resident?"""
        if self.decided:
            return
        self.decided = True
        self.resident = fits_resident(trainers, engines, self.margin_bytes)
        if not trainers:  # a CPU run: no device memory to measure, so the turns stay (they cost little there)
            logger.debug("colocation: no GPU memory readings; trainer and engines keep taking turns")
            return
        trainer_gib = max(max(t.reserved, t.peak_reserved) for t in trainers) / GIB if trainers else 0.0
        engine_gib = max(e.peak_reserved for e in engines) / GIB if engines else 0.0
        total_gib = min(t.total for t in trainers) / GIB if trainers else 0.0
        if self.resident:
            logger.info(
                "colocation: trainer peak %.1f GiB + engine peak %.1f GiB fit on %.0f GiB with %.1f GiB to spare: "
                "both stay resident (no offload from now on; --colocate-offload-policy always to force it)",
                trainer_gib, engine_gib, total_gib, self.margin_bytes / GIB,
            )
        else:
            logger.info(
                "colocation: trainer peak %.1f GiB + engine peak %.1f GiB do not fit on %.0f GiB with %.1f GiB to "
                "spare: trainer and engines keep taking turns",
                trainer_gib, engine_gib, total_gib, self.margin_bytes / GIB,
            )
