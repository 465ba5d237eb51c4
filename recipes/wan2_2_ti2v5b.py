"""Wan2.2-TI2V-5B text-to-video (33 frames), Flow-GRPO with LoRA; PickScore on sampled frames."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="wan2_2_ti2v5b",
    model_path="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    prompt_data=os.path.join(PROMPTS, "video.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "wan2_2", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
                    "--diffusion-num-steps", "20", "--diffusion-guidance-scale", "5.0",
                    "--diffusion-height", "480", "--diffusion-width", "832", "--diffusion-output-num-frames", "33",
                    "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "4", "--gradient-checkpointing"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
