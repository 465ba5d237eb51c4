"""What a person looks at: each eval's image grid and reward components under <output-dir>/eval/<rollout_id>/,
and the TensorBoard sink of the run logger."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
import torch
from PIL import Image

from miles.logging.plots import save_eval_grid
from miles.logging.run_logger import RunLogger
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.eval_config import EvalDataset
from miles.types import Sample

from test_run_logger import make_args


def _groups(num_groups: int, group_size: int, frames: int = 1) -> list[list[Sample]]:
    return [[Sample(prompt=f"prompt {g}", group_index=g, reward={"ocr": 0.5, "pickscore": float(g + i)},
                    image=torch.full((frames, 4, 6, 3), 40 * g + i, dtype=torch.uint8))
             for i in range(group_size)] for g in range(num_groups)]


def test_eval_grid_has_a_row_per_prompt_and_the_first_frame_of_videos(tmp_path):
    groups = _groups(3, 2, frames=5)
    for group in groups:
        for sample in group:
            sample.image[1:] = 255  # later frames differ: the grid must show frame 0
    path = save_eval_grid(groups, str(tmp_path / "eval" / "7"), "colors")
    pixels = np.asarray(Image.open(path))
    scale = 128 // 6
    assert pixels.shape == (3 * 4 * scale, 2 * 6 * scale, 3)
    assert pixels[0, 0, 0] == 0 and pixels[2 * 4 * scale, 6 * scale, 0] == 81  # group 2, sample 1
    rows = [json.loads(line) for line in (tmp_path / "eval" / "7" / "colors.jsonl").read_text().splitlines()]
    assert rows[2] == {"row": 2, "prompt": "prompt 2", "rewards": [{"ocr": 0.5, "pickscore": 2.0},
                                                                   {"ocr": 0.5, "pickscore": 3.0}]}
    assert save_eval_grid([[Sample(prompt="no image")]], str(tmp_path), "empty") is None


def test_eval_logs_reward_components_and_writes_the_grid(tmp_path):
    manager = object.__new__(RolloutManager)
    manager.config = make_args(tmp_path)
    manager.run_logger = RunLogger(manager.config)
    manager.hooks = Namespace(eval_function=lambda args, rollout_id, dataset, evaluation: _groups(2, 2),
                              eval_rollout_log=None)
    manager.eval_datasets = [EvalDataset(name="set", path="unused", reward_weights={"ocr": 1.0, "pickscore": 0.5})]
    metrics = manager.eval(3)
    assert metrics["eval/set/reward_mean"] == pytest.approx(0.5 + 0.5 * (0 + 1 + 1 + 2) / 4)
    assert metrics["eval/set/reward/pickscore_mean"] == 1.0 and metrics["eval/set/reward/ocr_std"] == 0.0
    assert (tmp_path / "out" / "eval" / "3" / "set.png").is_file()
    record = manager.run_logger.flush(3)
    assert record["eval/set/reward/pickscore_std"] == pytest.approx(np.std([0, 1, 1, 2], ddof=1))


def test_tensorboard_gets_every_scalar_at_the_rollout_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger(make_args(tmp_path, use_tensorboard=True))
    for rollout_id, reward in ((0, 0.25), (1, 0.75)):
        logger.log(rollout_id, {"rollout/reward_mean": reward, "rollout/reward/ocr_mean": reward / 2})
        logger.flush(rollout_id)
    logger.finish()
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.75)]
    assert [e.value for e in events.Scalars("rollout/reward/ocr_mean")] == [0.125, 0.375]


def test_tensorboard_gets_the_sample_grid_each_time_it_is_drawn(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from test_run_logger import make_sample

    logger = RunLogger(make_args(tmp_path, use_tensorboard=True, plot_interval=2))
    for rollout_id in range(4):
        logger.log(rollout_id, {"rollout/reward_mean": 0.1})
        logger.log_samples(rollout_id, [make_sample(30 + rollout_id)])
        logger.flush(rollout_id)
    logger.finish()
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    grid = Image.open(tmp_path / "out" / "samples.png")
    # drawn after rollouts 1 and 3 (--plot-interval 2) and once more at the end
    assert [(e.step, e.width, e.height) for e in events.Images("samples")] == [(1, *grid.size), (3, *grid.size),
                                                                             (3, *grid.size)]


def test_an_edit_eval_grid_shows_each_input_image_beside_its_edit(tmp_path):
    Image.new("RGB", (6, 4), (0, 0, 250)).save(tmp_path / "input.png")
    groups = _groups(1, 2)
    for sample in groups[0]:
        sample.input_image = str(tmp_path / "input.png")
    pixels = np.asarray(Image.open(save_eval_grid(groups, str(tmp_path / "eval"), "edits")))
    scale = 128 // 12  # each tile is 12 px wide now: input and edit
    assert pixels.shape == (4 * scale, 2 * 12 * scale, 3)
    assert tuple(pixels[0, 0]) == (0, 0, 250) and pixels[0, 6 * scale, 0] == 0  # input, then the edit (value 0)
