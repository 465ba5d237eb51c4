"""Tiny random-weight LTX-Video pipeline (`LTXPipeline`), built offline.

A 1-layer `LTXVideoTransformer3DModel` on 8 latent channels, a small `AutoencoderKLLTXVideo` (4x spatial and
4x temporal compression, timestep-conditioned decoder like LTX-Video 0.9.1+, framewise encode/decode off), a
1-layer T5 encoder over a locally built T5 Unigram tokenizer, and the flow-match Euler scheduler with the
published checkpoints' dynamic shift and `shift_terminal`. About 0.5 MB on disk.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_t5_config
from miles.testing.tiny.tokenizers import build_t5_tokenizer

TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 128


def build(out_dir: str, seed: int = 0) -> str:
    """Build and `save_pretrained` a tiny LTX-Video pipeline into `out_dir`."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    text_encoder = T5EncoderModel(T5Config(**tiny_t5_config(tokenizer, d_model=TEXT_DIM)))
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=True,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    # Per-frame decoding would slice a 2-frame latent into pieces the tiny decoder cannot stitch.
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=1,
        caption_channels=TEXT_DIM,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        base_shift=0.95,
        max_shift=2.05,
        shift_terminal=0.1,
    )
    pipe = LTXPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(out_dir)
    return out_dir
