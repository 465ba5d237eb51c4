#!/usr/bin/env bash
# Pretrain the shipped `shapes` base (miles/tasks/shapes/pretrained/sd3) on one GPU: the `wide` size (32 px, a
# DiT of 4 blocks of width 96), 32 renders per train scene, 370 s of denoiser training under a cosine schedule.
# GPU kernels are not bitwise repeatable, so a rerun gives a close, not an identical, base (docs/shapes.md).
#   bash scripts/shapes_gpu_pretrain.sh OUT_DIR
set -euo pipefail
out=${1:?usage: shapes_gpu_pretrain.sh OUT_DIR}
python -m miles.tasks.shapes.pretrain --out "$out" --device cuda --threads 4 --size wide \
    --images-per-scene 32 --vae-steps 1500 --vae-batch-size 64 \
    --dit-steps 1000000 --batch-size 256 --dit-lr 7e-4 --lr-schedule cosine --warmup 0.03 --max-seconds 370
