"""What a `shapes` run learned: the held-out score before and after, its curve, and a captioned before/after grid.

    python -m miles.tasks.shapes.report --run outputs/quickstart --base miles/tasks/shapes/pretrained/sd3 \
        --prompts outputs/quickstart/data/heldout.jsonl

Reads `<run>/metrics.jsonl` (the `eval/heldout/reward/shapes_correct_mean` and `.../shapes_mean` series that
`train_diffusion.py` logs with `--eval-prompt-data heldout ...`), writes `<run>/heldout_curve.png`, and samples
the first `--grid-prompts` held-out prompts with the base model and with the run's last export
(`<run>/export/iter_*`, written by `--export-interval`) from the same noise seeds, into `<run>/before_after.png`:
one row per prompt, its caption above, the base's samples on the left and the trained model's on the right, each
framed green when the scorer calls it correct and red when not.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image, ImageDraw

from miles.tasks.shapes.evaluate import heldout_score, load_pipeline, read_scenes
from miles.tasks.shapes.score import score_scene

CORRECT_KEY = "eval/heldout/reward/shapes_correct_mean"
DENSE_KEY = "eval/heldout/reward/shapes_mean"
TILE = 96  # pixels per sample in the grid
CAPTION = 14
FRAME = 3


def heldout_series(run_dir: str, key: str = CORRECT_KEY) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    return [(row["rollout_id"], row[key]) for row in rows if key in row]


def save_curve(run_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.2))
    for key, label in ((CORRECT_KEY, "correct (0/1, GenEval rule)"), (DENSE_KEY, "dense partial score")):
        points = heldout_series(run_dir, key)
        if points:
            axis.plot(*zip(*points), marker="o", label=label)
    axis.set_xlabel("rollout")
    axis.set_ylabel("held-out score")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper right")
    figure.tight_layout()
    path = os.path.join(run_dir, "heldout_curve.png")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def latest_export(run_dir: str) -> str:
    folder = os.path.join(run_dir, "export")
    exports = sorted(name for name in os.listdir(folder) if name.startswith("iter_")) if os.path.isdir(folder) else []
    if not exports:
        raise SystemExit(f"error: no export under {folder}; run train_diffusion.py with --export-interval")
    return os.path.join(folder, exports[-1])


def _tile(image: np.ndarray, correct: bool) -> Image.Image:
    tile = Image.new("RGB", (TILE, TILE), (40, 160, 60) if correct else (200, 50, 50))
    tile.paste(Image.fromarray(image).resize((TILE - 2 * FRAME, TILE - 2 * FRAME), Image.NEAREST), (FRAME, FRAME))
    return tile


def save_grid(path: str, scenes, before: np.ndarray, after: np.ndarray, samples: int) -> str:
    """One row per scene: the caption, then `samples` before-tiles, a gap, `samples` after-tiles."""
    gap = TILE // 3
    width = 2 * samples * TILE + gap
    header = CAPTION + 6
    canvas = Image.new("RGB", (width, header + len(scenes) * (TILE + CAPTION + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 2), "before (pretrained base)", fill=(0, 0, 0))
    draw.text((samples * TILE + gap + 4, 2), "after (trained)", fill=(0, 0, 0))
    for row, (prompt, scene) in enumerate(scenes):
        top = header + row * (TILE + CAPTION + 4)
        draw.text((4, top), prompt, fill=(0, 0, 0))
        for column in range(samples):
            for offset, images in ((0, before), (samples * TILE + gap, after)):
                image = images[row * samples + column]
                canvas.paste(_tile(image, score_scene(scene, image).correct == 1.0),
                             (offset + column * TILE, top + CAPTION))
    canvas.save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the run's --output-dir")
    parser.add_argument("--base", required=True, help="the checkpoint the run started from")
    parser.add_argument("--prompts", required=True, help="the held-out prompt file")
    parser.add_argument("--num-steps", type=int, default=8, help="denoising steps, as the run's eval")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--grid-prompts", type=int, default=8)
    parser.add_argument("--grid-samples", type=int, default=2)
    args = parser.parse_args()
    points, dense = heldout_series(args.run), heldout_series(args.run, DENSE_KEY)
    if len(points) < 2:
        raise SystemExit(f"error: {args.run}/metrics.jsonl has {len(points)} held-out evals; need one before and one "
                         "after training (--eval-interval, and no --skip-eval-before-train)")
    scenes = read_scenes(args.prompts)[:args.grid_prompts]
    images = []
    for checkpoint in (args.base, latest_export(args.run)):
        family, pipe = load_pipeline(checkpoint)
        images.append(heldout_score(family, pipe, scenes, num_steps=args.num_steps,
                                    samples_per_prompt=args.grid_samples, size=args.size).images.numpy())
    grid = save_grid(os.path.join(args.run, "before_after.png"), scenes, *images, args.grid_samples)
    print(f"curve: {save_curve(args.run)}")
    print(f"grid:  {grid}")
    print(f"held-out score (correct, GenEval rule): {points[0][1]:.3f} before -> {points[-1][1]:.3f} after "
          f"{points[-1][0]} rollouts (dense: {dense[0][1]:.3f} -> {dense[-1][1]:.3f})")


if __name__ == "__main__":
    main()
