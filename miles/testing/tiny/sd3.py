"""Tiny random-weight `StableDiffusion3Pipeline` (2-layer MMDiT, 3-block VAE, tiny CLIP ×2 and T5).

VAE scale factor 4 with 4 latent channels and patch size 2: a 32×32 image is an 8×8 latent, 16 image
tokens. CLIP hidden sizes (16 + 16) stay below the T5 width (32), as in the real model where the CLIP
states are zero-padded up to T5's width. About 1 MB on disk.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_clip_text_encoder, tiny_t5_encoder, tiny_vae_kl
from miles.testing.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer


def build(out_dir: str, seed: int = 0) -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    clip_tokenizer = build_clip_tokenizer()
    clip_tokenizer_2 = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    text_encoder = tiny_clip_text_encoder(len(clip_tokenizer), eos_token_id=clip_tokenizer.eos_token_id)
    text_encoder_2 = tiny_clip_text_encoder(len(clip_tokenizer_2), eos_token_id=clip_tokenizer_2.eos_token_id)
    text_encoder_3 = tiny_t5_encoder(len(t5_tokenizer), d_model=32)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 width
        caption_projection_dim=16,  # = heads × head_dim
        pooled_projection_dim=32,  # the two CLIP projections concatenated
        out_channels=4,
        pos_embed_max_size=32,
    )
    vae = tiny_vae_kl(latent_channels=4)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's static shift
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(out_dir)
    return out_dir
