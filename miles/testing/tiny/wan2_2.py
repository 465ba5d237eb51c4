"""Tiny random-weight Wan 2.2 pipeline (`WanPipeline`), built offline.

Two layouts, like the published checkpoints:

- `variant="a14b"` (default): the dual-expert T2V A14B layout: `transformer` (high noise) and
  `transformer_2` (low noise) switched at `boundary_ratio`, the 16-channel AutoencoderKLWan
  (8x spatial, 4x temporal).
- `variant="ti2v_5b"`: the single-expert TI2V 5B layout: one `transformer`, `expand_timesteps=True`
  (per-token timesteps), the 48-channel residual AutoencoderKLWan with a 2x2 patch (16x spatial).

Text encoder: a 1-layer UMT5 over a locally built T5 Unigram tokenizer. Scheduler: the
`UniPCMultistepScheduler` with flow sigmas that the real checkpoints ship (our loop only reads its
sigma grid). About 1 MB on disk.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.tokenizers import build_t5_tokenizer

TINY_FLOW_SHIFT = 3.0
TINY_BOUNDARY_RATIO = 0.875
TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 16


def _tiny_vae(variant: str):
    from diffusers import AutoencoderKLWan

    if variant == "ti2v_5b":
        z_dim = 48
        return AutoencoderKLWan(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=[0.1 * ((i % 5) - 2) for i in range(z_dim)],
            latents_std=[1.0 + 0.05 * (i % 3) for i in range(z_dim)],
        )
    z_dim = 16
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * ((i % 5) - 2) for i in range(z_dim)],
        latents_std=[1.0 + 0.05 * (i % 3) for i in range(z_dim)],
    )


def _tiny_transformer(in_channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=in_channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def build(out_dir: str, seed: int = 0, variant: str = "a14b") -> str:
    """Build and `save_pretrained` a tiny Wan 2.2 pipeline of `variant` ("a14b" or "ti2v_5b") into `out_dir`."""
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in ("a14b", "ti2v_5b"):
        raise ValueError(f"unknown Wan 2.2 variant {variant!r}; choose 'a14b' or 'ti2v_5b'")
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    vae = _tiny_vae(variant)
    transformer = _tiny_transformer(vae.config.z_dim)
    transformer_2 = _tiny_transformer(vae.config.z_dim) if variant == "a14b" else None
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=TINY_FLOW_SHIFT, num_train_timesteps=1000
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=TINY_BOUNDARY_RATIO if variant == "a14b" else None,
        expand_timesteps=variant == "ti2v_5b",
    )
    pipe.save_pretrained(out_dir)
    return out_dir
