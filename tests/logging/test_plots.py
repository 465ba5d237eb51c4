"""The pictures a run leaves behind: the reward curve (with eval series) and the first/last sample grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from miles.logging.plots import save_reward_curve, save_sample_grid


@pytest.fixture
def plotted_lines(monkeypatch):
    """{label: (xs, ys)} of the last figure save_reward_curve drew, read before the figure is closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, tuple[list, list]] = {}
    close = plt.close

    def record_then_close(fig=None):
        lines.clear()
        for line in fig.axes[0].get_lines():
            lines[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()))
        close(fig)

    monkeypatch.setattr(plt, "close", record_then_close)
    return lines


def tile(color: tuple[int, int, int], num_frames: int = 1, size: int = 8) -> torch.Tensor:
    return torch.tensor(color, dtype=torch.uint8).expand(num_frames, size, size, 3).clone()


def read_rgb(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


RED, GREEN, BLUE, GRAY = (255, 0, 0), (0, 255, 0), (0, 0, 255), (90, 90, 90)


# ---- reward curve -------------------------------------------------------------------------------------------
def test_reward_curve_without_eval(tmp_path, plotted_lines):
    history = [{"rollout_id": i, "rollout/reward_mean": 0.1 * i, "train/loss": 1.0} for i in range(4)]
    path = tmp_path / "plots" / "reward_curve.png"
    assert save_reward_curve(history, str(path)) == str(path)
    assert path.exists() and Image.open(path).format == "PNG"
    assert list(plotted_lines) == ["rollout/reward_mean"]
    assert plotted_lines["rollout/reward_mean"] == ([0, 1, 2, 3], [0.0, 0.1, 0.2, 0.1 * 3])


def test_reward_curve_with_eval_series(tmp_path, plotted_lines):
    history = [
        {"rollout_id": 0, "rollout/reward_mean": 0.1, "eval/val/reward_mean": 0.2, "eval/val/reward_std": 0.01},
        {"rollout_id": 1, "rollout/reward_mean": 0.3},
        {"rollout_id": 2, "rollout/reward_mean": 0.5, "eval/val/reward_mean": 0.4, "eval/test/reward_mean": 0.6},
        {"rollout_id": 3, "eval/val/reward_mean": 0.7},  # the final eval, after the last rollout
    ]
    path = tmp_path / "reward_curve.png"
    assert save_reward_curve(history, str(path)) == str(path)
    assert path.exists()
    assert plotted_lines == {
        "rollout/reward_mean": ([0, 1, 2], [0.1, 0.3, 0.5]),
        "eval/test/reward_mean": ([2], [0.6]),
        "eval/val/reward_mean": ([0, 2, 3], [0.2, 0.4, 0.7]),
    }


def test_reward_curve_needs_the_reward_series(tmp_path):
    path = tmp_path / "reward_curve.png"
    assert save_reward_curve([], str(path)) is None
    assert save_reward_curve([{"rollout_id": 0, "train/loss": 1.0}], str(path)) is None
    assert not path.exists()


def test_reward_curve_of_another_key(tmp_path, plotted_lines):
    history = [{"rollout_id": i, "rollout/raw_reward": float(i)} for i in range(3)]
    assert save_reward_curve(history, str(tmp_path / "raw.png"), key="rollout/raw_reward")
    assert plotted_lines["rollout/raw_reward"] == ([0, 1, 2], [0.0, 1.0, 2.0])


# ---- sample grid --------------------------------------------------------------------------------------------
def test_sample_grid_first_row_above_last(tmp_path):
    first = [(0, "a", tile(RED)), (0, "b", tile(GREEN))]
    last = [(9, "a", tile(BLUE)), (9, "b", tile(GRAY))]
    path = tmp_path / "grid" / "samples.png"
    assert save_sample_grid(first, last, str(path)) == str(path)
    grid = read_rgb(path)
    assert grid.shape == (256, 256, 3)  # 2 x 2 tiles of 8 px, enlarged 16x to be seen
    assert tuple(grid[0, 0]) == RED and tuple(grid[0, 255]) == GREEN
    assert tuple(grid[128, 0]) == BLUE and tuple(grid[255, 255]) == GRAY


def test_sample_grid_with_one_row(tmp_path):
    path = tmp_path / "samples.png"
    assert save_sample_grid([], [(3, "a", tile(GREEN))], str(path)) == str(path)
    grid = read_rgb(path)
    assert grid.shape == (128, 128, 3) and (grid == GREEN).all()


def test_sample_grid_without_samples(tmp_path):
    path = tmp_path / "samples.png"
    assert save_sample_grid([], [], str(path)) is None
    assert not path.exists()


def test_sample_grid_uses_the_first_frame_of_a_video(tmp_path):
    video = tile(BLUE, num_frames=3)
    video[0] = torch.tensor(RED, dtype=torch.uint8)
    path = tmp_path / "samples.png"
    save_sample_grid([(0, "a video", video)], [], str(path))
    grid = read_rgb(path)
    assert grid.shape == (128, 128, 3) and (grid == RED).all()


def test_sample_grid_pads_uneven_rows_and_sizes_with_white(tmp_path):
    first = [(0, "a", tile(RED, size=200)), (0, "b", tile(GREEN, size=100))]
    last = [(1, "a", tile(BLUE, size=200))]
    path = tmp_path / "samples.png"
    save_sample_grid(first, last, str(path))
    grid = read_rgb(path)
    assert grid.shape == (400, 400, 3)  # large tiles are not enlarged
    assert tuple(grid[0, 0]) == RED and tuple(grid[0, 200]) == GREEN
    assert tuple(grid[150, 350]) == (255, 255, 255)  # below the smaller tile
    assert tuple(grid[200, 0]) == BLUE and tuple(grid[300, 300]) == (255, 255, 255)  # missing tile
