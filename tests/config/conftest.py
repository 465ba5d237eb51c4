"""The hub ids these tests name (`org/sd3-tiny`, ...) are not on disk and the tests run with HF_HUB_OFFLINE=1: a
hub cache that holds their model_index.json lets the preflight's offline check pass for them, as it would for a
downloaded model."""

from __future__ import annotations

import json

import pytest

CACHED_HUB_IDS = {"org/sd3-tiny": "StableDiffusion3Pipeline", "Wan-AI/Wan2.2-T2V-A14B": "WanPipeline"}


@pytest.fixture(scope="session")
def fake_hub_cache(tmp_path_factory) -> str:
    cache = tmp_path_factory.mktemp("hub")
    for hub_id, pipeline_class in CACHED_HUB_IDS.items():
        repo = cache / f"models--{hub_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        snapshot = repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class}))
    return str(cache)


@pytest.fixture(autouse=True)
def _cached_hub_ids(fake_hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", fake_hub_cache)  # for the entry points run as subprocesses
    monkeypatch.setattr(constants, "HF_HUB_CACHE", fake_hub_cache)
