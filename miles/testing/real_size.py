"""Published model configs for real-size pipelines with random weights, and timing helpers for the benchmarks.

The one place that holds the real configs: the benchmark scripts build single models from them, and
`python -m miles.testing.make_tiny --real-size` builds whole pipeline folders from them (the per-family
`build_real_size` in `miles/testing/tiny/<family>.py`).

- SD3.5-Medium: `stabilityai/stable-diffusion-3.5-medium`'s `transformer/config.json` and `vae/config.json` as
  remembered (no hub access; the parameter count, 2.24 B for the transformer, is the check).
- Wan2.2-TI2V-5B: `Wan-AI/Wan2.2-TI2V-5B-Diffusers`' `transformer/config.json` and `vae/config.json`, as
  quoted in public code that embeds them (4.9998 B and 705 M parameters); the scheduler's `flow_shift` is
  recalled (see below).

Speed does not depend on weight values, so every model here is built from its config with random weights,
on the target device (initialising 2.24 B parameters on a CPU would take minutes). Callers seed torch first.
"""

from __future__ import annotations

import copy
import hashlib

import torch

# stabilityai/stable-diffusion-3.5-medium: MMDiT-X, dual attention in the first 13 of 24 blocks.
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
SD35_MEDIUM_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)
# The text conditioning's shapes: 77 CLIP + 256 T5 tokens of the T5 width, pooled CLIP projections.
SD35_MEDIUM_TEXT_TOKENS = 333
SD35_MEDIUM_TEXT_DIM = SD35_MEDIUM_TRANSFORMER["joint_attention_dim"]
SD35_MEDIUM_POOLED_DIM = SD35_MEDIUM_TRANSFORMER["pooled_projection_dim"]
# The text encoders' output widths: CLIP ViT-L/14's text tower (hidden 768, projection 768), OpenCLIP
# ViT-bigG/14's (hidden 1280, projection 1280) and T5 v1.1 XXL's encoder (d_model 4096). The pipeline
# concatenates the two CLIP projections into the pooled input (768 + 1280 = 2048) and zero-pads the CLIP
# hidden states up to the T5 width before joining them with the T5 tokens (4096 = joint_attention_dim).
SD35_CLIP_L_WIDTH = 768
SD35_CLIP_G_WIDTH = 1280
SD35_T5_WIDTH = 4096

# Wan-AI/Wan2.2-TI2V-5B-Diffusers: one 5 B expert (no transformer_2, no boundary_ratio) that takes one
# timestep per patch token (the pipeline's expand_timesteps=True).
WAN22_TI2V_5B_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=24,
    attention_head_dim=128,
    in_channels=48,
    out_channels=48,
    text_dim=4096,  # UMT5-XXL's d_model
    freq_dim=256,
    ffn_dim=14336,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
    pos_embed_seq_len=None,
)
# The Wan 2.2 VAE: 48 latent channels, 16x spatial (a 2x2 pixel patchify into 3·2·2 = 12 channels, then the
# 8x encoder), 4x temporal, residual down/up blocks, and a wider decoder than encoder (256 vs 160 base
# channels). The published file also sets "clip_output": false, which diffusers 0.42's AutoencoderKLWan does not
# take (it clamps its output either way). Lists, not tuples: AutoencoderKLWan concatenates `[1] + dim_mult`.
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    latents_std=[
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
)
# Recalled, not read from a file: the TI2V-5B scheduler_config.json's flow_shift (UniPC with flow sigmas),
# which matches the Wan2.2 repository's sample_shift for ti2v-5B.
WAN22_TI2V_5B_FLOW_SHIFT = 5.0
WAN22_UMT5_WIDTH = WAN22_TI2V_5B_TRANSFORMER["text_dim"]


def sd35_medium_transformer_config(num_layers: int | None = None) -> dict:
    """The transformer config; `num_layers` < 24 keeps the real widths with fewer blocks (quick smoke tests)."""
    config = dict(SD35_MEDIUM_TRANSFORMER)
    if num_layers is not None:
        config["num_layers"] = num_layers
        config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < num_layers)
    return config


def sd35_medium_vae_config(num_layers: int | None = None) -> dict:
    """The VAE config; `num_layers` below its 2 layers per block gives every block that many (widths kept)."""
    config = dict(SD35_MEDIUM_VAE)
    if num_layers is not None:
        config["layers_per_block"] = min(config["layers_per_block"], num_layers)
    return config


def wan22_ti2v_5b_transformer_config(num_layers: int | None = None) -> dict:
    """The TI2V-5B transformer config; `num_layers` < 30 keeps the widths with fewer blocks."""
    config = dict(WAN22_TI2V_5B_TRANSFORMER)
    if num_layers is not None:
        config["num_layers"] = num_layers
    return config


def wan22_vae_config(num_layers: int | None = None) -> dict:
    """The Wan 2.2 VAE config; `num_layers` below its 2 residual blocks per level gives every level that many
    (the decoder's up blocks have one more, as in the real layout); channels, strides and latents are kept."""
    config = copy.deepcopy(WAN22_VAE)
    if num_layers is not None:
        config["num_res_blocks"] = min(config["num_res_blocks"], num_layers)
    return config


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast in place, tensor by tensor, to what `from_pretrained(torch_dtype=dtype)` would hold.

    Parameters and persistent floating buffers go to `dtype`, except under the class's
    `_keep_in_fp32_modules` (Wan's time embedder and norms, T5's `wo`, ...), as the diffusers and
    transformers loaders leave them. Non-persistent buffers (computed in `__init__`, never saved) keep their
    own dtype. One tensor at a time, so the peak is the fp32 model plus one tensor, not two copies.
    """
    keep = tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, param in module.named_parameters(recurse=False):
                if any(k in (prefix + name).split(".") for k in keep) or not param.is_floating_point():
                    continue
                param.data = param.data.to(dtype)
            for name, buf in list(module.named_buffers(recurse=False)):
                if name in module._non_persistent_buffers_set or not buf.is_floating_point():
                    continue
                if any(k in (prefix + name).split(".") for k in keep):
                    continue
                module._buffers[name] = buf.to(dtype)
    return model


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_random_pipeline(pipe, out_dir: str, dtype: torch.dtype) -> dict[str, int]:
    """Cast every model component of `pipe` like `from_pretrained(torch_dtype=dtype)` and `save_pretrained` it
    (safetensors); returns each component's parameter count."""
    counts: dict[str, int] = {}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            cast_like_from_pretrained(component, dtype)
            counts[name] = count_parameters(component)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return counts


def random_sd35_medium_transformer(device: torch.device | str, dtype: torch.dtype, num_layers: int | None = None):
    """An `SD3Transformer2DModel` of the SD3.5-Medium config, random weights, initialised on `device`."""
    from diffusers import SD3Transformer2DModel

    with torch.device(device):
        return SD3Transformer2DModel(**sd35_medium_transformer_config(num_layers)).to(dtype)


def random_sd35_medium_vae(device: torch.device | str, dtype: torch.dtype):
    """An `AutoencoderKL` of the SD3 VAE config, random weights, initialised on `device`."""
    from diffusers import AutoencoderKL

    with torch.device(device):
        return AutoencoderKL(**SD35_MEDIUM_VAE).to(dtype)


def random_text_embeddings(
    text: str, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token embeddings [1, 333, 4096] and pooled [1, 2048] of the real shapes, deterministic per `text`."""
    seed = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randn(1, SD35_MEDIUM_TEXT_TOKENS, SD35_MEDIUM_TEXT_DIM, generator=generator)
    pooled = torch.randn(1, SD35_MEDIUM_POOLED_DIM, generator=generator)
    return tokens.to(device, dtype), pooled.to(device, dtype)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on a CUDA device, so that a wall-clock reading covers it; nothing on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
