"""SD3.5-Medium, DiffusionNFT (ODE rollouts, EMA reference and rollout policy) with LoRA against PickScore."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COLOCATED, PICKSCORE, PROMPTS, SD35M_MODEL, SD35M_ROLLOUT, Recipe, lora, main  # noqa: E402

RECIPE = Recipe(
    name="sd35m_nft",
    model_path="stabilityai/stable-diffusion-3.5-medium",
    prompt_data=os.path.join(PROMPTS, "pickscore.jsonl"),
    blocks={
        "model": SD35M_MODEL,
        "placement": COLOCATED,
        "rollout": SD35M_ROLLOUT,
        "algorithm": ["--loss-type", "nft", "--diffusion-sde-type", "ode", "--diffusion-noise-level", "0",
                      "--use-ema", "--ema-rollout-policy", "ema", "--globalize-reward-std",
                      *lora(lr="1e-4"), "--micro-batch-size", "8"],
        "reward": PICKSCORE,
        "performance": ["--fsdp-torch-compile", "--sglang-enable-torch-compile"],
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
