"""The trainer's metrics: sums reduced over ranks (gloo), FLOPs counted without changing a bit, perf/* (CPU)."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.train_metrics import FlopCount, MetricSums, train_speed_metrics


def _rank_metrics(rank: int) -> dict[str, float]:
    sums = MetricSums()
    sums.add("train/loss", torch.tensor([1.0, 2.0]) + rank * 10)  # rank 0: 1, 2; rank 1: 11, 12
    sums.add("train/loss", torch.tensor(3.0 + rank))
    sums.add_max("train/grad_max", torch.tensor(5.0 - 4 * rank))
    return sums.reduce(torch.device("cpu"))


def test_metric_sums_are_the_mean_over_every_value_of_every_rank_and_maxima_the_max():
    from miles.backends.fsdp_utils.spawn import spawn_ranks

    ranks = spawn_ranks(2, _rank_metrics, (), backend="gloo")
    # (1 + 2 + 3 + 11 + 12 + 4) / 6 values; max(5, 1)
    assert ranks == [{"train/loss": pytest.approx(33 / 6), "train/grad_max": 5.0}] * 2
    assert _rank_metrics(0) == {"train/loss": 2.0, "train/grad_max": 5.0}  # no process group: this rank's own


def test_flop_count_counts_a_matmuls_flops_and_leaves_every_value_as_it_was():
    torch.manual_seed(0)
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, 16)
    plain = torch.nn.functional.silu(x @ w).sum()
    plain.backward()
    plain_grad = x.grad.clone()
    x.grad = None
    with FlopCount() as counter:
        counted = torch.nn.functional.silu(x @ w).sum()
        counted.backward()
    assert counter.total == 2 * (2 * 8 * 32 * 16)  # the forward matmul and the input-gradient one
    assert torch.equal(counted, plain) and torch.equal(x.grad, plain_grad)


def test_train_speed_metrics_give_mfu_only_where_the_peak_is_known(monkeypatch):
    monkeypatch.delenv("MILES_PEAK_TFLOPS", raising=False)
    cpu = torch.device("cpu")
    assert train_speed_metrics(40, 2.0, None, 1.0, cpu) == {"perf/train_time_s": 2.0, "perf/train_pairs_per_s": 20.0}
    assert "perf/mfu" not in train_speed_metrics(40, 2.0, 1e12, 1.0, cpu)
    monkeypatch.setenv("MILES_PEAK_TFLOPS", "100")
    # 40 pairs of 1 TFLOP over 2 s on two ranks: 10 TFLOP/s each, 10 % of 100
    metrics = train_speed_metrics(40, 2.0, 1e12, 0.5, cpu)
    assert metrics["perf/tflops_per_rank"] == pytest.approx(10.0) and metrics["perf/mfu"] == pytest.approx(0.1)
