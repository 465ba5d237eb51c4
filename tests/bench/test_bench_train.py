"""bench/bench_train.py on the tiny SD3 (CPU, one gloo rank per row): a row per --blocks-per-unit value, each
with a measured rate."""

import sys


def test_a_row_per_blocks_per_unit_value_with_a_measured_rate(bench_script, monkeypatch, capsys):
    argv = ["bench_train.py", "--skip-naive", "--steps", "1", "--warmup", "0", "--blocks-per-unit", "1,2"]
    monkeypatch.setattr(sys, "argv", argv)
    with bench_script("bench_train") as bench_train:
        bench_train.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("miles FSDP2")]
    assert [row.split("  ")[0] for row in rows] == ["miles FSDP2 (CFG batched)",
                                                    "miles FSDP2 (CFG batched, 2 blocks per unit)"]
    assert all(float(row.split()[-6]) > 0 for row in rows)  # pairs per second, measured
