"""What every recipe shares: its fields (overridable from the environment), its named flag blocks, and the launch.

A recipe is a small script (`recipes/<name>.py`) that fills a `Recipe`: the model, the prompt set and named
blocks of `train_diffusion.py` flags (model, rollout, algorithm, reward, performance, ...). Running it joins the
blocks into one command and starts it:

    python recipes/sd35m_pickscore.py                          # this machine (Ray starts inside the run)
    MILES_SCRIPT_NUM_GPUS=4 python recipes/sd35m_pickscore.py  # any field from the environment
    python recipes/sd35m_pickscore.py --dry-run --lr 1e-4      # extra flags are appended (the last one wins)
    MILES_SCRIPT_EXTERNAL_RAY=1 RAY_ADDRESS=http://head:8265 python recipes/sd35m_pickscore.py
                                                               # a running Ray cluster, through `ray job submit`

Fields (environment variable `MILES_SCRIPT_<FIELD>`): MODEL_PATH, PROMPT_DATA, NUM_GPUS, OUTPUT_DIR, SAVE_DIR,
EXTERNAL_RAY (1: submit to the cluster at $RAY_ADDRESS instead of starting Ray), DRY_RUN (1: add --dry-run),
EXTRA_ARGS (more flags, shell-quoted).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, fields

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(REPO_ROOT, "recipes", "prompts")
ENV_PREFIX = "MILES_SCRIPT_"


@dataclass
class Recipe:
    name: str
    model_path: str
    prompt_data: str
    blocks: dict[str, list[str]] = field(default_factory=dict)  # block name -> flags, joined in order
    num_gpus: int = 8
    output_dir: str = ""
    save_dir: str = ""
    external_ray: bool = False
    dry_run: bool = False
    extra_args: str = ""

    def with_environment(self, environ: dict[str, str]) -> "Recipe":
        """A copy with every field that `MILES_SCRIPT_<FIELD>` sets, converted to the field's type."""
        values = {}
        for f in fields(self):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or f.name in ("name", "blocks"):
                continue
            if f.type in ("bool", bool):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            else:
                values[f.name] = raw
        return Recipe(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **values})

    def flags(self) -> list[str]:
        """The whole `train_diffusion.py` command line: the fields' flags, then every block in order."""
        output_dir = self.output_dir or os.path.join("outputs", self.name)
        argv = [
            "--hf-checkpoint", self.model_path, "--prompt-data", self.prompt_data,
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(self.num_gpus),
            "--num-gpus-per-node", str(self.num_gpus), "--output-dir", output_dir,
        ]
        save_dir = self.save_dir or os.path.join("checkpoints", self.name)
        argv += ["--save", save_dir, "--load", save_dir]  # --load == --save: resume when a checkpoint is there
        for block in self.blocks.values():
            argv += block
        argv += shlex.split(self.extra_args)
        if self.dry_run:
            argv.append("--dry-run")
        return argv

    def command(self, python: str = sys.executable) -> list[str]:
        """The process to start: the entry point here, or `ray job submit` to an external cluster."""
        entry = [python, os.path.join(REPO_ROOT, "train_diffusion.py"), *self.flags()]
        if not self.external_ray:
            return entry
        if not os.environ.get("RAY_ADDRESS"):
            raise SystemExit(f"{ENV_PREFIX}EXTERNAL_RAY=1 needs RAY_ADDRESS (the cluster's dashboard address)")
        return ["ray", "job", "submit", "--working-dir", REPO_ROOT, "--",
                "python", "train_diffusion.py", *self.flags()]


def main(recipe: Recipe, argv: list[str] | None = None) -> int:
    """Run the recipe with the environment's fields and `argv` appended; returns the exit code."""
    recipe = recipe.with_environment(dict(os.environ))
    extra = sys.argv[1:] if argv is None else argv
    if extra:
        recipe.extra_args = " ".join([recipe.extra_args, *map(shlex.quote, extra)]).strip()
    command = recipe.command()
    print("+", " ".join(map(shlex.quote, command)), flush=True)
    return subprocess.call(command, cwd=REPO_ROOT)


# ---- blocks several recipes share -----------------------------------------------------------------------------
def lora(rank: int = 32, alpha: int = 64, lr: str = "3e-4") -> list[str]:
    return ["--use-lora", "--lora-rank", str(rank), "--lora-alpha", str(alpha), "--lr", lr]


# docs/quickstart.md's fast GPU mode: both sides compiled, bitwise on-policy (the batch_invariant group's opaque kernels)
FAST = ["--fsdp-torch-compile", "--sglang-enable-torch-compile"]
COLOCATED = ["--colocate"]
PICKSCORE = ["--rm-type", "pickscore", "--pickscore-model-path", "yuvalkirstain/PickScore_v1",
             "--pickscore-processor-path", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"]
OCR = ["--rm-type", "ocr"]
FLOW_GRPO = ["--loss-type", "policy_loss", "--diffusion-sde-type", "sde", "--diffusion-noise-level", "0.7",
             "--diffusion-kl-beta", "0.01", "--globalize-reward-std"]
# SD3.5-Medium at 512², 16 prompts × 8 samples, one optimizer step per rollout: the three sd35m recipes' base
SD35M_MODEL = ["--diffusion-model-family", "sd3", "--diffusion-forward-dtype", "bf16"]
SD35M_ROLLOUT = ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
                 "--diffusion-num-steps", "10", "--diffusion-guidance-scale", "4.5",
                 "--diffusion-height", "512", "--diffusion-width", "512"]
