"""FLUX.1-dev (embedded guidance, no CFG batch), Flow-GRPO with LoRA against PickScore."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="flux_pickscore",
    model_path="black-forest-labs/FLUX.1-dev",
    prompt_data=os.path.join(PROMPTS, "pickscore.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "flux", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
                    "--diffusion-num-steps", "16", "--diffusion-guidance-scale", "3.5",
                    "--diffusion-height", "512", "--diffusion-width", "512", "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(rank=64, alpha=128), "--micro-batch-size", "8"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=500, eval_interval=50, save_interval=50),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
