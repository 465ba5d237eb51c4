"""Tiny random-weight FLUX.2 pipeline (`Flux2Pipeline`), built offline.

A `Flux2Transformer2DModel` with one double-stream and one single-stream block (width 32, guidance embedding on,
like FLUX.2-dev) on 16 packed channels (the 2x2 patches of a 4-channel latent); an `AutoencoderKLFlux2` with
4x compression and non-trivial batch-norm statistics (the pipeline normalises patched latents with them); a
Mistral 3 encoder of width 16 with 30 text layers, because the pipeline stacks hidden states 10, 20 and 30 (the
text layers are tiny, the smallest vision tower its config accepts rides along unused); and a byte-level BPE
tokenizer with a chat template that reads the pipeline's system/user messages (the published checkpoint ships a
Pixtral processor, which needs torchvision; the pipeline only calls its `apply_chat_template`). The scheduler
shifts dynamically (the pipeline's empirical μ). About 1 MB on disk.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.tokenizers import build_qwen2_tokenizer

TEXT_DIM = 16
TEXT_LAYERS = 30  # Flux2Pipeline reads hidden states (10, 20, 30)
LATENT_CHANNELS = 4
# Renders the pipeline's messages: content is a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
)


def tiny_mistral3_encoder(vocab_size: int, pad_token_id: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=vocab_size,
            hidden_size=TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            sliding_window=None,
            pad_token_id=pad_token_id,
        ),
        vision_config=dict(
            model_type="pixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            image_size=16, patch_size=8, head_dim=4,
        ),
        image_token_index=vocab_size - 1,
    )
    return Mistral3ForConditionalGeneration(config)


def build(out_dir: str, seed: int = 0) -> str:
    """Build and `save_pretrained` a tiny FLUX.2 pipeline into `out_dir`."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer(chat_template=CHAT_TEMPLATE)
    tokenizer.pad_token = "<|endoftext|>"
    text_encoder = tiny_mistral3_encoder(len(tokenizer), tokenizer.pad_token_id)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
    )
    with torch.no_grad():  # batch-norm statistics away from (0, 1), so the normalisation is exercised
        vae.bn.running_mean.copy_(0.1 * torch.randn(4 * LATENT_CHANNELS))
        vae.bn.running_var.copy_(0.5 + torch.rand(4 * LATENT_CHANNELS))
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_DIM,  # three stacked hidden states
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    pipe = Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(out_dir)
    return out_dir
