"""bench/bench_fp8_speed.py: it counts the real architecture's block linears and times every path of one."""

import pytest


@pytest.fixture(scope="module")
def fp8_speed(bench_script):
    with bench_script("bench_fp8_speed") as module:
        yield module


def test_the_block_linears_are_sd35_mediums_by_stream(fp8_speed):
    shapes = fp8_speed.block_linear_shapes(tokens=1024, text_tokens=333, sequences=16)
    image, text = 16 * 1024, 16 * 333
    # 24 blocks: q, k, v, out and the 2 feed-forward layers on each stream, a second attention in the first 13
    # on the image stream; the last block's text stream stops after its q, k, v (diffusers' context_pre_only)
    assert shapes[(image, 1536, 1536)] == 24 * 4 + 13 * 4
    assert shapes[(image, 1536, 6144)] == shapes[(image, 6144, 1536)] == 24
    assert shapes[(text, 1536, 1536)] == 23 * 4 + 3
    assert shapes[(text, 1536, 6144)] == shapes[(text, 6144, 1536)] == 23
    assert sum(shapes.values()) == 148 + 48 + 95 + 46


def test_one_shape_times_every_path_and_the_fp8_forwards_stay_near_bf16(fp8_speed):
    m = fp8_speed.measure_shape(24, 64, 96, rank=4, device="cpu", repeats=1, quantize=fp8_speed.quantize_joined)
    assert all(m[f"{path}_{way}"] > 0 for path in ("bf16", "fp8", "folded", "bound")
               for way in ("forward", "backward"))
    # e4m3 keeps 3 mantissa bits; the folded adapter is rounded on its own, not into W
    assert 0.005 < m["fp8_error"] < 0.08 and 0.005 < m["folded_error"] < 0.08
