"""Random-weight `StableDiffusion3Pipeline` folders: tiny (`build`) and SD3.5-Medium size (`build_real_size`).

Tiny: 2-layer MMDiT, 3-block VAE, tiny CLIP ×2 and T5. VAE scale factor 4 with 4 latent channels and patch
size 2: a 32×32 image is an 8×8 latent, 16 image tokens. CLIP hidden sizes (16 + 16) stay below the T5 width
(32), as in the real model where the CLIP states are zero-padded up to T5's width. About 1 MB on disk.

Real size: the SD3.5-Medium transformer and VAE configs of `miles/testing/real_size.py`, and text encoders of
the real output widths (CLIP-L 768, CLIP-G 1280, T5 4096) with 1–2 narrow layers, so a prompt encodes to the
real [B, 77 + 256, 4096] tokens and [B, 2048] pooled vector.
"""

from __future__ import annotations

import torch

from miles.testing import real_size
from miles.testing.tiny.components import tiny_clip_text_encoder, tiny_t5_config, tiny_t5_encoder, tiny_vae_kl
from miles.testing.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

SD35_FLOW_SHIFT = 3.0  # SD3.5's static shift (its scheduler_config.json)

# sd3: the position table spans 32 patches a side (256 px); wide: 128 (1024 px), for commands at the sizes of real
# recipes (their dry runs read the table's size; nothing denoises at that size on the tiny model).
VARIANTS = ("sd3", "wide")
POSITION_TABLE = {"sd3": 32, "wide": 128}


def build(out_dir: str, seed: int = 0, variant: str = "sd3") -> str:
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
        pos_embed_max_size=POSITION_TABLE[variant],
    )
    vae = tiny_vae_kl(latent_channels=4)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SD35_FLOW_SHIFT)
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


def build_real_size(
    out_dir: str,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, int]:
    """Build and `save_pretrained` an SD3.5-Medium-size pipeline with random weights; returns parameter counts.

    `num_layers` shrinks the transformer to that many blocks (dual attention kept in those below 13) and the
    VAE to at most that many layers per block; every width stays real. Each model is initialised in fp32 on
    `device` and saved in `dtype`; the weights depend on `seed` and on the device's random generator.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tokenizer = build_clip_tokenizer()
    clip_tokenizer_2 = build_clip_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    with torch.device(device):
        text_encoder = tiny_clip_text_encoder(  # CLIP ViT-L/14's text tower has 12 heads of 64
            len(clip_tokenizer), real_size.SD35_CLIP_L_WIDTH, real_size.SD35_CLIP_L_WIDTH,
            eos_token_id=clip_tokenizer.eos_token_id, num_attention_heads=12,
        )
        text_encoder_2 = tiny_clip_text_encoder(  # OpenCLIP ViT-bigG/14's has 20 heads of 64
            len(clip_tokenizer_2), real_size.SD35_CLIP_G_WIDTH, real_size.SD35_CLIP_G_WIDTH,
            eos_token_id=clip_tokenizer_2.eos_token_id, num_attention_heads=20,
        )
        # One narrow T5 layer (4 heads of 8, FFN 32) at the real d_model: a real T5-XXL layer (64 heads of 64,
        # gated FFN 10240) is 190 M parameters that change nothing the denoiser sees.
        text_encoder_3 = T5EncoderModel(T5Config(**tiny_t5_config(t5_tokenizer, d_model=real_size.SD35_T5_WIDTH)))
        transformer = SD3Transformer2DModel(**real_size.sd35_medium_transformer_config(num_layers))
        vae = AutoencoderKL(**real_size.sd35_medium_vae_config(num_layers))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SD35_FLOW_SHIFT),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    return real_size.save_random_pipeline(pipe, out_dir, dtype)
