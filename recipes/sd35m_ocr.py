"""SD3.5-Medium, Flow-GRPO with LoRA against the OCR reward (render the quoted text): flow_grpo's general_ocr_sd3
setup (KL 0.04; recipes/README.md maps each of its keys), one node, colocated."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLOCATED, FAST, FLOW_GRPO, OCR, PROMPTS, REFERENCE_OPTIMIZER, SD35M_FLOW_GRPO_STEPS, SD35M_MODEL, SD35M_ROLLOUT,
    Recipe, lora, main, schedule,
)

RECIPE = Recipe(
    name="sd35m_ocr",
    model_path="stabilityai/stable-diffusion-3.5-medium",
    prompt_data=os.path.join(PROMPTS, "ocr.jsonl"),
    blocks={
        "model": SD35M_MODEL,
        "placement": COLOCATED,
        "rollout": [*SD35M_ROLLOUT, *SD35M_FLOW_GRPO_STEPS],
        "algorithm": [*FLOW_GRPO, "--diffusion-kl-beta", "0.04", *lora(rank=32, alpha=64, lr="3e-4"),
                      *REFERENCE_OPTIMIZER, "--micro-batch-size", "8"],
        "reward": OCR,
        "performance": FAST,
        "schedule": schedule(num_rollout=1000, eval_interval=60, save_interval=60),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
