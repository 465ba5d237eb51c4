"""bench/bench_block_compile.py: SD3.5-Medium's three block kinds run the engine's gradient step with its LoRA taps
(the last block has no text stream out), and the table sums them into one step as the engine's 24 blocks and
tiles do."""

import sys

import pytest
import torch


@pytest.fixture(scope="module")
def bench_block_compile(bench_script):
    with bench_script("bench_block_compile") as module:
        yield module


def test_each_block_kind_takes_its_input_gradient_and_the_table_sums_one_step(bench_block_compile, monkeypatch,
                                                                              capsys):
    monkeypatch.setattr(sys, "argv", ["bench_block_compile.py", "--device", "cpu", "--modes", "eager", "--tile", "1",
                                      "--samples", "2", "--image-tokens", "4", "--text-tokens", "4", "--repeats", "1"])
    bench_block_compile.main()
    lines = capsys.readouterr().out.splitlines()
    # the 8 attention projections of the dual and joint blocks, 7 of the last (its text stream has no output projection)
    assert "LoRA taps of rank 32 on 23 layers" in lines[0]
    header = next(line for line in lines if line.startswith("| mode |"))
    assert [cell.strip() for cell in header.split("|")[2:5]] == [f"{k} ms (TFLOP/s)" for k in ("dual", "joint", "last")]
    floor = next(line for line in lines if line.startswith("| floor"))
    eager = next(line for line in lines if line.startswith("| eager |")).split("|")
    per_kind = [float(cell.split("(")[0]) / 1e3 for cell in eager[2:5]]
    # 2 tiles of 1 sample: each kind's block as often as SD3.5-Medium has it (13, 10, 1)
    assert float(eager[5]) == pytest.approx(2 * (13 * per_kind[0] + 10 * per_kind[1] + per_kind[2]), rel=0.01)
    assert eager[8].strip() == "0.0e+00"  # the eager block against itself: the same input gradient
    assert all(float(cell) > 0 for cell in floor.split("|")[2:6])  # every kind's FLOPs counted


def test_the_last_block_returns_no_text_stream_and_its_inputs_and_taps_still_get_gradients(bench_block_compile):
    kind, _, switches = bench_block_compile.BLOCK_KINDS[-1]
    assert kind == "last"
    block = bench_block_compile.build_block(switches, "cpu", torch.float32, seed=0)
    inputs = bench_block_compile.block_inputs(1, 4, 4, 1536, "cpu", torch.float32, seed=0)
    taps = bench_block_compile.install_lora_taps({"last": block}, 4, "cpu")
    rows = taps.tile_rows(1)
    taps.forward_rows(rows)
    try:
        text_out, hidden_out = block(inputs["hidden"].requires_grad_(True), inputs["text"].requires_grad_(True),
                                     inputs["temb"])
    finally:
        taps.forward_rows(None)
    assert text_out is None
    hidden_out.backward(inputs["grad_hidden"][:1])
    assert inputs["text"].grad.abs().sum() > 0  # the text stream still reaches the image tokens through attention
    assert rows.grad is not None and rows.grad.abs().sum() > 0  # the taps gave the sample its factor gradients
