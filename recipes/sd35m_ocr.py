"""SD3.5-Medium, Flow-GRPO with LoRA against the OCR reward (render the quoted text), one node, colocated."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, OCR, PROMPTS, SD35M_MODEL, SD35M_ROLLOUT, Recipe, lora, main  # noqa: E402

RECIPE = Recipe(
    name="sd35m_ocr",
    model_path="stabilityai/stable-diffusion-3.5-medium",
    prompt_data=os.path.join(PROMPTS, "ocr.jsonl"),
    blocks={
        "model": SD35M_MODEL,
        "placement": COLOCATED,
        "rollout": SD35M_ROLLOUT,
        "algorithm": [*FLOW_GRPO, *lora(), "--micro-batch-size", "8"],
        "reward": OCR,
        "performance": FAST,
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
