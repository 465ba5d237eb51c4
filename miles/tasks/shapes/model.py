"""The `shapes` base model's architecture: a small `StableDiffusion3Pipeline`, built untrained.

The same components and folder layout as an SD3.5 checkpoint (MMDiT transformer, AutoencoderKL, two CLIP
text towers and a T5 encoder with their tokenizers, the flow-matching Euler scheduler with SD3.5's shift 3),
at a size that trains on two CPU cores:

- tokenizers: the tiny pipelines' byte-level CLIP BPE and T5 Unigram (miles/testing/tiny/tokenizers.py) plus
  one token for each word of the task's prompts (BPE merges, Unigram pieces), so a colour or a shape is one
  token, not a run of letters;
- text length: both tokenizers' `model_max_length` is `TEXT_LENGTH`, so a prompt is 2 × 16 text tokens
  beside the 64 image tokens (the SD3 family reads the T5 length from the tokenizer when it is below 256);
- text encoders: 2-layer CLIP towers (width `CLIP_WIDTH`) and a 2-layer T5 (width `2 · CLIP_WIDTH`, the
  width the pipeline pads the CLIP states to);
- VAE: AutoencoderKL with one level per entry of `vae_channels` (scale factor 2^(levels − 1)) and 4 latent
  channels: a 32 px image with two levels is a 16×16 latent, as is a 128 px image with four;
- transformer: `SD3Transformer2DModel`, patch 2, `width` = heads × 16, `num_layers` joint blocks.

`ModelSize` holds the knobs; `SMALL` is the CPU-pretrained model, `WIDE` (same image size, a wider DiT) the
GPU-pretrained one, `LARGE` the GPU benchmark's: 128 px through an 8× VAE, as SD3.5's VAE is, so its DiT sees the
same 64 image tokens and can be larger for the same time per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.tasks.shapes.spec import COUNT_WORDS, PALETTE, RELATIONS, SHAPES

CLIP_WIDTH = 32
TEXT_LENGTH = 16  # tokens per prompt in each encoder (the longest prompt is 9 words); SD3.5 pads to 77 + 256
FLOW_SHIFT = 3.0  # SD3.5's static shift


@dataclass(frozen=True)
class ModelSize:
    image_size: int = 32
    num_layers: int = 3
    num_heads: int = 3  # of 16 dimensions each
    vae_channels: tuple[int, ...] = (8, 16)  # one VAE level each: scale factor 2^(len − 1)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_channels) - 1)


SMALL = ModelSize()
WIDE = ModelSize(num_layers=4, num_heads=6)  # 32 px like SMALL, a 96-wide DiT: the GPU-pretrained base
LARGE = ModelSize(image_size=128, num_layers=6, num_heads=8, vae_channels=(32, 64, 128, 128))  # 16×16 latents


def prompt_words() -> list[str]:
    """Every word a `shapes` prompt uses."""
    words = set(COUNT_WORDS.values()) | set(PALETTE) | {"and"}
    words |= set(SHAPES) | {shape + "s" for shape in SHAPES}
    for relation in RELATIONS:
        words |= set(relation.split())
    return sorted(words)


def build_clip_tokenizer():
    """The tiny byte-level CLIP BPE with merges that make each prompt word one token (`red</w>`)."""
    from transformers import CLIPTokenizer

    from miles.testing.tiny.tokenizers import build_clip_tokenizer as byte_level

    vocab = dict(byte_level().get_vocab())
    merges: list[tuple[str, str]] = []
    # A longer word's merges rank first, so that a shorter word's pair ("r e" of red) cannot split it (squares).
    for word in sorted(prompt_words(), key=lambda w: (-len(w), w)):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
            symbols = [symbols[0] + symbols[1]] + symbols[2:]
            vocab.setdefault(symbols[0], len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TEXT_LENGTH)
    split = [word for word in prompt_words() if tokenizer.tokenize(word) != [word + "</w>"]]
    if split:
        raise RuntimeError(f"the shapes CLIP tokenizer splits {split}")
    return tokenizer


def build_t5_tokenizer():
    """The tiny T5 Unigram with one piece per prompt word (`▁red`), scored above any spelling of it."""
    from transformers import T5Tokenizer

    from miles.testing.tiny.tokenizers import t5_character_pieces

    pieces = t5_character_pieces()
    pieces += [("▁" + word, -1.0) for word in prompt_words()]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TEXT_LENGTH)


def build_untrained_pipeline(size: ModelSize = SMALL, seed: int = 0):
    """A `StableDiffusion3Pipeline` with random weights of the given size."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2, tokenizer_3 = build_clip_tokenizer(), build_clip_tokenizer(), build_t5_tokenizer()

    def clip(tok):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH, num_hidden_layers=2,
            num_attention_heads=2, projection_dim=CLIP_WIDTH, max_position_embeddings=TEXT_LENGTH, bos_token_id=0,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id))

    text_width = 2 * CLIP_WIDTH
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=text_width, d_kv=16, d_ff=2 * text_width, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, decoder_start_token_id=0,
        pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id))
    width = 16 * size.num_heads
    latent = size.image_size // size.vae_scale_factor
    levels = len(size.vae_channels)
    transformer = SD3Transformer2DModel(
        sample_size=latent, patch_size=2, in_channels=4, num_layers=size.num_layers, attention_head_dim=16,
        num_attention_heads=size.num_heads, joint_attention_dim=text_width, caption_projection_dim=width,
        pooled_projection_dim=2 * CLIP_WIDTH, out_channels=4, pos_embed_max_size=latent)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=size.vae_channels, layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=size.image_size, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT), vae=vae,
        text_encoder=clip(tokenizer), tokenizer=tokenizer, text_encoder_2=clip(tokenizer_2), tokenizer_2=tokenizer_2,
        text_encoder_3=t5, tokenizer_3=tokenizer_3)
