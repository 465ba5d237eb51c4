"""bench/bench_train.py on the tiny SD3 (CPU, one gloo rank per row): the one-rank trainer with its window gather
beside the same trainer gathering around every micro-batch, in one table."""

import sys


def test_the_window_gather_row_and_the_per_micro_batch_row_print_side_by_side(bench_script, monkeypatch, capsys):
    argv = ["bench_train.py", "--skip-naive", "--per-micro-batch-gathers", "--steps", "1", "--warmup", "0"]
    monkeypatch.setattr(sys, "argv", argv)
    with bench_script("bench_train") as bench_train:
        bench_train.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("miles FSDP2")]
    assert [row.split("  ")[0] for row in rows] == ["miles FSDP2 (CFG batched)",
                                                    "miles FSDP2 (CFG batched, gathers per micro-batch)"]
    assert all(float(row.split()[-5]) > 0 for row in rows)  # pairs per second, measured
