"""SD3.5-Medium, DiffusionNFT (ODE rollouts without CFG, EMA reference and rollout policy) with LoRA against
PickScore: DiffusionNFT's sd3_pickscore setup (recipes/README.md maps each of its keys)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLOCATED, PICKSCORE, PROMPTS, REFERENCE_OPTIMIZER, SD35M_MODEL, SD35M_ROLLOUT, Recipe, lora, main, schedule,
)

RECIPE = Recipe(
    name="sd35m_nft",
    model_path="stabilityai/stable-diffusion-3.5-medium",
    prompt_data=os.path.join(PROMPTS, "pickscore.jsonl"),
    blocks={
        "model": SD35M_MODEL,
        "placement": COLOCATED,
        # DiffusionNFT samples at guidance 1.0 (no CFG) and takes one optimizer step per epoch for PickScore
        "rollout": [*SD35M_ROLLOUT, "--diffusion-guidance-scale", "1.0", "--num-steps-per-rollout", "1"],
        "algorithm": ["--loss-type", "nft", "--diffusion-sde-type", "ode", "--diffusion-noise-level", "0",
                      "--diffusion-nft-beta", "1.0", "--diffusion-nft-timestep-fraction", "0.99",
                      "--use-ema", "--ema-rollout-policy", "ema", "--globalize-reward-std",
                      *lora(rank=32, alpha=64, lr="3e-4"), *REFERENCE_OPTIMIZER, "--micro-batch-size", "8"],
        "reward": PICKSCORE,
        "performance": ["--fsdp-torch-compile", "--sglang-enable-torch-compile"],
        "schedule": schedule(num_rollout=1000, eval_interval=10, save_interval=30),
    },
)

if __name__ == "__main__":
    sys.exit(main(RECIPE))
