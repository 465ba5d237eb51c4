"""Cosmos 3 text-to-image, Flow-GRPO with LoRA against PickScore."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="cosmos3_image",
    model_path="nvidia/Cosmos3-Omni",
    prompt_data=os.path.join(PROMPTS, "pickscore.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "cosmos3", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
                    "--diffusion-num-steps", "20", "--diffusion-guidance-scale", "4.0",
                    "--diffusion-height", "720", "--diffusion-width", "1280", "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "4"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=500, eval_interval=50, save_interval=50),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
