"""Tiny random-weight LTX pipelines, built offline: LTX-Video 0.9 (`LTXPipeline`, variant `ltx-video`, the
default), LTX-2 (`LTX2Pipeline`, variant `ltx2`) and the same LTX-2 components saved as an
`LTX2ImageToVideoPipeline` (variant `ltx2_i2v`).

ltx-video: a 1-layer `LTXVideoTransformer3DModel` on 8 latent channels, a small `AutoencoderKLLTXVideo` (4x spatial and
4x temporal compression, timestep-conditioned decoder like LTX-Video 0.9.1+, framewise encode/decode off), a
1-layer T5 encoder over a locally built T5 Unigram tokenizer, and the flow-match Euler scheduler with the
published checkpoints' dynamic shift and `shift_terminal`. About 0.5 MB on disk.

ltx2: a 1-layer `LTX2VideoTransformer3DModel` (video width 32 on 8 latent channels, audio width 16 on 2 latent
channels x 2 latent mel bins), an `AutoencoderKLLTX2Video` with 4x spatial and 4x temporal compression, an
`AutoencoderKLLTX2Audio` over 8 mel bins, a small `LTX2Vocoder`, `LTX2TextConnectors` with one layer per
modality, and a 1-layer Gemma 3 encoder (with the smallest vision tower its config class accepts) over a locally
built Gemma BPE tokenizer; the scheduler has the LTX-2 dynamic shift. About 1 MB on disk.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_t5_config
from miles.testing.tiny.tokenizers import build_gemma_tokenizer, build_t5_tokenizer

TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 128
VARIANTS = ("ltx-video", "ltx2", "ltx2_i2v")
# LTX2Pipeline / LTX2ImageToVideoPipeline.__call__ with every guidance term off (CFG, STG, modality isolation,
# rescale), the only setting the ltx family trains LTX-2 with: what its parity tests compare against.
LTX2_GUIDANCE_OFF = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                         modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
LTX2_TEXT_DIM = 16  # Gemma hidden size
LTX2_TEXT_LAYERS = 1  # the connectors read every hidden state: layers + 1 of them


def build(out_dir: str, seed: int = 0, variant: str = "ltx-video") -> str:
    """Build and `save_pretrained` a tiny LTX pipeline of `variant` (see VARIANTS) into `out_dir`."""
    if variant in ("ltx2", "ltx2_i2v"):
        return build_ltx2(out_dir, seed, image_to_video=variant == "ltx2_i2v")
    if variant != "ltx-video":
        raise ValueError(f"no tiny ltx variant {variant!r}; one of {', '.join(VARIANTS)}")
    return build_ltx_video(out_dir, seed)


def build_ltx_video(out_dir: str, seed: int = 0) -> str:
    """Build and `save_pretrained` a tiny LTX-Video 0.9 pipeline into `out_dir`."""
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


def tiny_gemma3_encoder(vocab_size: int, pad_token_id: int):
    """A 1-layer Gemma 3 conditional-generation model of width 16 (only its language model runs)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=LTX2_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=LTX2_TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            sliding_window=64,
            pad_token_id=pad_token_id,
        ),
        vision_config=dict(
            hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(config)


def build_ltx2(out_dir: str, seed: int = 0, image_to_video: bool = False) -> str:
    """Build and `save_pretrained` a tiny LTX-2 pipeline (video + audio) into `out_dir`; `image_to_video`: as an
    `LTX2ImageToVideoPipeline` (the same components and weights)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2ImageToVideoPipeline,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    tokenizer = build_gemma_tokenizer()
    text_encoder = tiny_gemma3_encoder(len(tokenizer), tokenizer.pad_token_id)
    connectors = LTX2TextConnectors(
        caption_channels=LTX2_TEXT_DIM,
        text_proj_in_factor=LTX2_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    latent_mel_bins = audio_vae.config.mel_bins // 4  # the audio VAE's mel compression
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        vae_scale_factors=(4, 4, 4),
        audio_in_channels=audio_vae.config.latent_channels * latent_mel_bins,
        audio_out_channels=audio_vae.config.latent_channels * latent_mel_bins,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=1,
        caption_channels=LTX2_TEXT_DIM,
        rope_double_precision=False,
        rope_type="split",
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        base_shift=0.95,
        max_shift=2.05,
        shift_terminal=0.1,
    )
    pipeline_class = LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline
    pipe = pipeline_class(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(out_dir)
    return out_dir
