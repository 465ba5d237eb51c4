"""LTX-Video 0.9 text-to-video (41 frames), Flow-GRPO with LoRA; PickScore on sampled frames."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="ltx_video",
    model_path="Lightricks/LTX-Video",
    prompt_data=os.path.join(PROMPTS, "video.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "ltx", "--diffusion-forward-dtype", "bf16", "--rollout-patch-group", "ltx"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
                    "--diffusion-num-steps", "20", "--diffusion-guidance-scale", "3.0",
                    "--diffusion-height", "512", "--diffusion-width", "768", "--diffusion-output-num-frames", "41",
                    "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "4"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
