"""LTX-2 text-to-video (+ audio, frozen; 41 frames), Flow-GRPO with CPS steps and LoRA; PickScore on sampled frames.

LTX-2 runs without CFG (guidance 1.0, as the reference trains it) and with the CPS kernel, the family's
recommended step (docs/models.md, ltx); the video attention is trained, the audio branch stays frozen.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

FLOW_GRPO_CPS = ["--loss-type", "policy_loss", "--diffusion-sde-type", "cps", "--diffusion-noise-level", "0.7",
                 "--diffusion-kl-beta", "0.01", "--globalize-reward-std"]

RECIPE = Recipe(
    name="ltx2_video",
    model_path="Lightricks/LTX-2",
    prompt_data=os.path.join(PROMPTS, "video.jsonl"),
    blocks={
        "model": ["--diffusion-model-family", "ltx", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
                    "--diffusion-num-steps", "20", "--diffusion-guidance-scale", "1.0", "--diffusion-fps", "24",
                    "--diffusion-height", "512", "--diffusion-width", "768", "--diffusion-output-num-frames", "41",
                    "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO_CPS, *lora(), "--micro-batch-size", "4"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
