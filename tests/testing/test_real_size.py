"""`make_tiny --real-size`: published denoiser/VAE configs with random weights, shrunk in depth for the CPU.

Each build test loads the folder back through the family's `load_pipeline`, checks that a prompt encodes to the
real conditioning shapes, that every width of the transformer and VAE is the published one, and takes one
denoising step and a decode at a small resolution (the conditioning really fits the denoiser).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.testing import real_size
from miles.testing.make_tiny import build_real_size_pipeline, main
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig

OFFLINE_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
NO_CFG = GuidanceConfig(guidance_scale=1.0)


def as_json(config: dict) -> dict:
    """A config as it reads back from config.json (tuples become lists)."""
    return json.loads(json.dumps(dict(config)))


def assert_config_matches(loaded, published: dict, shrunk: dict) -> None:
    """Every published key reads back unchanged, except the `shrunk` ones, which read back as given there."""
    expected = as_json({**published, **shrunk})
    actual = {key: loaded[key] for key in expected}
    assert actual == expected


def saved_dtypes(path: str) -> set[str]:
    with safe_open(path, framework="pt") as f:
        return {f.get_slice(name).get_dtype() for name in f.keys()}


def test_published_configs_have_the_published_sizes():
    """On the meta device (no memory, no init): the full-size denoisers and VAEs, and how the widths chain."""
    from diffusers import AutoencoderKL, AutoencoderKLWan, SD3Transformer2DModel, WanTransformer3DModel

    with torch.device("meta"):
        sd3 = SD3Transformer2DModel(**real_size.SD35_MEDIUM_TRANSFORMER)
        sd3_vae = AutoencoderKL(**real_size.SD35_MEDIUM_VAE)
        wan = WanTransformer3DModel(**real_size.WAN22_TI2V_5B_TRANSFORMER)
        wan_vae = AutoencoderKLWan(**real_size.wan22_vae_config())
    assert round(real_size.count_parameters(sd3) / 1e9, 2) == 2.24
    assert round(real_size.count_parameters(sd3_vae) / 1e6) == 84
    assert round(real_size.count_parameters(wan) / 1e9, 2) == 5.00
    assert round(real_size.count_parameters(wan_vae) / 1e6) == 705

    assert real_size.SD35_CLIP_L_WIDTH + real_size.SD35_CLIP_G_WIDTH == real_size.SD35_MEDIUM_POOLED_DIM
    assert real_size.SD35_T5_WIDTH == real_size.SD35_MEDIUM_TEXT_DIM
    assert real_size.WAN22_TI2V_5B_TRANSFORMER["in_channels"] == real_size.WAN22_VAE["z_dim"] == 48
    assert len(real_size.WAN22_VAE["latents_mean"]) == len(real_size.WAN22_VAE["latents_std"]) == 48


def test_sd3_cli_builds_sd35_medium_widths_that_load_encode_and_denoise(tmp_path):
    out_dir = tmp_path / "sd35m-2l"
    built = subprocess.run(
        [sys.executable, "-m", "miles.testing.make_tiny", "--family", "sd3", "--real-size", "--num-layers", "2",
         "--dtype", "bf16", "--out", str(out_dir)],
        env=OFFLINE_ENV, capture_output=True, text=True, timeout=240,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    lines = built.stdout.strip().splitlines()
    assert lines[-1] == str(out_dir)
    printed = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in lines[:-1]}
    assert set(printed) == {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "total"}
    assert saved_dtypes(str(out_dir / "transformer" / "diffusion_pytorch_model.safetensors")) == {"BF16"}

    family = get_family_class("sd3")()
    pipe = family.load_pipeline(str(out_dir), torch.bfloat16)
    transformer = pipe.transformer
    assert printed["transformer"] == real_size.count_parameters(transformer)
    assert_config_matches(
        transformer.config, real_size.SD35_MEDIUM_TRANSFORMER, dict(num_layers=2, dual_attention_layers=(0, 1))
    )
    assert len(transformer.transformer_blocks) == 2
    assert transformer.context_embedder.weight.shape == (1536, 4096)  # caption_projection_dim x T5 width
    assert_config_matches(pipe.vae.config, real_size.SD35_MEDIUM_VAE, {})  # 2 layers per block: not shrunk
    assert pipe.vae_scale_factor == 8
    assert (pipe.text_encoder.config.hidden_size, pipe.text_encoder.config.projection_dim) == (768, 768)
    assert (pipe.text_encoder_2.config.hidden_size, pipe.text_encoder_2.config.projection_dim) == (1280, 1280)
    assert pipe.text_encoder_3.config.d_model == 4096

    conditioning = family.encode_prompt(pipe, ["a cat on a mat"], None, NO_CFG)
    assert conditioning["prompt_embeds"].shape == (1, real_size.SD35_MEDIUM_TEXT_TOKENS, 4096) == (1, 333, 4096)
    assert conditioning["pooled_prompt_embeds"].shape == (1, 2048)

    out = sample_reference(family, pipe, ["a cat"], seeds=[0], num_steps=1, shape=GenerationShape(64, 64),
                           guidance=NO_CFG, dtype=torch.bfloat16)
    assert out.latents.shape == (1, 16, 8, 8) and torch.isfinite(out.latents).all()
    assert out.images.dtype == torch.uint8 and out.images.shape == (1, 1, 64, 64, 3)


def test_wan2_2_ti2v_5b_widths_load_encode_and_denoise(tmp_path):
    out_dir = str(tmp_path / "wan-ti2v-5b-1l")
    counts = build_real_size_pipeline("wan2_2", out_dir, num_layers=1, dtype=torch.bfloat16)
    assert set(counts) == {"transformer", "vae", "text_encoder"}

    family = get_family_class("wan2_2")()
    pipe = family.load_pipeline(out_dir, torch.bfloat16)
    assert counts == {name: real_size.count_parameters(getattr(pipe, name)) for name in counts}
    transformer = pipe.transformer
    assert_config_matches(transformer.config, real_size.WAN22_TI2V_5B_TRANSFORMER, dict(num_layers=1))
    assert len(transformer.blocks) == 1
    assert transformer.blocks[0].ffn.net[0].proj.weight.shape == (14336, 3072)  # ffn_dim x 24 heads of 128
    assert transformer.condition_embedder.text_embedder.linear_1.weight.shape == (3072, 4096)
    # The VAE keeps its channels, compression and latent statistics; only its residual blocks per level shrink.
    assert_config_matches(pipe.vae.config, real_size.WAN22_VAE, dict(num_res_blocks=1))
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (16, 4)
    # The single-expert TI2V layout: no low-noise expert, per-token timesteps.
    assert pipe.transformer_2 is None and pipe.config.expand_timesteps
    assert family.trainable_modules == ("transformer",)
    assert pipe.scheduler.config.flow_shift == real_size.WAN22_TI2V_5B_FLOW_SHIFT

    conditioning = family.encode_prompt(pipe, ["a cat on a mat"], None, NO_CFG)
    assert conditioning["prompt_embeds"].shape == (1, family.max_sequence_length, 4096) == (1, 512, 4096)

    shape = GenerationShape(32, 32, num_frames=5)  # latent [48, 2, 2, 2]: 2 frames of 1x1 patches
    out = sample_reference(family, pipe, ["a cat"], seeds=[0], num_steps=1, shape=shape, guidance=NO_CFG,
                           dtype=torch.bfloat16)
    assert out.latents.shape == (1, 48, 2, 2, 2) and torch.isfinite(out.latents).all()
    assert out.images.dtype == torch.uint8 and out.images.shape == (1, 5, 32, 32, 3)


def test_refusals(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="no real-size builder for family 'flux'"):
        build_real_size_pipeline("flux", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        build_real_size_pipeline("sd3", str(tmp_path / "x"), num_layers=0)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a pipeline"):
        build_real_size_pipeline("sd3", str(tmp_path))

    for argv, message in [
        (["--family", "sd3", "--num-layers", "2"], "--num-layers only apply with --real-size"),
        (["--family", "ltx", "--real-size"], "--real-size supports --family sd3, wan2_2, not ltx"),
    ]:
        monkeypatch.setattr(sys, "argv", ["make_tiny", "--out", str(tmp_path / "y"), *argv])
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 2 and message in capsys.readouterr().err
