"""SD3.5-Medium, Flow-GRPO with LoRA against PickScore (the flow_grpo setup), one node, colocated, fast mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main  # noqa: E402

RECIPE = Recipe(
    name="sd35m_pickscore",
    model_path="stabilityai/stable-diffusion-3.5-medium",
    prompt_data=os.path.join(PROMPTS, "pickscore.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "sd3", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
                    "--diffusion-num-steps", "10", "--diffusion-guidance-scale", "4.5",
                    "--diffusion-height", "512", "--diffusion-width", "512"],
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "8"],
        "reward": PICKSCORE,
        "performance": FAST,
        "checkpoints": ["--save-interval", "20"],
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
