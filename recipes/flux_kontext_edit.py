"""FLUX.1-Kontext-dev image editing (an input image per prompt row), Flow-GRPO with LoRA.

The reward is a placeholder: PickScore of the edited image against the edit instruction. An editing judge (a VLM
comparing the input and the edit) plugs in with --custom-rm-path; the input image's path is `sample.input_image`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, FAST, FLOW_GRPO, PICKSCORE, PROMPTS, Recipe, lora, main, schedule  # noqa: E402

RECIPE = Recipe(
    name="flux_kontext_edit",
    model_path="black-forest-labs/FLUX.1-Kontext-dev",
    prompt_data=os.path.join(PROMPTS, "edits.jsonl"),  # {"input": instruction, "image": "edit_images/....png"}
    blocks={
        "model": ["--diffusion-model-family", "flux_kontext", "--diffusion-forward-dtype", "bf16"],
        "placement": COLOCATED,
        # a Kontext resolution (the input images are resized to it); 2x the tokens of FLUX.1 at that size
        "rollout": ["--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
                    "--diffusion-num-steps", "16", "--diffusion-guidance-scale", "2.5",
                    "--diffusion-height", "1024", "--diffusion-width", "1024", "--diffusion-num-sde-steps", "4"],
        "algorithm": [*FLOW_GRPO, *lora(rank=64, alpha=128), "--micro-batch-size", "4", "--gradient-checkpointing"],
        "reward": PICKSCORE,
        "performance": FAST,
        "schedule": schedule(num_rollout=300, eval_interval=30, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
