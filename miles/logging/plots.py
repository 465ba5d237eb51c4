"""The pictures a run leaves in its output folder: the reward curve, a grid of samples, and each eval's grids."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger(__name__)


def save_reward_curve(history: Sequence[dict[str, Any]], path: str, key: str = "rollout/reward_mean") -> str | None:
    """Plot `key` (and `eval/*reward_mean` series when present) against the rollout id; returns the path."""
    points = [(r["rollout_id"], r[key]) for r in history if key in r]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker="o", markersize=3, label=key)
    eval_keys = sorted({k for r in history for k in r if k.startswith("eval/") and k.endswith("reward_mean")})
    for eval_key in eval_keys:
        eval_points = [(r["rollout_id"], r[eval_key]) for r in history if eval_key in r]
        ex, ey = zip(*eval_points)
        ax.plot(ex, ey, marker="s", markersize=3, linestyle="--", label=eval_key)
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_sample_grid(
    first: Sequence[tuple[int, str, torch.Tensor]], last: Sequence[tuple[int, str, torch.Tensor]], path: str
) -> str | None:
    """Two rows: samples of the first rollout above samples of the last one (first frame of videos)."""
    rows = [[img for _, _, img in r] for r in (first, last) if r]
    return _save_tiles(rows, path)


def _save_tiles(rows: Sequence[Sequence[torch.Tensor]], path: str) -> str | None:
    """Tile the first frame of each uint8 [F, H, W, 3] image, one list per row; returns the path."""
    rows = [list(row) for row in rows if row]
    if not rows:
        return None
    tiles = [[np.asarray(img[0].cpu()) for img in row] for row in rows]
    height = max(t.shape[0] for row in tiles for t in row)
    width = max(t.shape[1] for row in tiles for t in row)
    columns = max(len(row) for row in tiles)
    scale = max(1, 128 // max(height, width))  # tiny models make tiny images: enlarge them to be seen
    canvas = np.full((len(tiles) * height, columns * width, 3), 255, dtype=np.uint8)
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            canvas[r * height : r * height + tile.shape[0], c * width : c * width + tile.shape[1]] = tile
    image = Image.fromarray(canvas)
    if scale > 1:
        image = image.resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    image.save(path)
    return path


EVAL_GRID_MAX_ROWS = 16
EVAL_GRID_MAX_COLUMNS = 8


def save_eval_grid(groups: Sequence[Sequence[Any]], folder: str, name: str) -> str | None:
    """`<folder>/<name>.png`: one row per eval prompt (its samples side by side, the first frame of a video), at
    most 16 prompts x 8 samples; and `<folder>/<name>.jsonl`: each row's prompt and the rewards shown."""
    shown = [[s for s in group if s.image is not None][:EVAL_GRID_MAX_COLUMNS] for group in groups]
    shown = [row for row in shown if row][:EVAL_GRID_MAX_ROWS]
    grid = _save_tiles([[s.image for s in row] for row in shown], os.path.join(folder, f"{name}.png"))
    if grid is None:
        return None
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
        for position, row in enumerate(shown):
            f.write(json.dumps({"row": position, "prompt": row[0].prompt, "rewards": [s.reward for s in row]}) + "\n")
    return grid
