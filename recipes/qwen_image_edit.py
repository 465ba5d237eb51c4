"""Qwen-Image-Edit image editing (an input image per prompt row), Flow-GRPO with LoRA and true CFG.

The reward is a placeholder: PickScore of the edited image against the edit instruction. An editing judge (a VLM
comparing the input and the edit) plugs in with --custom-rm-path; the input image's path is `sample.input_image`.
The input images are used at the output size, 1024x1024 (about the 1024² pixels the pipeline resizes them to).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="qwen_image_edit",
    model_path="Qwen/Qwen-Image-Edit",
    prompt_data=os.path.join(PROMPTS, "edits.jsonl"),  # {"input": instruction, "image": "edit_images/....png"}
    blocks={
        "model": ["--diffusion-model-family", "qwen_image_edit", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        # 2x the image tokens of Qwen-Image at that size (the input image's tokens follow the noisy ones)
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
                    "--diffusion-num-steps", "16", "--diffusion-true-cfg-scale", "4.0",
                    "--diffusion-height", "1024", "--diffusion-width", "1024", "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(rank=64, alpha=128), "--micro-batch-size", "4", "--gradient-checkpointing"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
