"""bench/plain_loop.py: the fused loop (each sample's ∇ℓ taken during the rollout) leaves the two-pass loop's
policy gradient, on a tiny SD3 in fp32 with a trained-looking adapter (B ≠ 0, so A's gradient is not 0)."""

import argparse

import pytest
import torch


@pytest.fixture(scope="module")
def plain_loop(bench_script):
    with bench_script("plain_loop") as module:
        yield module


def _gradients(plain_loop, checkpoint: str, fused: bool, trained_steps: int) -> list[torch.Tensor]:
    opts = argparse.Namespace(device="cpu", prompts=2, samples=4, steps=4, trained_steps=trained_steps, height=32,
                              width=32, guidance=4.5, noise_level=0.7)
    torch.manual_seed(0)
    loop = plain_loop.build(opts, checkpoint, lora=True, compiled=False, fused=fused)
    with torch.no_grad():
        for name, param in loop.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    inputs = plain_loop.rollout_inputs(loop, ["a red cube", "two blue balls"], opts.samples, iteration=3)
    if fused:
        plain_loop.fused_gradients(loop, inputs, opts.samples, chunk=4)
    else:
        plain_loop.two_pass_gradients(loop, inputs, opts.samples, micro_batch=3)
    return [p.grad.clone() for p in loop.params]


@pytest.mark.parametrize("trained_steps", [0, 2])
def test_fused_gradient_equals_the_two_pass_gradient(plain_loop, tiny_checkpoint, trained_steps):
    checkpoint = tiny_checkpoint("sd3")
    two_pass = _gradients(plain_loop, checkpoint, fused=False, trained_steps=trained_steps)
    fused = _gradients(plain_loop, checkpoint, fused=True, trained_steps=trained_steps)
    assert len(two_pass) == len(fused) > 0
    scale = max(g.abs().max().item() for g in two_pass)
    assert scale > 0
    for a, b in zip(two_pass, fused):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)
