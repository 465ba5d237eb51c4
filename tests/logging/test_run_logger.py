"""RunLogger: the metrics JSONL, phase timings, the dashboard timeline, the final plots and wandb (offline)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config.sections import RunConfig
from miles.logging import run_logger as run_logger_module
from miles.logging.run_logger import RunLogger
from miles.testing.config import trainer_config
from miles.types import Sample

from test_plots import plotted_lines  # noqa: F401 - the fixture


def make_args(tmp_path: Path, **overrides) -> RunConfig:
    """A run logging to tmp_path, with the flags' declared defaults otherwise."""
    values = dict(output_dir=str(tmp_path / "out"), miles_dashboard_workspace=str(tmp_path / "dashboard"))
    values.update(overrides)
    return trainer_config(**values)


def make_sample(value: int, num_frames: int = 1, size: int = 8) -> Sample:
    return Sample(prompt=f"prompt {value}", image=torch.full((num_frames, size, size, 3), value, dtype=torch.uint8))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FakeClock:
    """Stands in for time.perf_counter: each call returns the next scripted reading."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


# ---- the metrics JSONL --------------------------------------------------------------------------------------
def test_flush_writes_one_json_line_per_rollout(tmp_path):
    logger = RunLogger(make_args(tmp_path))
    logger.log(0, {"rollout/reward_mean": torch.tensor(0.25), "rollout/num_samples": 16, "train/loss": 1.5})
    first = logger.flush(0)
    logger.log(1, {"rollout/reward_mean": 0.75})
    logger.flush(1)

    lines = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [line["rollout_id"] for line in lines] == [0, 1]
    assert lines[0] == first
    assert lines[0]["rollout/reward_mean"] == 0.25 and lines[0]["rollout/num_samples"] == 16.0
    assert lines[0]["train/loss"] == 1.5
    assert "train/loss" not in lines[1]  # each line holds only its own rollout's metrics
    assert lines[1]["rollout/reward_mean"] == 0.75
    assert all(isinstance(line["time"], float) for line in lines)
    assert logger.history == lines


def test_metrics_path_overrides_the_default(tmp_path):
    path = tmp_path / "elsewhere" / "nested" / "m.jsonl"
    logger = RunLogger(make_args(tmp_path, metrics_path=str(path)))
    logger.log(0, {"rollout/reward_mean": 0.5})
    logger.flush(0)
    assert read_jsonl(path)[0]["rollout/reward_mean"] == 0.5
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_nan_and_non_numeric_metrics_are_dropped(tmp_path):
    logger = RunLogger(make_args(tmp_path))
    logger.log(0, {
        "train/loss": float("nan"),
        "train/grad_norm": torch.tensor(float("nan")),
        "train/lr": 1e-3,
        "rollout/note": "not a number",
        "rollout/list": [1.0, 2.0],
    })
    record = logger.flush(0)
    text = (tmp_path / "out" / "metrics.jsonl").read_text()
    assert "NaN" not in text  # the line stays strict JSON
    assert set(record) == {"rollout_id", "time", "train/lr"}


# ---- phases and the dashboard timeline ----------------------------------------------------------------------
def test_phase_times_are_summed_per_rollout(tmp_path, monkeypatch):
    logger = RunLogger(make_args(tmp_path))
    # rollout 0: weight_sync 2.0 s twice (summed), train 0.5 s; rollout 1: train 0.25 s, raising
    clock = FakeClock(0.0, 2.0, 10.0, 12.0, 20.0, 20.5, 21.0, 21.0, 30.0, 30.25, 31.0, 31.0)  # (flush start, end)
    monkeypatch.setattr(run_logger_module.time, "perf_counter", clock)
    for _ in range(2):
        with logger.phase("weight_sync"):
            pass
    with logger.phase("train"):
        pass
    first = logger.flush(0)
    with pytest.raises(RuntimeError):
        with logger.phase("train"):
            raise RuntimeError("a failed phase is still timed")
    second = logger.flush(1)

    assert first["perf/weight_sync_time"] == 4.0 and first["perf/train_time"] == 0.5
    assert second["perf/train_time"] == 0.25 and "perf/weight_sync_time" not in second


def test_every_second_of_an_iteration_is_accounted_for(tmp_path, monkeypatch):
    logger = RunLogger(make_args(tmp_path), started_at=0.0)
    clock = FakeClock(
        5.0,  # begin_iteration: 5 s of start-up
        5.0, 7.0,  # rollout
        7.5, 8.0, 8.5, 9.5,  # train, with a nested phase counted once
        10.0, 10.25,  # flush: 5 s iteration, 4 s in phases, 1 s unaccounted (7.0 -> 7.5 and 9.5 -> 10.0)
        10.5,  # begin_iteration: its clock started at the last flush's start (10.0)
        10.5, 12.5,  # rollout
        12.5, 12.5,  # flush
    )
    monkeypatch.setattr(run_logger_module.time, "perf_counter", clock)
    logger.begin_iteration()
    with logger.phase("rollout"):
        pass
    with logger.phase("train"):
        with logger.phase("train_step"):
            pass
    first = logger.flush(0)
    logger.begin_iteration()
    with logger.phase("rollout"):
        pass
    second = logger.flush(1)

    assert first["perf/startup_time"] == 5.0
    assert first["perf/iteration_time"] == 5.0 and first["perf/unaccounted_time"] == 1.0
    assert first["perf/train_step_time"] == 0.5 and first["perf/train_time"] == 2.0
    # the previous flush's writing and the gap before this iteration are phases of the next record
    assert second["perf/log_time"] == 0.25 and second["perf/between_iterations_time"] == 0.25
    assert second["perf/iteration_time"] == 2.5 and second["perf/unaccounted_time"] == 0.0
    assert "perf/startup_time" not in second


def test_startup_is_split_into_its_parts(tmp_path, monkeypatch):
    logger = RunLogger(make_args(tmp_path), started_at=0.0)
    clock = FakeClock(1.0, 4.0,  # startup_part("trainer_init"): 3 s
                      4.0, 6.5,  # startup_part("engines_ready"): 2.5 s
                      7.0,  # begin_iteration: 7 s of start-up
                      7.0, 7.0)  # flush
    monkeypatch.setattr(run_logger_module.time, "perf_counter", clock)
    logger.record_startup("ray", 0.75)
    with logger.startup_part("trainer_init"):
        pass
    logger.record_startup_laps("trainer_init", {"spawn": 0.5, "load": 2.0})
    with logger.startup_part("engines_ready"):
        pass
    logger.begin_iteration()
    first = logger.flush(0)
    assert first["perf/startup_time"] == 7.0
    assert first["perf/startup/ray_time"] == 0.75 and first["perf/startup/trainer_init_time"] == 3.0
    assert first["perf/startup/engines_ready_time"] == 2.5 and first["perf/startup/other_time"] == 0.75
    # a part's laps split it, with what they leave of it; they are not parts of their own
    assert first["perf/startup/trainer_init/spawn_time"] == 0.5 and first["perf/startup/trainer_init/load_time"] == 2.0
    assert first["perf/startup/trainer_init/other_time"] == 0.5


def test_dashboard_timeline_is_written_on_flush(tmp_path):
    workspace = tmp_path / "dashboard"
    logger = RunLogger(make_args(tmp_path, use_miles_dashboard=True, miles_dashboard_workspace=str(workspace)))
    for name in ("rollout", "train", "weight_sync"):
        with logger.phase(name):
            pass
    timeline = workspace / "timeline.jsonl"
    assert not timeline.exists()  # buffered until the rollout's flush
    logger.flush(0)
    with logger.phase("rollout"):
        pass
    logger.flush(1)

    events = read_jsonl(timeline)
    assert [event["phase"] for event in events] == ["rollout", "train", "weight_sync", "rollout"]
    assert all(event["start"] <= event["end"] and isinstance(event["pid"], int) for event in events)
    assert all(a["end"] <= b["start"] for a, b in zip(events, events[1:]))


def test_no_dashboard_without_the_flag(tmp_path):
    logger = RunLogger(make_args(tmp_path))
    with logger.phase("rollout"):
        pass
    logger.flush(0)
    assert logger.timeline is None
    assert not (tmp_path / "dashboard").exists()


# ---- the pictures -------------------------------------------------------------------------------------------
def grid_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The top-left pixel of the first tile in each of the grid's two rows."""
    from miles.logging.plots import CAPTION_LINE_PIXELS

    grid = np.asarray(Image.open(path).convert("RGB"))
    top = CAPTION_LINE_PIXELS + 2
    return grid[top, 0], grid[grid.shape[0] // 2 + top, 0]


def test_finish_leaves_reward_curve_and_the_first_and_latest_samples(tmp_path):
    logger = RunLogger(make_args(tmp_path))
    for rollout_id, value in enumerate((40, 120, 200)):
        logger.log(rollout_id, {"rollout/reward_mean": value / 255})
        logger.log_samples(rollout_id, [make_sample(value), make_sample(value + 1), Sample(prompt="no image")])
        logger.flush(rollout_id)
    logger.finish()
    out = tmp_path / "out"
    assert Image.open(out / "reward_curve.png").size[0] > 0
    first, latest = grid_rows(out / "samples.png")
    assert (first == 40).all() and (latest == 200).all()
    assert (out / "samples" / "first_rollout.png").is_file()


def test_pictures_are_redrawn_every_plot_interval(tmp_path):
    logger = RunLogger(make_args(tmp_path, plot_interval=2))
    out = tmp_path / "out"
    for rollout_id in range(3):
        logger.log(rollout_id, {"rollout/reward_mean": 0.1 * rollout_id})
        logger.log_samples(rollout_id, [make_sample(10 + rollout_id)])
        logger.flush(rollout_id)
        assert (out / "samples.png").exists() == (rollout_id >= 1)  # after rollouts 1, 3, 5, ...
    assert (grid_rows(out / "samples.png")[1] == 11).all()


def test_a_resumed_run_shows_the_whole_history(tmp_path, plotted_lines):
    first_part = RunLogger(make_args(tmp_path))
    for rollout_id in range(3):
        first_part.log(rollout_id, {"rollout/reward_mean": float(rollout_id)})
        first_part.log_samples(rollout_id, [make_sample(20 + rollout_id)])
        first_part.flush(rollout_id)  # rollout 2 was not checkpointed: the resumed run trains it again
    resumed = RunLogger(make_args(tmp_path))
    resumed.resume_history(2)
    for rollout_id in (2, 3):
        resumed.log(rollout_id, {"rollout/reward_mean": 10.0 + rollout_id})
        resumed.log_samples(rollout_id, [make_sample(90 + rollout_id)])
        resumed.flush(rollout_id)
    resumed.finish()
    assert plotted_lines["rollout/reward_mean"] == ([0, 1, 2, 3], [0.0, 1.0, 12.0, 13.0])
    first, latest = grid_rows(tmp_path / "out" / "samples.png")
    assert (first == 20).all() and (latest == 93).all()  # the run's first rollout, not the resumed one's


def test_finish_writes_the_pictures_once_and_never_raises(tmp_path, monkeypatch, caplog):
    logger = RunLogger(make_args(tmp_path))
    logger.log_samples(0, [make_sample(5)])

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(run_logger_module, "stack_strips", broken)
    with caplog.at_level("ERROR"):
        logger.finish()  # on the way out of a failed run: the run's own error must stay the one reported
        logger.finish()
    assert caplog.text.count("could not write the run's pictures") == 1


def test_video_samples_become_mp4_files(tmp_path):
    av = pytest.importorskip("av")
    logger = RunLogger(make_args(tmp_path, diffusion_fps=4.0))
    logger.log_samples(0, [make_sample(value, num_frames=5, size=9) for value in (30, 60)])
    written = logger.write_pictures()
    videos = sorted((tmp_path / "out" / "videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["rollout_0000000_0.mp4", "rollout_0000000_1.mp4"]
    assert written["video 1"] == str(videos[1])
    with av.open(str(videos[0])) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (10, 10, 3)  # odd sizes padded to even for H.264
    assert abs(int(frames[2][4, 4, 0]) - 30) < 8


def test_log_samples_keeps_at_least_four_images(tmp_path):
    logger = RunLogger(make_args(tmp_path, wandb_log_num_images=2))
    logger.log_samples(0, [make_sample(value) for value in range(6)])
    assert [sample.prompt for sample in logger._latest_samples[1]] == [f"prompt {value}" for value in range(4)]


def test_finish_without_rewards_or_images_writes_nothing(tmp_path):
    logger = RunLogger(make_args(tmp_path))
    logger.log(0, {"train/loss": 1.0})
    logger.flush(0)
    logger.finish()
    assert not (tmp_path / "out" / "reward_curve.png").exists()
    assert not (tmp_path / "out" / "samples.png").exists()


def test_the_console_line_shows_each_eval_sets_reward(tmp_path, caplog):
    logger = RunLogger(make_args(tmp_path))
    logger.log(4, {"eval/val/reward_mean": 0.25, "eval/hard/reward_mean": 0.5, "eval/val/reward_std": 0.1})
    with caplog.at_level("INFO"):
        logger.flush(4)
    assert "rollout 4 | eval/hard/reward_mean=0.5 eval/val/reward_mean=0.25" in caplog.text


# ---- wandb, offline -----------------------------------------------------------------------------------------
def test_wandb_offline_gets_metrics_and_images_on_the_interval(tmp_path):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb-dir"
    args = make_args(tmp_path, use_wandb=True, wandb_mode="offline", wandb_dir=str(wandb_dir),
                     wandb_project="miles-tests", wandb_group="unit", disable_wandb_random_suffix=True,
                     wandb_log_num_images=2, wandb_log_image_interval=2)
    logger = RunLogger(args)
    try:
        assert logger.wandb is not None and logger.wandb.name == "unit"
        for rollout_id in range(3):  # images go out at rollouts 0 and 2
            logger.log(rollout_id, {"rollout/reward_mean": 0.1 * rollout_id})
            logger.log_samples(rollout_id, [make_sample(10 * rollout_id + i) for i in range(3)])
            logger.flush(rollout_id)
    finally:
        logger.finish()

    run_dirs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    # wandb's service process may still be writing the run file when finish() returns on a busy machine
    deadline = time.monotonic() + 30
    while True:
        records = b"".join(path.read_bytes() for path in run_dirs[0].glob("*.wandb"))
        if (b"rollout/reward_mean" in records and b"rollout/samples" in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert b"rollout/reward_mean" in records and b"rollout/samples" in records
    images = list((run_dirs[0] / "files" / "media").rglob("*.png"))
    # wandb_log_num_images per logged rollout, two logged rollouts, and the sample grid drawn at the end
    assert len(images) == 2 * 2 + 1 and len([p for p in images if "samples_grid" in p.name]) == 1


def test_wandb_media_for_images_and_videos():
    wandb = pytest.importorskip("wandb")
    image = RunLogger._to_wandb_media(make_sample(7))
    assert isinstance(image, wandb.Image)
    # A video becomes wandb.Video where moviepy can encode it, otherwise its first frame: never an error.
    video = RunLogger._to_wandb_media(make_sample(7, num_frames=3))
    assert isinstance(video, (wandb.Video, wandb.Image))


def test_a_video_without_moviepy_says_how_to_install_it(monkeypatch, caplog):
    wandb = pytest.importorskip("wandb")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "moviepy" else find_spec(name, *rest))

    def needs_moviepy(*args, **kwargs):
        raise wandb.Error('wandb.Video requires moviepy when passing raw data. Install with "pip install wandb[media]"')

    monkeypatch.setattr(wandb, "Video", needs_moviepy)
    with caplog.at_level("WARNING"):
        assert isinstance(RunLogger._to_wandb_media(make_sample(7, num_frames=3)), wandb.Image)
    assert "moviepy is not installed: pip install -e '.[video]' (or pip install moviepy)" in caplog.text
