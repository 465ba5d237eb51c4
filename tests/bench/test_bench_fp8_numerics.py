"""bench/bench_fp8_numerics.py: its FP8 layer is the product of the rounded operands, and its merge measure reads
what rounding does to an update."""

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def fp8(bench_script):
    with bench_script("bench_fp8_numerics") as module:
        yield module


def test_the_fp8_layer_multiplies_the_e4m3_operands_with_their_row_scales(fp8):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(2, 5, 64)
    y = fp8.Fp8Linear(linear)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 32)
    expected = fp8.fp8_round(x.reshape(-1, 64)) @ fp8.fp8_round(linear.weight.detach()).t() + linear.bias.detach()
    torch.testing.assert_close(y.float().reshape(-1, 32), expected, rtol=1e-2, atol=1e-2)
    # e4m3 keeps 3 mantissa bits: the rounded operands are within 1/16 of each value
    relative = (fp8.fp8_round(x) - x).abs() / x.abs().clamp(min=1e-3)
    assert float(relative[x.abs() > 0.1].max()) <= 1 / 16 + 1e-6


def test_an_update_far_below_the_rounding_step_survives_only_on_average(fp8):
    block = nn.Module()
    block.proj = nn.Linear(256, 256)
    transformer = nn.Module()
    transformer.transformer_blocks = nn.ModuleList([block])
    small = fp8.merge_survival(transformer, 1e-3, torch.Generator().manual_seed(0))
    large = fp8.merge_survival(transformer, 1e-1, torch.Generator().manual_seed(0))
    for kept, _ in (*small.values(), *large.values()):
        assert abs(kept - 1) < 0.1
    assert small["e4m3"][1] > 1 > large["e4m3"][1]  # noisier than the update itself when it is small
    assert small["bf16"][1] < small["e4m3"][1] and large["bf16"][1] < large["e4m3"][1]
