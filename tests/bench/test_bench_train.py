"""bench/bench_train.py on the tiny SD3 (CPU, one gloo rank): the trainer's row prints a measured rate."""

import sys


def test_the_trainer_row_prints_a_measured_rate(bench_script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--skip-naive", "--steps", "1", "--warmup", "0"])
    with bench_script("bench_train") as bench_train:
        bench_train.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("miles FSDP2")]
    assert [row.split("  ")[0] for row in rows] == ["miles FSDP2 (CFG batched)"]
    assert float(rows[0].split()[-5]) > 0  # pairs per second, measured
