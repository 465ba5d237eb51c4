"""The pictures a run leaves in its output folder: the reward curve, the captioned grid of samples, and each
eval's grids. Files are replaced atomically, so they can be watched while the run writes them."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
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
    temp = f"{path}.tmp.png"
    fig.savefig(temp)
    plt.close(fig)
    os.replace(temp, path)
    return path


# ---- the captioned sample grid ------------------------------------------------------------------------------
MIN_TILE_PIXELS = 128  # tiny models make tiny images: enlarge them to be seen
CAPTION_LINE_PIXELS = 12
CAPTION_LINES = 2
CAPTION_COLOR = (32, 32, 32)


@dataclass(frozen=True)
class Tile:
    """One sample as the grid shows it: its picture (the first frame of a video; for an editing task the input
    image and the edit side by side) and a caption."""

    pixels: np.ndarray  # uint8 [H, W, 3]
    caption: str


def sample_tile(sample: Any) -> Tile | None:
    """The grid tile of a `Sample` (None without an image): caption `reward | prompt`."""
    if sample.image is None:
        return None
    output = np.asarray(sample.image[0].cpu())
    pixels = output
    if getattr(sample, "input_image", None):
        try:
            with Image.open(sample.input_image) as source:
                given = np.asarray(source.convert("RGB").resize((output.shape[1], output.shape[0])))
            pixels = np.concatenate([given, output], axis=1)
        except OSError as err:  # the row's image was checked at start-up; a file gone since only costs the picture
            logger.debug("cannot show the input image %s beside its edit: %s", sample.input_image, err)
    return Tile(pixels, f"{reward_text(sample.reward)} | {sample.prompt}")


def reward_text(reward: Any) -> str:
    if reward is None:
        return "no reward"
    if isinstance(reward, dict):
        return " ".join(f"{key}={float(value):.3g}" for key, value in reward.items())
    return f"reward {float(reward):.3g}"


def render_strip(label: str, tiles: Sequence[Tile]) -> Image.Image:
    """One row of the grid: `label` above the tiles, each with its caption below it."""
    from PIL import ImageDraw

    height = max(t.pixels.shape[0] for t in tiles)
    scale = max(1, MIN_TILE_PIXELS // max(height, max(t.pixels.shape[1] for t in tiles)))
    widths = [t.pixels.shape[1] * scale for t in tiles]
    caption_height = CAPTION_LINES * CAPTION_LINE_PIXELS + 4
    strip = Image.new("RGB", (sum(widths), CAPTION_LINE_PIXELS + 2 + height * scale + caption_height), "white")
    draw = ImageDraw.Draw(strip)
    draw.text((2, 0), label, fill=CAPTION_COLOR)
    x = 0
    for tile, width in zip(tiles, widths):
        picture = Image.fromarray(tile.pixels)
        if scale > 1:
            picture = picture.resize((width, tile.pixels.shape[0] * scale), Image.NEAREST)
        top = CAPTION_LINE_PIXELS + 2
        strip.paste(picture, (x, top))
        for line_number, line in enumerate(_wrap(tile.caption, width)):
            draw.text((x + 2, top + height * scale + 2 + line_number * CAPTION_LINE_PIXELS), line, fill=CAPTION_COLOR)
        x += width
    return strip


def _wrap(text: str, width: int) -> list[str]:
    """The caption in at most CAPTION_LINES lines of the tile's width (the default font is ~6 px a character)."""
    per_line = max(4, width // 6)
    lines = [text[i : i + per_line] for i in range(0, len(text), per_line)][:CAPTION_LINES]
    if len(text) > per_line * CAPTION_LINES:
        lines[-1] = lines[-1][:-1] + "…"
    return lines


def stack_strips(strips: Sequence[Image.Image]) -> Image.Image | None:
    strips = [strip for strip in strips if strip is not None]
    if not strips:
        return None
    grid = Image.new("RGB", (max(s.width for s in strips), sum(s.height for s in strips)), "white")
    top = 0
    for strip in strips:
        grid.paste(strip, (0, top))
        top += strip.height
    return grid


def save_image(image: Image.Image, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp = f"{path}.tmp.png"
    image.save(temp)
    os.replace(temp, path)  # a viewer refreshing the file never sees half of it
    return path


def _save_tiles(rows: Sequence[Sequence[torch.Tensor]], path: str) -> str | None:
    """Tile the first frame of each uint8 [F, H, W, 3] image, one list per row, uncaptioned; returns the path."""
    rows = [list(row) for row in rows if row]
    if not rows:
        return None
    tiles = [[np.asarray(img[0].cpu()) for img in row] for row in rows]
    height = max(t.shape[0] for row in tiles for t in row)
    width = max(t.shape[1] for row in tiles for t in row)
    columns = max(len(row) for row in tiles)
    scale = max(1, MIN_TILE_PIXELS // max(height, width))
    canvas = np.full((len(tiles) * height, columns * width, 3), 255, dtype=np.uint8)
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            canvas[r * height : r * height + tile.shape[0], c * width : c * width + tile.shape[1]] = tile
    image = Image.fromarray(canvas)
    if scale > 1:
        image = image.resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST)
    return save_image(image, path)


EVAL_GRID_MAX_ROWS = 16
EVAL_GRID_MAX_COLUMNS = 8


def save_eval_grid(groups: Sequence[Sequence[Any]], folder: str, name: str) -> str | None:
    """`<folder>/<name>.png`: one row per eval prompt (its samples side by side, the first frame of a video, an
    edit beside its input image), at most 16 prompts x 8 samples; and `<folder>/<name>.jsonl`: each row's prompt and the rewards shown."""
    shown = [[s for s in group if s.image is not None][:EVAL_GRID_MAX_COLUMNS] for group in groups]
    shown = [row for row in shown if row][:EVAL_GRID_MAX_ROWS]
    # an editing task's tile is its input image beside the edit (sample_tile)
    tiles = [[torch.from_numpy(sample_tile(s).pixels[None].copy()) for s in row] for row in shown]
    grid = _save_tiles(tiles, os.path.join(folder, f"{name}.png"))
    if grid is None:
        return None
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
        for position, row in enumerate(shown):
            f.write(json.dumps({"row": position, "prompt": row[0].prompt, "rewards": [s.reward for s in row]}) + "\n")
    return grid
