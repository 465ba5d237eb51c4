"""Prompt files of the `shapes` task, and the renderer's images as an SFT data set.

    python -m miles.tasks.shapes.data --out data/shapes [--sft-size 32 --sft-images-per-prompt 4]

writes `train.jsonl` and `heldout.jsonl` (prompt files: `{"input": prompt, "metadata": scene}`, docs/data.md)
and, with `--sft-size`, `sft.jsonl` plus `sft_images/` (the renderer's images of the train prompts, rows
`{"input": prompt, "image": path}`). Both prompt files are balanced over the four tags: up to
`PROMPTS_PER_TAG_TRAIN` train and `PROMPTS_PER_TAG_HELDOUT` held-out scenes of each (drawn from
`split_scenes`, so no held-out scene is in the train file or in the pretraining data).
"""

from __future__ import annotations

import argparse
import json
import os
import random

from PIL import Image

from miles.tasks.shapes.render import render
from miles.tasks.shapes.spec import TAGS, Scene, split_scenes

PROMPTS_PER_TAG_TRAIN = 24
PROMPTS_PER_TAG_HELDOUT = 8


def balanced(scenes: list[Scene], per_tag: int, seed: int) -> list[Scene]:
    """Up to `per_tag` scenes of each tag (a seeded choice), the tags interleaved."""
    rng = random.Random(seed)
    by_tag = {tag: [s for s in scenes if s.tag == tag] for tag in TAGS}
    chosen = {tag: rng.sample(items, min(per_tag, len(items))) for tag, items in by_tag.items()}
    rows = []
    for position in range(per_tag):
        rows += [chosen[tag][position] for tag in TAGS if position < len(chosen[tag])]
    return rows


def prompt_row(scene: Scene) -> dict:
    return {"input": scene.prompt(), "metadata": scene.to_metadata()}


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def train_and_heldout(seed: int = 0) -> tuple[list[Scene], list[Scene]]:
    train, heldout = split_scenes(seed=seed)
    return balanced(train, PROMPTS_PER_TAG_TRAIN, seed), balanced(heldout, PROMPTS_PER_TAG_HELDOUT, seed)


def write_prompt_files(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """`<out_dir>/train.jsonl` and `<out_dir>/heldout.jsonl`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    train, heldout = train_and_heldout(seed)
    return (write_jsonl(os.path.join(out_dir, "train.jsonl"), [prompt_row(s) for s in train]),
            write_jsonl(os.path.join(out_dir, "heldout.jsonl"), [prompt_row(s) for s in heldout]))


def write_sft_data(out_dir: str, size: int, images_per_prompt: int, seed: int = 0) -> str:
    """`<out_dir>/sft.jsonl` over `sft_images/`: `images_per_prompt` renders of every train prompt."""
    folder = os.path.join(out_dir, "sft_images")
    os.makedirs(folder, exist_ok=True)
    rows = []
    for index, scene in enumerate(train_and_heldout(seed)[0]):
        for copy in range(images_per_prompt):
            name = f"{index:03d}_{copy}.png"
            Image.fromarray(render(scene, size, seed=1000 * copy + index)).save(os.path.join(folder, name))
            rows.append({"input": scene.prompt(), "image": f"sft_images/{name}"})
    return write_jsonl(os.path.join(out_dir, "sft.jsonl"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0, help="the train/held-out split and the balanced choice")
    parser.add_argument("--sft-size", type=int, default=None, help="also write the SFT set at this image size")
    parser.add_argument("--sft-images-per-prompt", type=int, default=4)
    args = parser.parse_args()
    for path in write_prompt_files(args.out, args.seed):
        print(path)
    if args.sft_size:
        print(write_sft_data(args.out, args.sft_size, args.sft_images_per_prompt, args.seed))


if __name__ == "__main__":
    main()
