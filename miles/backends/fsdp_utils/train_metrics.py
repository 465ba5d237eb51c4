"""What a training reports besides its losses: metrics summed on the device and reduced once per rollout, and its
speed (`perf/train_pairs_per_s`, `perf/tflops_per_rank`, `perf/mfu` against the card's dense bf16 peak)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# dense bf16 TFLOP/s by the name the device reports; MILES_PEAK_TFLOPS overrides it (a card not listed, a clock cap)
PEAK_TFLOPS_BY_DEVICE = {"H200": 989.5, "H100": 989.5, "H800": 989.5, "A100": 312.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    if os.environ.get("MILES_PEAK_TFLOPS"):
        return float(os.environ["MILES_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in PEAK_TFLOPS_BY_DEVICE.items() if key in name), None)


class MetricSums:
    """Σ value and Σ count per metric name, kept on the device (one host sync per rollout, in `reduce`);
    `add_max` metrics reduce with max."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, name: str, values: torch.Tensor) -> None:
        values = values.detach().to(torch.float64).reshape(-1)
        total = values.sum()
        self.sums[name] = total if name not in self.sums else self.sums[name] + total
        self.counts[name] = self.counts.get(name, 0) + values.numel()

    def add_max(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64).reshape(())
        self.maxima[name] = value if name not in self.maxima else torch.maximum(self.maxima[name], value)

    def reduce(self, device) -> dict[str, float]:
        """Σ values / Σ counts over every rank (maxima: the max over every rank), as floats on every rank."""
        result: dict[str, float] = {}
        names = sorted(self.sums)
        if names:
            totals = torch.stack([self.sums[n].to(device) for n in names])
            counts = torch.tensor([float(self.counts[n]) for n in names], dtype=torch.float64, device=device)
            packed = torch.stack([totals, counts])
            if dist.is_initialized():
                dist.all_reduce(packed)
            packed = packed.cpu()
            result.update({n: float(packed[0, i] / max(float(packed[1, i]), 1.0)) for i, n in enumerate(names)})
        max_names = sorted(self.maxima)
        if max_names:
            packed = torch.stack([self.maxima[n].to(device) for n in max_names])
            if dist.is_initialized():
                dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            result.update({n: float(v) for n, v in zip(max_names, packed.cpu().tolist())})
        return result


class FlopCount(TorchDispatchMode):
    """Σ FLOPs of the ops torch.utils.flop_counter has formulas for (matmuls, convolutions, attention), running
    every op exactly as it runs without the mode.

    Not `FlopCounterMode`: it replaces each op it has no formula for by that op's decomposition (e.g.
    `silu_backward` by element-wise primitives), which rounds differently from the fused kernel. The micro-batch
    it wraps then gets slightly different gradients, and as it wraps the first rollout of each process, a resumed
    run would diverge from the uninterrupted one at the first step after `--load`.
    """

    def __init__(self):
        super().__init__()
        self.total = 0
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            try:
                self.total += formula(*args, **kwargs, out_val=out)
            except AssertionError:  # a shape torch's formulas do not know (grouped-query SDPA): uncounted
                self.uncounted.add(str(func))
        return out


def train_speed_metrics(trained_pairs: int, seconds: float, flops_per_pair: float | None, rank_share: float,
                        device: torch.device) -> dict[str, float]:
    """perf/* of one training: pairs per second and, once a micro-batch's FLOPs were counted (`FlopCount`), TFLOP/s
    per rank (`rank_share` of the pairs' FLOPs run on each rank) and MFU where the card's peak is known."""
    result = {"perf/train_time_s": seconds, "perf/train_pairs_per_s": trained_pairs / max(seconds, 1e-9)}
    if flops_per_pair:
        tflops = flops_per_pair * trained_pairs * rank_share / max(seconds, 1e-9) / 1e12
        result["perf/tflops_per_rank"] = tflops
        peak = peak_tflops(device)
        if peak:
            result["perf/mfu"] = tflops / peak
    return result
