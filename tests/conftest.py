"""Session-wide test setup: offline hub, tiny pipelines built once per session."""

from __future__ import annotations

import os
import secrets

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# Two cores are shared by the test process, engine subprocesses and Ray workers: one thread each is fastest
# (with two, a tiny forward can take 100x longer while the other core is busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Engines and routers refuse to run without a key: one per test session, inherited by every engine process,
# router process and Ray worker the tests start, and sent by every client (miles.utils.auth.auth_headers).
os.environ.setdefault("MILES_API_KEY", secrets.token_hex(32))

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint("sd3")` -> path of that family's tiny pipeline, built once per test session."""
    from miles.testing.make_tiny import build_tiny_pipeline

    cache_root = os.environ.get("MILES_TINY_CACHE") or str(tmp_path_factory.mktemp("tiny"))
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_tiny_pipeline(family, os.path.join(cache_root, f"tiny-{family}"))
        return built[family]

    return get
