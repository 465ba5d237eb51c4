"""Seeding and `--deterministic-mode`.

Every rank seeds python, numpy and torch from `--seed` (the same value on every rank, so that randomly
initialised parameters such as LoRA A matrices agree before they are sharded). `--deterministic-mode` also turns
on `torch.use_deterministic_algorithms` and the cuBLAS workspace setting it requires; two identical runs then
give bitwise identical losses and weights (the per-pair noises of NFT/SFT are seeded explicitly, see
train_data.py).
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def apply_deterministic_mode(seed: int, deterministic_mode: bool) -> None:
    """Seed from `--seed`; with `--deterministic-mode` make every kernel deterministic (call before CUDA work)."""
    seed_everything(seed)
    if not deterministic_mode:
        return
    # cuBLAS needs a fixed workspace to be deterministic; it reads the variable at handle creation.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    os.environ.setdefault("NCCL_ALGO", "Ring")  # fixed reduction order across runs
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    logger.info("deterministic mode: deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG=%s", CUBLAS_WORKSPACE)


def rng_state() -> dict:
    """Every RNG a rank draws from (python, numpy, torch CPU, CUDA when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def pair_generator(seed: int, rollout_id: int, sample_index: int, step_index: int, device="cpu") -> torch.Generator:
    """A generator for one train pair's fresh noise (NFT/SFT forward noising, docs/algorithms.md §6–§7).

    Seeded from (seed, rollout id, sample index, step index) rather than (micro-batch id, dp rank), so the
    noise of a pair does not depend on how pairs are dealt or batched: DP = 2 equals DP = 1.
    """
    mixed = (seed * 1_000_003 + rollout_id * 10_007 + sample_index * 101 + step_index) % (2**63 - 1)
    generator = torch.Generator(device=device)
    generator.manual_seed(mixed)
    return generator
