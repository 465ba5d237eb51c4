"""Random-weight Wan pipelines (`WanPipeline`), built offline: tiny (`build`) and TI2V-5B size
(`build_real_size`).

Three layouts, like the published checkpoints (`python -m miles.testing.make_tiny --family wan2_2 --variant V`):

- `variant="a14b"` (default): the dual-expert T2V A14B layout: `transformer` (high noise) and
  `transformer_2` (low noise) switched at `boundary_ratio`, the 16-channel AutoencoderKLWan
  (8x spatial, 4x temporal).
- `variant="ti2v_5b"`: the single-expert TI2V 5B layout: one `transformer`, `expand_timesteps=True`
  (per-token timesteps), the 48-channel residual AutoencoderKLWan with a 2x2 patch (16x spatial).
- `variant="wan2_1"`: Wan 2.1 T2V (1.3B / 14B): one `transformer`, no boundary, per-sample timesteps, the
  16-channel Wan 2.1 VAE. Its model_index.json is written without `transformer_2`, `boundary_ratio` and
  `expand_timesteps` entries, as diffusers saved Wan folders before Wan 2.2 added them, so the layout is read
  from what such a folder lacks (the A14B and 5B variants test the other form).

Text encoder: a 1-layer UMT5 over a locally built T5 Unigram tokenizer. Scheduler: the
`UniPCMultistepScheduler` with flow sigmas that the real checkpoints ship (our loop only reads its
sigma grid). About 1 MB on disk.

Real size (TI2V-5B only): the transformer and Wan 2.2 VAE configs of `miles/testing/real_size.py`, the
published scheduler, and a narrow 1-layer UMT5 at the real width 4096, so a prompt encodes to the real
[B, 512, 4096].
"""

from __future__ import annotations

import json
import os

import torch

from miles.testing import real_size
from miles.testing.tiny.components import tiny_t5_config, tiny_unipc_flow_scheduler, tiny_wan22_vae, tiny_wan_vae
from miles.testing.tiny.tokenizers import build_t5_tokenizer

TINY_FLOW_SHIFT = 3.0
TINY_BOUNDARY_RATIO = 0.875
TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 16


def _tiny_vae(variant: str):
    if variant == "ti2v_5b":  # the 48-channel residual VAE with a 2x2 patch (16x spatial)
        return tiny_wan22_vae()
    return tiny_wan_vae(16)


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


VARIANTS = ("a14b", "ti2v_5b", "wan2_1")
WAN22_ONLY_INDEX_ENTRIES = ("transformer_2", "boundary_ratio", "expand_timesteps")


def build(out_dir: str, seed: int = 0, variant: str = "a14b") -> str:
    """Build and `save_pretrained` a tiny Wan pipeline of `variant` (one of `VARIANTS`) into `out_dir`."""
    from diffusers import WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"unknown Wan variant {variant!r}; choose one of {VARIANTS}")
    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(tokenizer, d_model=TEXT_DIM)))
    vae = _tiny_vae(variant)
    transformer = _tiny_transformer(vae.config.z_dim)
    transformer_2 = _tiny_transformer(vae.config.z_dim) if variant == "a14b" else None
    scheduler = tiny_unipc_flow_scheduler(TINY_FLOW_SHIFT)
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
    if variant == "wan2_1":
        _drop_model_index_entries(out_dir, WAN22_ONLY_INDEX_ENTRIES)
    return out_dir


def _drop_model_index_entries(out_dir: str, keys: tuple[str, ...]) -> None:
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    for key in keys:
        index.pop(key, None)
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def build_real_size(
    out_dir: str,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, int]:
    """Build and `save_pretrained` a Wan2.2-TI2V-5B-size pipeline with random weights; returns parameter counts.

    `num_layers` shrinks the transformer to that many blocks and the VAE to at most that many residual blocks
    per level; every width, the 48 latent channels and the 16x/4x compression stay real. Each model is
    initialised in fp32 on `device` and saved in `dtype`; the weights depend on `seed` and on the device's
    random generator.
    """
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    # The family pads prompts to 512 UMT5 tokens (WanPipeline's default), the real tokenizer's length too.
    tokenizer = build_t5_tokenizer(model_max_length=512)
    with torch.device(device):
        # One narrow layer (4 heads of 8, FFN 32) at the real d_model: a real UMT5-XXL layer is 190 M
        # parameters that change nothing the denoiser sees.
        text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(tokenizer, d_model=real_size.WAN22_UMT5_WIDTH)))
        vae = AutoencoderKLWan(**real_size.wan22_vae_config(num_layers))
        transformer = WanTransformer3DModel(**real_size.wan22_ti2v_5b_transformer_config(num_layers))
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=tiny_unipc_flow_scheduler(real_size.WAN22_TI2V_5B_FLOW_SHIFT),
        transformer=transformer,
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,  # TI2V-5B: one timestep per patch token
    )
    return real_size.save_random_pipeline(pipe, out_dir, dtype)
