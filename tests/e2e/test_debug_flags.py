"""End-to-end runs of train_diffusion.py's debug flags on CPU: real Ray, real engine processes, tiny SD3.

Three runs of two rollouts each: a rollout-only run that saves its rollouts, a replay of those rollouts with
no engines, and a full run with `--dump-details` and the dashboard timeline.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def _load_e2e_helpers():
    """`base_flags`, `run`, `metrics`, `series` of test_train_diffusion.py (tests/ is not a package)."""
    path = Path(__file__).with_name("test_train_diffusion.py")
    spec = importlib.util.spec_from_file_location("_e2e_train_diffusion_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _load_e2e_helpers()
base_flags, run, metrics, series = _helpers.base_flags, _helpers.run, _helpers.metrics, _helpers.series

SAMPLES_PER_ROLLOUT = 16  # base_flags: 4 prompts x 4 samples


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint) -> str:
    return tiny_checkpoint("sd3")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    from miles.testing.make_prompts import write_prompts

    return write_prompts(str(tmp_path_factory.mktemp("data") / "prompts.jsonl"), count=8)


def _train_keys(records: list[dict]) -> set[str]:
    return {key for record in records for key in record if key.startswith("train/")}


def test_saved_rollouts_replay_without_engines(sd3, prompts, tmp_path):
    template = str(tmp_path / "rollouts" / "rollout_{rollout_id}.pt")

    # (a) rollout only: the rollouts are saved and nothing is trained.
    rollout_only = tmp_path / "rollout-only"
    run([*base_flags(sd3, prompts, rollout_only), "--num-rollout", "2", "--debug-rollout-only",
         "--save-debug-rollout-data", template])
    records = metrics(rollout_only)
    assert len(series(records, "rollout/reward_mean")) == 2
    assert _train_keys(records) == set()
    assert "perf/train_time" not in {key for record in records for key in record}
    saved = {}
    for rollout_id in (0, 1):
        payload = torch.load(template.format(rollout_id=rollout_id), weights_only=True)  # plain sample records
        assert payload["rollout_id"] == rollout_id
        assert len(payload["samples"]) == SAMPLES_PER_ROLLOUT
        assert all(sample["rollout_log_probs"] is not None for sample in payload["samples"])
        saved[rollout_id] = payload["samples"]

    # (b) replay half of each saved rollout: --train-only is implied, so no engine starts and no weights sync.
    replay = tmp_path / "replay"
    run([*base_flags(sd3, prompts, replay), "--num-rollout", "2", "--load-debug-rollout-data", template,
         "--load-debug-rollout-data-subsample", "0.5"])
    records = metrics(replay)
    assert series(records, "rollout/num_samples") == [SAMPLES_PER_ROLLOUT / 2] * 2
    assert len(series(records, "train/loss")) == 2
    assert {"train/grad_norm", "train/num_pairs"} <= _train_keys(records)
    pairs_per_sample = len(saved[0][0]["sde_step_indices"])
    assert series(records, "train/num_pairs") == [SAMPLES_PER_ROLLOUT / 2 * pairs_per_sample] * 2
    all_keys = {key for record in records for key in record}
    assert "perf/weight_sync_time" not in all_keys and "perf/images_per_second" not in all_keys


def test_dump_details_and_dashboard_timeline(sd3, prompts, tmp_path):
    out, details, dashboard = tmp_path / "run", tmp_path / "details", tmp_path / "dashboard"
    run([*base_flags(sd3, prompts, out), "--num-rollout", "2", "--dump-details", str(details),
         "--use-miles-dashboard", "--miles-dashboard-workspace", str(dashboard)])
    assert len(series(metrics(out), "train/loss")) == 2

    # (c) --dump-details: every rollout and every rank's train data (one trainer rank here)
    for rollout_id in (0, 1):
        rollout = torch.load(details / "rollout_data" / f"{rollout_id}.pt", weights_only=True)
        assert rollout["rollout_id"] == rollout_id and len(rollout["samples"]) == SAMPLES_PER_ROLLOUT
        train = torch.load(details / "train_data" / f"{rollout_id}_0.pt", weights_only=False)
        assert train["rollout_id"] == rollout_id and train["dp_rank"] == 0
        assert sum(len(micro_batch) for window in train["windows"] for micro_batch in window) > 0
    assert sorted(p.name for p in (details / "train_data").iterdir()) == ["0_0.pt", "1_0.pt"]

    # (d) the dashboard timeline: one line per finished phase, in wall-clock order
    events = [json.loads(line) for line in (dashboard / "timeline.jsonl").read_text().splitlines() if line.strip()]
    phases = [event["phase"] for event in events]
    assert phases.count("rollout") == 2 and phases.count("train") == 2
    assert phases.count("weight_sync") == 3  # the initial sync and one after each rollout's training
    assert all(event["end"] >= event["start"] for event in events)
    rollouts = [event for event in events if event["phase"] == "rollout"]
    trains = [event for event in events if event["phase"] == "train"]
    assert all(rollout["end"] <= train["start"] for rollout, train in zip(rollouts, trains))
