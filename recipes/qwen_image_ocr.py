"""Qwen-Image (true CFG), Flow-GRPO with LoRA against the OCR reward."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, OCR, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="qwen_image_ocr",
    model_path="Qwen/Qwen-Image",
    prompt_data=os.path.join(PROMPTS, "ocr.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "qwen_image", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
                    "--diffusion-num-steps", "16", "--diffusion-true-cfg-scale", "4.0",
                    "--diffusion-height", "512", "--diffusion-width", "512", "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(rank=64, alpha=128), "--micro-batch-size", "4"],
        "reward": OCR,
        "performance": FAST,
        "schedule": schedule(num_rollout=500, eval_interval=50, save_interval=50),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
