"""`python -m miles.testing.make_tiny` builds offline; a fresh offline process reloads and samples from it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

OFFLINE_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",  # tiny models on a shared 2-core machine
}

RELOAD_AND_SAMPLE = textwrap.dedent(
    """
    import argparse, sys, torch
    from miles.models.base import GenerationShape
    from miles.models.common import build_train_pipeline_config
    from miles.testing.reference_loop import sample_reference
    from miles.types import GuidanceConfig

    for path in sys.argv[1:]:
        args = argparse.Namespace(hf_checkpoint=path, diffusion_model_family=None,
                                  train_pipeline_config_path=None, model_backend_path=None)
        family = build_train_pipeline_config(**vars(args))
        pipe = family.load_pipeline(path, torch.float32)
        out = sample_reference(family, pipe, ["a cat"], seeds=[0], num_steps=2, shape=GenerationShape(32, 32),
                               guidance=GuidanceConfig(guidance_scale=2.0, true_cfg_scale=2.0))
        assert out.images.dtype == torch.uint8 and out.images.shape == (1, 1, 32, 32, 3), out.images.shape
        print(family.family, "ok")
    """
)


def folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def test_cli_builds_offline_and_a_fresh_process_reloads(tmp_path, tiny_checkpoint):
    out_dir = tmp_path / "tiny-sd3"
    built = subprocess.run(
        [sys.executable, "-m", "miles.testing.make_tiny", "--family", "sd3", "--out", str(out_dir)],
        env=OFFLINE_ENV, capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.strip().splitlines()[-1] == str(out_dir)
    assert (out_dir / "model_index.json").is_file() and folder_size(str(out_dir)) < 5 * 2**20

    # Fixed seed: the CLI build has the same weights as the session fixture's in-process build.
    fixture_dir = tiny_checkpoint("sd3")
    for component in ("transformer", "vae"):
        ours = load_file(str(out_dir / component / "diffusion_pytorch_model.safetensors"))
        theirs = load_file(os.path.join(fixture_dir, component, "diffusion_pytorch_model.safetensors"))
        assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)

    paths = [str(out_dir), tiny_checkpoint("flux"), tiny_checkpoint("qwen_image")]
    for path in paths[1:]:
        assert folder_size(path) < 5 * 2**20
    reloaded = subprocess.run(
        [sys.executable, "-c", RELOAD_AND_SAMPLE, *paths], env=OFFLINE_ENV, capture_output=True, text=True,
        timeout=120,
    )
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
    assert reloaded.stdout.split() == ["sd3", "ok", "flux", "ok", "qwen_image", "ok"]


def test_unknown_family_is_rejected(tmp_path):
    from miles.testing.make_tiny import build_tiny_pipeline

    with pytest.raises(ValueError, match="no tiny builder for family 'sd4'"):
        build_tiny_pipeline("sd4", str(tmp_path / "x"))
