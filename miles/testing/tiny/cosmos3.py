"""Tiny random-weight Cosmos 3 pipeline (`Cosmos3OmniPipeline`), built offline.

`Cosmos3OmniTransformer` holds the language model itself (no separate text encoder): a 2-layer model of
width 32 (head_dim 8, 4 query / 2 key-value heads, rotary sections (2, 1, 1) summing to head_dim/2) whose
`vocab_size` equals the length of a locally built byte-level Qwen2 tokenizer with a chat template and the
`<|vision_start|>` token. FPS modulation of the video positions is on, as in the published config.

The VAE has the layout of the published one, the Wan 2.2 AutoencoderKLWan (48 latent channels, residual blocks,
2x2 pixel patch, 16x spatial and 4x temporal compression; the pipeline encodes and decodes images and videos
with it), at a small width; `patch_latent_dim` = patch² × latent channels = 192. The scheduler is the
`UniPCMultistepScheduler` with flow sigmas that the published pipeline ships. No safety checker
(`enable_safety_checker=False`). About 1 MB.
"""

from __future__ import annotations

import torch

from miles.testing.tiny.components import tiny_unipc_flow_scheduler, tiny_wan22_vae
from miles.testing.tiny.tokenizers import build_qwen2_tokenizer

TINY_FLOW_SHIFT = 3.0
PATCH = 2


def build(out_dir: str, seed: int = 0) -> str:
    """Build and `save_pretrained` a tiny Cosmos 3 pipeline (text-to-image and text-to-video) into `out_dir`."""
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer

    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer()
    vae = tiny_wan22_vae()
    latent_channels = vae.config.z_dim
    transformer = Cosmos3OmniTransformer(
        head_dim=8,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        latent_channel=latent_channels,
        latent_patch_size=PATCH,
        patch_latent_dim=PATCH * PATCH * latent_channels,
        rope_axes_dim=[2, 1, 1],  # sums to head_dim / 2
        rope_theta=10000.0,
        vocab_size=len(tokenizer),
        enable_fps_modulation=True,
    )
    scheduler = tiny_unipc_flow_scheduler(TINY_FLOW_SHIFT)
    pipe = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=scheduler,
        enable_safety_checker=False,
    )
    pipe.save_pretrained(out_dir)
    return out_dir
