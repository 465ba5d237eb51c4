"""Tiny random-weight HunyuanVideo-1.5 text-to-video pipeline (`HunyuanVideo15Pipeline`), built offline.

A 1-layer `HunyuanVideo15Transformer3DModel` (t2v, width 16, one token-refiner layer) whose input is the
4-channel latent, the all-zero condition latent and the all-zero mask (9 channels); an
`AutoencoderKLHunyuanVideo15` with 4x spatial and 2x temporal compression; a 2-layer Qwen2.5-VL text model of
width 16 over a locally built byte-level Qwen2 tokenizer with a chat template; a 1-layer T5 encoder over a
`ByT5Tokenizer` (the glyph encoder: prompts with quoted text); the static-shift flow-match scheduler and a
`ClassifierFreeGuidance` guider. About 17 MB on disk: the DiT's glyph projection has a hidden width of 2048 fixed
in diffusers' code (the rest is tiny).
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_t5_config
from miles.testing.tiny.tokenizers import build_qwen2_tokenizer

TEXT_DIM = 16
GLYPH_DIM = 32
LATENT_CHANNELS = 4
GUIDANCE_SCALE = 6.0


def build(out_dir: str, seed: int = 0) -> str:
    """Build and `save_pretrained` a tiny HunyuanVideo-1.5 pipeline into `out_dir`."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer()
    tokenizer.pad_token = "<|endoftext|>"
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ))
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(**tiny_t5_config(tokenizer_2, d_model=GLYPH_DIM)))
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,  # latent, condition latent, mask
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=32,
        task_type="t2v",
    )
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    pipe.save_pretrained(out_dir)
    return out_dir
