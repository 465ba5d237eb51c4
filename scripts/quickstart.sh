#!/usr/bin/env bash
# Set up ./.venv, build a tiny random-weight SD3 pipeline offline, and train it on CPU with Flow-GRPO
# against the built-in brightness reward. Outputs (metrics.jsonl, reward_curve.png, samples.png) go to
# outputs/quickstart/. Extra flags are passed to train_diffusion.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
OUT=outputs/quickstart
mkdir -p "$OUT"
.venv/bin/python -m miles.testing.make_tiny --family sd3 --out "$OUT/tiny-sd3" >/dev/null
.venv/bin/python -m miles.testing.make_prompts --out "$OUT/prompts.jsonl"
rm -f "$OUT/metrics.jsonl"
exec .venv/bin/python train_diffusion.py \
  --hf-checkpoint "$OUT/tiny-sd3" --diffusion-model-family sd3 \
  --prompt-data "$OUT/prompts.jsonl" --rm-type brightness \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --num-gpus-per-node 1 --colocate \
  --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 \
  --num-rollout 30 --diffusion-num-steps 4 --diffusion-height 32 --diffusion-width 32 \
  --diffusion-guidance-scale 1.0 --diffusion-noise-level 0.9 --diffusion-forward-dtype fp32 \
  --loss-type policy_loss --diffusion-clip-range 1e-2 --lr 2e-2 --micro-batch-size 8 \
  --output-dir "$OUT" "$@"
