"""Tiny random-weight `FluxPipeline` (1 dual-stream + 1 single-stream block, guidance embedding on).

VAE scale factor 4 with 4 latent channels: a 32×32 image is an 8×8 latent packed into 16 tokens of 16
features. CLIP (pooled, width 16) and T5 (width 32) are built in memory like the SD3 ones. The scheduler
uses FLUX.1's dynamic-shift settings.

Variants: `flux` (default, `FluxPipeline`) and `kontext` (the same components saved as a `FluxKontextPipeline`,
FLUX.1-Kontext's image-editing layout; it resolves to the `flux_kontext` family).
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_clip_text_encoder, tiny_t5_encoder, tiny_vae_kl
from miles.testing.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer


VARIANTS = ("flux", "kontext")


def build(out_dir: str, seed: int = 0, variant: str = "flux") -> str:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    clip_tokenizer = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    # FLUX uses the CLIP text model's pooler output (no projection head).
    clip_config = tiny_clip_text_encoder(len(clip_tokenizer), eos_token_id=clip_tokenizer.eos_token_id).config
    text_encoder = CLIPTextModel(CLIPTextConfig(**clip_config.to_dict()))
    text_encoder_2 = tiny_t5_encoder(len(t5_tokenizer), d_model=32)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels × a 2×2 patch
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 width
        pooled_projection_dim=16,  # CLIP width
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(2, 2, 4),  # sums to the head dim
    )
    vae = tiny_vae_kl(latent_channels=4)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipeline_class = FluxKontextPipeline if variant == "kontext" else FluxPipeline
    pipe = pipeline_class(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir)
    return out_dir
