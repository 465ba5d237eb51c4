"""The held-out score of a `shapes` pipeline in one process: sample each prompt with the plain reference loop
(Euler, deterministic in the seeds) and score the images.

    python -m miles.tasks.shapes.evaluate --checkpoint miles/tasks/shapes/pretrained/sd3 --prompts heldout.jsonl

This is the number `train_diffusion.py` logs as `eval/<name>/reward/shapes_correct_mean` (the fraction of
images the scorer calls correct) and `.../shapes_mean` (the dense score), computed without Ray or an engine,
so a curve can be checked from the outside.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from miles.models.base import GenerationShape
from miles.models.common import parse_dtype
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.tasks.shapes.score import score_scene
from miles.tasks.shapes.spec import Scene, scene_from_metadata
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig


@dataclass(frozen=True)
class HeldoutScore:
    correct: float  # mean of the 0/1 scores
    dense: float
    images: torch.Tensor  # uint8 [N, H, W, 3], prompt-major (every seed of prompt 0 first)
    stray_rate: float = 0.0  # fraction of images with an object in a colour the prompt did not ask for
    correct_but_strays: float = 0.0  # the 0/1 score were those objects not there
    correct_by_tag: dict[str, float] | None = None


def read_scenes(path: str) -> list[tuple[str, Scene]]:
    """(prompt, scene) of each row of a `shapes` prompt file."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [(row["input"], scene_from_metadata(row["metadata"])) for row in rows]


def load_pipeline(path: str, dtype: torch.dtype = torch.float32):
    family = SD3TrainPipelineConfig()
    return family, family.load_pipeline(path, dtype)


@torch.no_grad()
def heldout_score(family, pipe, scenes: list[tuple[str, Scene]], *, num_steps: int, samples_per_prompt: int,
                  size: int, guidance_scale: float = 1.0, seed: int = 42, batch_size: int = 32,
                  dtype: torch.dtype = torch.float32, generator_device: str = "cpu") -> HeldoutScore:
    """Prompt i's sample j starts from the noise of seed `seed + samples_per_prompt · i + j`: the seeds of
    `train_diffusion.py`'s eval with `--rollout-seed seed` (docs/algorithms.md §3, the group's position in the
    eval set as its group index), so on the same weights both give the same images. `dtype` is the forward's
    (a pipeline loaded in it), `generator_device` where the noise is drawn (`--diffusion-generator-device`)."""
    prompts = [prompt for prompt, _ in scenes for _ in range(samples_per_prompt)]
    seeds = [seed + i for i in range(len(prompts))]
    images = []
    for start in range(0, len(prompts), batch_size):
        rows = slice(start, start + batch_size)
        output = sample_reference(family, pipe, prompts[rows], seeds=seeds[rows],
                                  num_steps=num_steps, shape=GenerationShape(size, size),
                                  guidance=GuidanceConfig(guidance_scale=guidance_scale), dtype=dtype,
                                  generator_device=generator_device)
        images.append(output.images[:, 0])
    pixels = torch.cat(images).cpu()
    scores = [score_scene(scene, pixels[i * samples_per_prompt + j].numpy())
              for i, (_, scene) in enumerate(scenes) for j in range(samples_per_prompt)]
    tags = [scene.tag for _, scene in scenes for _ in range(samples_per_prompt)]
    by_tag = {tag: sum(s.correct for s, t in zip(scores, tags) if t == tag) / tags.count(tag)
              for tag in dict.fromkeys(tags)}
    return HeldoutScore(correct=sum(s.correct for s in scores) / len(scores),
                        dense=sum(s.dense for s in scores) / len(scores), images=pixels,
                        stray_rate=sum(s.strays > 0 for s in scores) / len(scores),
                        correct_but_strays=sum(s.correct_but_strays for s in scores) / len(scores),
                        correct_by_tag=by_tag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True, help="a shapes prompt file (heldout.jsonl)")
    parser.add_argument("--num-steps", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the forward's dtype")
    parser.add_argument("--generator-device", default="cpu", help="where the noise is drawn (cpu or cuda)")
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    family, pipe = load_pipeline(args.checkpoint, dtype)
    pipe.to(args.device)
    score = heldout_score(family, pipe, read_scenes(args.prompts), num_steps=args.num_steps,
                          samples_per_prompt=args.samples_per_prompt, size=args.size,
                          guidance_scale=args.guidance_scale, dtype=dtype,
                          generator_device=args.generator_device)
    print(f"held-out correct {score.correct:.3f}  dense {score.dense:.3f}  stray rate {score.stray_rate:.3f}  "
          f"correct but strays {score.correct_but_strays:.3f}  by tag "
          + " ".join(f"{tag} {value:.2f}" for tag, value in score.correct_by_tag.items()))


if __name__ == "__main__":
    main()
