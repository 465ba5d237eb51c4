"""The pictures a run leaves behind: the reward curve (with eval series) and the captioned first/latest sample
grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from miles.logging.plots import (
    CAPTION_LINE_PIXELS,
    MIN_TILE_PIXELS,
    render_strip,
    sample_tile,
    save_image,
    save_reward_curve,
    stack_strips,
)
from miles.types import Sample


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


# ---- the captioned sample grid ------------------------------------------------------------------------------
def sample(color, prompt="a red cube", reward=0.5, num_frames=1, size=8, input_image=None) -> Sample:
    return Sample(prompt=prompt, image=tile(color, num_frames, size), reward=reward, input_image=input_image)


def test_a_strip_shows_each_sample_enlarged_with_its_caption_below(tmp_path):
    strip = np.asarray(render_strip("rollout 0 (first)", [sample_tile(sample(RED)), sample_tile(sample(GREEN))]))
    top = CAPTION_LINE_PIXELS + 2  # the row's label above the tiles
    assert strip.shape[1] == 2 * MIN_TILE_PIXELS
    assert tuple(strip[top, 0]) == RED and tuple(strip[top + MIN_TILE_PIXELS - 1, MIN_TILE_PIXELS]) == GREEN
    caption_band = strip[top + MIN_TILE_PIXELS:]
    assert (caption_band < 128).any()  # dark text on white: the caption is drawn
    assert sample_tile(sample(RED)).caption == "reward 0.5 | a red cube"
    assert sample_tile(sample(RED, reward={"ocr": 1, "pickscore": 0.25})).caption == "ocr=1 pickscore=0.25 | a red cube"
    assert sample_tile(Sample(prompt="no image")) is None


def test_a_video_tile_is_its_first_frame(tmp_path):
    video = sample(BLUE, num_frames=3)
    video.image[0] = torch.tensor(RED, dtype=torch.uint8)
    assert (sample_tile(video).pixels == RED).all()


def test_an_edit_shows_the_input_image_beside_the_output(tmp_path):
    Image.new("RGB", (20, 10), BLUE).save(tmp_path / "input.png")
    tile_ = sample_tile(sample(RED, input_image=str(tmp_path / "input.png")))
    assert tile_.pixels.shape == (8, 16, 3)  # the input resized to the output's size, on its left
    assert tuple(tile_.pixels[0, 0]) == BLUE and tuple(tile_.pixels[0, 8]) == RED


def test_strips_stack_first_above_latest_padded_with_white(tmp_path):
    first = render_strip("first", [sample_tile(sample(RED)), sample_tile(sample(GREEN))])
    latest = render_strip("latest", [sample_tile(sample(BLUE))])
    grid = stack_strips([first, None, latest])
    pixels = np.asarray(grid)
    assert grid.size == (first.width, first.height + latest.height)
    assert tuple(pixels[first.height + CAPTION_LINE_PIXELS + 2, 0]) == BLUE
    assert tuple(pixels[-1, -1]) == (255, 255, 255)
    assert stack_strips([None]) is None
    path = save_image(grid, str(tmp_path / "pictures" / "samples.png"))
    assert read_rgb(path).shape == pixels.shape and not list((tmp_path / "pictures").glob("*.tmp*"))
