"""HunyuanVideo-1.5 480p text-to-video (33 frames), Flow-GRPO with CFG and LoRA; PickScore on sampled frames."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="hunyuan_video_t2v",
    model_path="hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
    prompt_data=os.path.join(PROMPTS, "video.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "hunyuan_video", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
                    "--diffusion-num-steps", "20", "--diffusion-guidance-scale", "6.0",
                    "--diffusion-height", "480", "--diffusion-width", "848", "--diffusion-output-num-frames", "33",
                    "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "4"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
