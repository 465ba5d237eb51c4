"""Real-size SD3.5-Medium pieces with random weights, and timing helpers, for the benchmark scripts.

The configs are `stabilityai/stable-diffusion-3.5-medium`'s published `transformer/config.json` and
`vae/config.json` as remembered (no hub access; the parameter count, 2.24 B for the transformer, is the check).
Speed does not depend on weight values, so every model here is built from its config with random weights,
on the target device (initialising 2.24 B parameters on a CPU would take minutes). Callers seed torch first.
"""

from __future__ import annotations

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


def sd35_medium_transformer_config(num_layers: int | None = None) -> dict:
    """The transformer config; `num_layers` < 24 keeps the real widths with fewer blocks (quick smoke tests)."""
    config = dict(SD35_MEDIUM_TRANSFORMER)
    if num_layers is not None:
        config["num_layers"] = num_layers
        config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < num_layers)
    return config


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
