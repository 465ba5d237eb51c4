"""bench/bench_adapter_tap.py: both forms of the taps' factor gradients run one step's layers and agree."""

import sys

import pytest
import torch


@pytest.fixture(scope="module")
def bench_adapter_tap(bench_script):
    with bench_script("bench_adapter_tap") as module:
        yield module


def test_the_per_copy_form_and_the_engines_batched_form_give_the_same_bits(bench_adapter_tap):
    torch.manual_seed(0)
    x, g = torch.randn(6, 5, 8), torch.randn(6, 5, 8)
    a, b = torch.randn(3, 2, 8), torch.randn(3, 8, 2)
    for got, want in zip(bench_adapter_tap.adapter_factor_gradients(x, g, a, b),
                         bench_adapter_tap.per_copy_factor_gradients(x, g, a, b)):
        assert torch.equal(got, want)


def test_a_small_cpu_run_prints_a_row_per_form(bench_adapter_tap, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_adapter_tap.py", "--device", "cpu", "--tokens", "8", "--text-tokens", "4",
                                      "--tiles", "1", "--tile", "2", "--width", "16", "--rank", "2"])
    bench_adapter_tap.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| per copy") or line.startswith("| copies batched")]
    assert len(rows) == 2 and all(line.rstrip().endswith("0.0e+00 |") for line in rows)
