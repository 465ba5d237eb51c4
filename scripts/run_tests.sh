#!/usr/bin/env bash
# Set up ./.venv and run the whole CPU test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 "$@"
