"""miles/diffusion/mirrored_adamw.py: torch.optim.AdamW's step, and the same bits however the values are cut and
on whichever device they are stepped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.diffusion.mirrored_adamw import (
    AdamWStep,
    adamw_step,
    bits_checksum,
    clip_scale,
    correctly_rounded_sqrt,
    matches_host,
)


def _state(numel: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(numel, generator=generator) for _ in range(2)) + (torch.zeros(numel), torch.zeros(numel))


def _run(steps: int, device: str, pieces: int = 1, numel: int = 4099, weight_decay: float = 0.01):
    """`steps` AdamW steps on random gradients; the values cut into `pieces` tensors."""
    param, _, exp_avg, exp_avg_sq = (t.to(device) for t in _state(numel, 0))
    generator = torch.Generator().manual_seed(1)
    for count in range(1, steps + 1):
        grad = torch.randn(numel, generator=generator) * 10.0 ** (count % 3 - 1)
        grad[::97] = -0.0 if count % 2 else 0.0
        norm = float(torch.linalg.vector_norm(grad))  # measured once, as the engine tells the trainer its norm
        grad = grad.to(device)
        step = AdamWStep(lr=1e-3 * count, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, clip=1.0,
                         count=count)
        for part in zip(*(t.tensor_split(pieces) for t in (param, grad, exp_avg, exp_avg_sq))):
            adamw_step(*part, step, clip_scale(norm, step.clip))
    return param.cpu(), exp_avg.cpu(), exp_avg_sq.cpu()


def test_it_is_torch_adamw_with_clipping():
    param, _, _, _ = _state(257, 0)
    reference = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros(257), torch.zeros(257)
    for count in range(1, 6):
        grad = torch.randn(257, generator=torch.Generator().manual_seed(count)) * 3
        reference.grad = grad.clone()
        norm = torch.nn.utils.clip_grad_norm_([reference], 1.0)
        optimizer.step()
        adamw_step(param, grad, exp_avg, exp_avg_sq,
                   AdamWStep(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, clip=1.0, count=count),
                   clip_scale(float(norm), 1.0))
        torch.testing.assert_close(param, reference.detach(), rtol=1e-6, atol=1e-7)
        assert optimizer.state[reference]["exp_avg"].sub(exp_avg).abs().max() < 1e-6


def test_the_same_bits_however_the_values_are_cut():
    whole, cut = _run(4, "cpu"), _run(4, "cpu", pieces=7)
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    assert bits_checksum([whole[0]]) == bits_checksum(whole[0].tensor_split(5))
    nudged = whole[0].clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(1.0))
    assert bits_checksum([nudged]) != bits_checksum([whole[0]])


def test_the_square_root_is_the_nearest_fp32():
    """torch's CPU sqrt is off by an ulp for some inputs (how many depends on the CPU); numpy's is the IEEE one."""
    generator = torch.Generator().manual_seed(3)
    numel = 1 << 18
    spread = torch.randn(numel, generator=generator).abs() * torch.logspace(-75, 64, numel, base=2.0)
    squares = torch.arange(1, 4096, dtype=torch.float32).square()
    edges = torch.tensor([0.0, 1e-45, 1e-40, 1.17549435e-38, 0.25, 1.0, 2.0, 3.0, 3.4e38])
    for x in (spread, squares, torch.nextafter(squares, torch.zeros_like(squares)), edges):
        ours = correctly_rounded_sqrt(x).numpy().view(np.int32)
        assert np.array_equal(ours, np.sqrt(x.numpy()).view(np.int32))


def test_the_host_matches_itself():
    assert matches_host("cpu")


def test_no_clipping_below_the_norm_and_none_when_off():
    assert clip_scale(0.5, 1.0) == 1.0 and clip_scale(5.0, 0.0) == 1.0
    assert clip_scale(4.0, 1.0) == pytest.approx(0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_steps_the_same_bits_as_the_cpu():
    """What lets the engine step its adapter while the trainer on the host steps its own (adapter_step.py)."""
    on_cpu, on_gpu = _run(6, "cpu", numel=1 << 20), _run(6, "cuda", pieces=3, numel=1 << 20)
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a, b), (a - b).abs().max()
    assert matches_host("cuda")  # the engine's start-up check says so too (it offers its steps on it)
