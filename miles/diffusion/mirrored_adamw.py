"""AdamW as a fixed sequence of correctly rounded fp32 operations, so that two devices take the same step bit for bit.

Under `--diffusion-rollout-gradient` with the trainer on the host, the engine that formed the policy gradient also
takes the optimizer step on its copy of the adapter (miles/engine/rollout_gradients.py), and the trainer takes the
same step on its own (miles/backends/fsdp_utils/rollout_gradient_step.py): the engine then denoises the next
rollout at once, with no weight push, and the trainer still holds the run's weights and moments for checkpoints.
That only works if both steps give the same bits. torch's AdamW kernels do not promise it across devices (fused
kernels, `lerp`, a division by a scalar done as a multiplication by its reciprocal on CUDA, FMA contraction), so
both sides run this function instead: one elementwise operation per kernel (a tensor times a Python scalar cast to
fp32, a sum of two tensors, a quotient of two tensors, a square root made exact by `correctly_rounded_sqrt`), each
correctly rounded in IEEE fp32 on the CPU and on CUDA alike, in the same order. Every operation is elementwise, so
the result does not depend on how the parameters are cut into tensors (the engine steps one flat vector, the
trainer each factor).

The step is decoupled-weight-decay Adam with bias correction (torch.optim.AdamW's definition):
    p ← p·(1 − lr·λ);  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;  p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)
and gradient clipping scales g by min(1, max_norm / (‖g‖ + 1e-6)) with ‖g‖ as one side measured it and told the
other (a reduction's order differs between devices; a Python float does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class AdamWStep:
    """One optimizer step's settings, as the trainer sends them to the engine: the learning rate of this step
    (the schedule's current value), AdamW's constants, the clipping norm (0: none) and `count`, the step's number t
    (1 for the first)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    clip: float
    count: int


def clip_scale(grad_norm: float, clip: float) -> float:
    """The factor the gradient is multiplied by: min(1, clip / (‖g‖ + 1e-6)), 1 without clipping."""
    if clip <= 0:
        return 1.0
    return min(1.0, clip / (grad_norm + 1e-6))


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: AdamWStep, grad_scale: float = 1.0) -> None:
    """Update `param`, `exp_avg` and `exp_avg_sq` (fp32, one shape) in place by one AdamW step on `grad`."""
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if step.weight_decay:
        param.mul_(1.0 - step.lr * step.weight_decay)
    exp_avg.mul_(step.beta1)
    exp_avg.add_(g * (1.0 - step.beta1))
    exp_avg_sq.mul_(step.beta2)
    squared = g * g
    squared.mul_(1.0 - step.beta2)
    exp_avg_sq.add_(squared)
    denom = correctly_rounded_sqrt(exp_avg_sq)
    denom.mul_(1.0 / math.sqrt(1.0 - step.beta2 ** step.count))
    denom.add_(step.eps)
    update = torch.div(exp_avg, denom)
    update.mul_(-step.lr / (1.0 - step.beta1 ** step.count))
    param.add_(update)


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x of fp32 `x` ≥ 0, rounded to the nearest fp32 on every device. torch's `sqrt` is not: its vectorised CPU
    kernels are off by an ulp for some inputs, for a share that depends on the CPU, and an H100 gave other bits
    for 447 of 65 536 values (bench/RESULTS.md, thirty-seventh section). So: an estimate within an ulp (fp64's
    square root rounded to fp32), then the one correction that makes it the nearest, decided exactly. The
    midpoint between two neighbouring fp32 values has at most 25 significant bits, its square at most 50, so fp64
    holds each square exactly and the comparison with x (exact in fp64 too) says on which side of the midpoint √x
    lies; a tie cannot occur."""
    x64 = x.double()
    estimate = x64.sqrt().float()
    rounded = estimate.clone()
    midpoint = torch.empty_like(x64)  # one fp64 buffer for both midpoints: few allocations on a host trainer
    for toward, past in ((math.inf, torch.gt), (0.0, torch.lt)):
        neighbour = torch.nextafter(estimate, torch.full_like(estimate, toward))
        midpoint.copy_(estimate).add_(neighbour).mul_(0.5).square_()  # each exact in fp64
        rounded = torch.where(past(x64, midpoint), neighbour, rounded)
    return rounded


def bits_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """The sum of the fp32 values' bit patterns as integers: exact and independent of order or cutting, so the
    engine's flat vector and the trainer's factors compare without moving either."""
    total = 0
    for tensor in tensors:
        total += int(tensor.detach().reshape(-1).view(torch.int32).sum(dtype=torch.int64))
    return total


def matches_host(device: torch.device | str) -> bool:
    """Whether `device` takes `adamw_step` with the host's bits: three steps on values of every magnitude fp32 has
    (normal, subnormal, zeros of both signs), compared bit for bit. An engine asks once, at start-up, before it
    offers to take the trainer's steps (miles/engine/adapter_step.py)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    generator = torch.Generator().manual_seed(0)
    numel = 1 << 16
    # from fp32's smallest subnormal up: squares and moments underflow into subnormals, where a device that
    # flushed them to zero would part from the host
    scales = torch.logspace(-149, 40, numel, base=2.0)[torch.randperm(numel, generator=generator)]
    start = [torch.randn(numel, generator=generator) * scales for _ in range(3)]
    start[0][::101], start[1][::103] = -0.0, 0.0
    start[2] = start[2].abs()  # exp_avg_sq is never negative
    results = []
    for where in ("cpu", device):
        param, exp_avg, exp_avg_sq = (t.clone().to(where) for t in start)
        for count in (1, 2, 3):
            grad = (torch.randn(numel, generator=torch.Generator().manual_seed(count)) * scales).to(where)
            step = AdamWStep(lr=1e-3 * count, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, clip=1.0,
                             count=count)
            adamw_step(param, grad, exp_avg, exp_avg_sq, step, 0.37 if count == 2 else 1.0)
        results.append([t.cpu() for t in (param, exp_avg, exp_avg_sq)])
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*results))
