"""The one-process held-out score equals train_diffusion.py's eval on the same weights (same seeds), and the
report draws a run's curve and grid."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from miles.tasks.shapes import PRETRAINED_SD3
from miles.tasks.shapes.data import write_prompt_files
from miles.tasks.shapes.evaluate import heldout_score, load_pipeline, read_scenes
from miles.tasks.shapes.report import save_curve, save_grid


def test_heldout_score_is_deterministic_and_the_grid_and_curve_are_drawn(tmp_path):
    _, heldout = write_prompt_files(str(tmp_path))
    scenes = read_scenes(heldout)[:3]
    family, pipe = load_pipeline(PRETRAINED_SD3)
    first = heldout_score(family, pipe, scenes, num_steps=4, samples_per_prompt=2, size=32)
    second = heldout_score(family, pipe, scenes, num_steps=4, samples_per_prompt=2, size=32)
    assert first.images.shape == (6, 32, 32, 3) and np.array_equal(first.images, second.images)
    assert 0.0 <= first.correct <= 1.0 and first.dense == second.dense
    grid = Image.open(save_grid(str(tmp_path / "grid.png"), scenes, first.images.numpy(), second.images.numpy(), 2))
    assert grid.width > 4 * 64 and grid.height > 3 * 64
    rows = [{"rollout_id": r, "eval/heldout/reward/shapes_correct_mean": s, "eval/heldout/reward/shapes_mean": s}
            for r, s in ((0, 0.2), (4, 0.3))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert Image.open(save_curve(str(tmp_path))).width > 0
