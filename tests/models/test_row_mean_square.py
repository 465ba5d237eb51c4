"""The RMS reduction of the opaque kernels (miles/models/row_mean_square.py): ATen's formula on the CPU, one
Triton pass on CUDA whose value per row ignores the other rows, in the layout the fake kernel promises."""

from __future__ import annotations

import pytest
import torch

from miles.models.row_mean_square import empty_like_result, mean_square_formula, row_mean_square

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")


def _head_view(batch: int = 2, tokens: int = 5, heads: int = 3, width: int = 64, device: str = "cpu"):
    """A projection's output viewed as (batch, heads, tokens, width): how attention processors feed q/k norms."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, heads * width, generator=generator).to(device, torch.bfloat16)
    return x.view(batch, tokens, heads, width).transpose(1, 2)


def test_cpu_is_the_formula_bit_for_bit():
    x = _head_view()
    assert torch.equal(row_mean_square(x), mean_square_formula(x))


@pytest.mark.parametrize("make", [
    lambda: _head_view(),
    lambda: torch.randn(4, 7, 32),
    lambda: torch.randn(6, 48)[:, :40],  # rows not contiguous: copied first
])
def test_the_fake_layout_is_the_real_one_on_every_device(make):
    from miles.models.opaque_kernels import opaque_mean_square

    x = make()
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        # opcheck runs the op under fake tensors and compares shapes and strides with the real kernel's
        torch.library.opcheck(opaque_mean_square, (x.to(device).float().requires_grad_(True),))
        fake = empty_like_result(x.to(device))
        assert fake.shape == (*x.shape[:-1], 1) and fake.dtype == torch.float32


@cuda
@pytest.mark.parametrize("width", [64, 128, 3072, 5120])
def test_triton_matches_the_formula_and_ignores_the_batch(width):
    x = _head_view(batch=6, tokens=37, heads=2, width=width, device="cuda")
    result = row_mean_square(x)
    assert result.stride() == empty_like_result(x).stride()
    torch.testing.assert_close(result, mean_square_formula(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(row_mean_square(x[2:3]), result[2:3])  # one sample alone: the same bits
