"""What every recipe shares: its fields (overridable from the environment), its named flag blocks, and the launch.

A recipe is a small script (`recipes/<name>.py`) that fills a `Recipe`: the model, the prompt set and named
blocks of `train_diffusion.py` flags (model, rollout, algorithm, reward, performance, ...). Running it joins the
blocks into one command and starts it:

    python recipes/sd35m_pickscore.py                          # this machine (Ray starts inside the run)
    MILES_SCRIPT_NUM_GPUS=4 python recipes/sd35m_pickscore.py  # any field from the environment
    python recipes/sd35m_pickscore.py --dry-run --lr 1e-4      # extra flags are appended (the last one wins)
    MILES_SCRIPT_EXTERNAL_RAY=1 RAY_ADDRESS=http://head:8265 python recipes/sd35m_pickscore.py
                                                               # a running Ray cluster, through `ray job submit`

Fields (environment variable `MILES_SCRIPT_<FIELD>`): MODEL_PATH, PROMPT_DATA, EVAL_PROMPT_DATA, NUM_GPUS,
OUTPUT_DIR, SAVE_DIR, EXTERNAL_RAY (1: submit to the cluster at $RAY_ADDRESS instead of starting Ray), DRY_RUN (1: add
--dry-run), EXTRA_ARGS (more flags, shell-quoted).

Paths are taken from where the user stands: a relative PROMPT_DATA, EVAL_PROMPT_DATA, OUTPUT_DIR or SAVE_DIR (and
a MODEL_PATH that names an existing folder) is resolved against the current folder, and the run starts there.
Everything the run writes goes under OUTPUT_DIR (default `./outputs/<recipe>`): metrics, pictures, exports and,
unless SAVE_DIR says otherwise, the checkpoints (`<OUTPUT_DIR>/checkpoints`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, fields, replace

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(REPO_ROOT, "recipes", "prompts")
ENV_PREFIX = "MILES_SCRIPT_"


@dataclass
class Recipe:
    name: str
    model_path: str
    prompt_data: str
    blocks: dict[str, list[str]] = field(default_factory=dict)  # block name -> flags, joined in order
    eval_prompt_data: str = ""  # the eval set (`--eval-prompt-data <name> PATH`); default: the training prompts
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

    def resolved(self, cwd: str) -> "Recipe":
        """A copy whose paths are absolute, resolved against `cwd` (where the user stands), with the output and
        checkpoint folders filled in (`<cwd>/outputs/<name>`, `<output dir>/checkpoints`)."""
        def absolute(path: str) -> str:
            return path if not path or os.path.isabs(path) else os.path.normpath(os.path.join(cwd, path))

        output_dir = absolute(self.output_dir or os.path.join("outputs", self.name))
        model = self.model_path
        if os.path.exists(os.path.join(cwd, model)):  # a local folder, not a hub id
            model = absolute(model)
        return replace(self, model_path=model, prompt_data=absolute(self.prompt_data),
                       eval_prompt_data=absolute(self.eval_prompt_data), output_dir=output_dir,
                       save_dir=absolute(self.save_dir) or os.path.join(output_dir, "checkpoints"))

    def flags(self) -> list[str]:
        """The whole `train_diffusion.py` command line: the fields' flags, then every block in order."""
        output_dir = self.output_dir or os.path.join("outputs", self.name)
        argv = [
            "--hf-checkpoint", self.model_path, "--prompt-data", self.prompt_data,
            "--eval-prompt-data", self.name, self.eval_prompt_data or self.prompt_data,
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(self.num_gpus),
            "--num-gpus-per-node", str(self.num_gpus), "--output-dir", output_dir,
        ]
        save_dir = self.save_dir or os.path.join(output_dir, "checkpoints")
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
    cwd = os.getcwd()
    recipe = recipe.with_environment(dict(os.environ)).resolved(cwd)
    extra = sys.argv[1:] if argv is None else argv
    if extra:
        recipe.extra_args = " ".join([recipe.extra_args, *map(shlex.quote, extra)]).strip()
    command = recipe.command()
    print("+", " ".join(map(shlex.quote, command)), flush=True)
    return subprocess.call(command, cwd=REPO_ROOT if recipe.external_ray else cwd)


# ---- blocks several recipes share -----------------------------------------------------------------------------
def lora(rank: int = 32, alpha: int = 64, lr: str = "3e-4") -> list[str]:
    return ["--use-lora", "--lora-rank", str(rank), "--lora-alpha", str(alpha), "--lr", lr]


# docs/quickstart.md's fast GPU mode: both sides compiled, bitwise on-policy (the batch_invariant group's opaque kernels)
FAST = ["--fsdp-torch-compile", "--sglang-enable-torch-compile"]
COLOCATED = ["--colocate"]
PICKSCORE = ["--rm-type", "pickscore", "--pickscore-model-path", "yuvalkirstain/PickScore_v1",
             "--pickscore-processor-path", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"]
OCR = ["--rm-type", "ocr"]
# flow_grpo's SD3.5-M recipes (its config/grpo.py: pickscore_sd3, general_ocr_sd3; base.py for the rest) and
# DiffusionNFT's (config/nft.py: sd3_pickscore, sd3_ocr), one of their epochs = one rollout. recipes/README.md maps
# every key to these flags.
FLOW_GRPO = ["--loss-type", "policy_loss", "--diffusion-sde-type", "sde", "--diffusion-noise-level", "0.7",
             "--diffusion-kl-beta", "0.01", "--globalize-reward-std", "--diffusion-clip-range", "1e-4",
             "--diffusion-adv-clip-max", "5"]
REFERENCE_OPTIMIZER = ["--weight-decay", "1e-4", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
                       "--clip-grad", "1.0"]
SD35M_MODEL = ["--diffusion-model-family", "sd3", "--diffusion-forward-dtype", "bf16"]
# 48 prompts x 24 images per epoch at 512², 10 sampling steps (40 for eval), CFG 4.5
SD35M_ROLLOUT = ["--rollout-batch-size", "48", "--n-samples-per-prompt", "24",
                 "--diffusion-num-steps", "10", "--diffusion-eval-num-steps", "40", "--diffusion-guidance-scale", "4.5",
                 "--diffusion-height", "512", "--diffusion-width", "512"]
# flow_grpo: two optimizer steps per epoch (gradient_accumulation_steps = num_batches_per_epoch / 2), the first 9
# of the 10 steps trained (timestep_fraction 0.99)
SD35M_FLOW_GRPO_STEPS = ["--num-steps-per-rollout", "2", "--diffusion-num-sde-steps", "9",
                         "--diffusion-sde-window-range", "0,9"]


def schedule(num_rollout: int, eval_interval: int, save_interval: int) -> list[str]:
    """The run's length and cadence, explicit in every recipe (`--dry-run` lists each save and eval)."""
    return ["--num-rollout", str(num_rollout), "--eval-interval", str(eval_interval),
            "--save-interval", str(save_interval)]
