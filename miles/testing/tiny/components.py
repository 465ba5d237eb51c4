"""Tiny components that several tiny pipelines share (random weights, built in memory).

- `tiny_clip_text_encoder`, `tiny_t5_encoder`, `tiny_vae_kl`: SD3's CLIP, T5 and AutoencoderKL (FLUX reuses them).
- `tiny_t5_config`: the 1-layer T5 shape of the LTX T5 and the Wan UMT5 encoders (same config class fields).

The real-size builders (`build_real_size`) reuse the text encoders with the real output widths: only the
widths reach the denoiser, so a few narrow layers behind them give the real conditioning shapes.
- `tiny_wan_vae`: a small AutoencoderKLWan with non-trivial latents_mean/std (the Wan 2.1 layout: 16 channels,
  8x spatial, 4x temporal; Wan 2.1, Wan 2.2 A14B); `tiny_wan22_vae`: the Wan 2.2 layout of the same class (48
  channels, residual, 2x2 patch, 16x spatial; Wan 2.2 TI2V 5B, Cosmos 3).
- `tiny_unipc_flow_scheduler`: the UniPC flow-sigma scheduler the Wan 2.2 and Cosmos 3 checkpoints ship.

Callers seed torch before building, and the weights depend on the order of construction: keep it.
"""

from __future__ import annotations

from typing import Any


def tiny_clip_text_encoder(
    vocab_size: int, hidden_size: int = 16, projection_dim: int = 16, eos_token_id: int = 1, num_attention_heads: int = 2
):
    """A 2-layer CLIP text tower: two layers because SD3 reads the penultimate hidden states."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        projection_dim=projection_dim,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    return CLIPTextModelWithProjection(config)


def tiny_t5_encoder(vocab_size: int, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def tiny_t5_config(tokenizer: Any, d_model: int) -> dict[str, Any]:
    """Keyword arguments of a 1-layer T5Config / UMT5Config over `tokenizer` (its pad and eos ids)."""
    return dict(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_vae_kl(latent_channels: int = 4, shift_factor: float = 0.1, scaling_factor: float = 1.5):
    """A 3-level AutoencoderKL (scale factor 4) with small channel counts."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def tiny_wan_vae(z_dim: int = 16, **extra: Any):
    """AutoencoderKLWan (8x spatial, 4x temporal by default) with per-channel latents_mean/std that are not 0/1,
    so the decode normalisation is exercised; `extra` adds keyword arguments (e.g. the residual 5B layout)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * ((i % 5) - 2) for i in range(z_dim)],
        latents_std=[1.0 + 0.05 * (i % 3) for i in range(z_dim)],
        **extra,
    )


def tiny_wan22_vae():
    """The Wan 2.2 VAE layout (TI2V 5B and Cosmos 3): 48 latent channels, residual blocks, a 2x2 pixel patch
    (12 = 3·2·2 input channels), 16x spatial and 4x temporal compression."""
    return tiny_wan_vae(
        48,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
    )


def tiny_unipc_flow_scheduler(flow_shift: float):
    """`UniPCMultistepScheduler` with flow sigmas and a static `flow_shift` (our loop only reads its sigma grid)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift, num_train_timesteps=1000
    )
