"""Real-size denoiser benchmark, one row per model family (issue 4, "Also").

    python bench/bench_families.py --device cuda --out bench/families_h200.json          # one H200, ~minutes
    python bench/bench_families.py --device cuda --families sd3,wan2_2 --repeats 5
    python bench/bench_families.py --device cpu --tiny                                    # smoke test, < 60 s
    python bench/bench_families.py --meta-check                                           # param counts only

For each family the diffusers denoiser transformer is instantiated from its published config with random
weights (speed does not depend on the values), and one forward at the family's usual resolution is
measured: parameters, FLOPs per forward (`torch.utils.flop_counter.FlopCounterMode`, one counted forward
that also serves as a warm-up), and time (CUDA-synchronised, median of `--repeats` forwards after
`--warmup` more). Every forward runs under `torch.no_grad()` in bf16. Prints a Markdown table and writes it
with all the numbers as JSON to `--out`.

The configs below are the checkpoints' published `transformer/config.json` as remembered (no hub access
here); the parameter count printed in each row is the check against the published size. Cosmos 3's is an
assumed config (see COSMOS3 below), labelled so in its row.

Weights are built the way `from_pretrained(torch_dtype=torch.bfloat16)` leaves them, without minutes of
CPU init: the model is constructed directly on the target device (default fp32, so that buffers computed in
`__init__` — rotary tables, sin/cos position tables — keep their precision), then every parameter and
persistent floating buffer is cast to bf16 one tensor at a time, except the class's `_keep_in_fp32_modules`
(Wan's time embedder and norms, ...), as diffusers' loader does. Peak memory during the build is
fp32-sized (Qwen-Image: ~82 GB), well inside one H200. `--tiny` swaps each config (and shape) for a
1–2-layer miniature; the code path is otherwise identical.

FLOPs count matmuls, convolutions and fused attention (flash / efficient / cuDNN SDPA) — the ops
FlopCounterMode has formulas for; element-wise work is not counted. On CPU, SDPA runs as
`_scaled_dot_product_flash_attention_for_cpu`, which the counter does not know, so CPU (tiny) FLOPs leave
attention out; on CUDA they include it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from miles.testing.real_size import (  # noqa: E402
    SD35_MEDIUM_TEXT_TOKENS,
    SD35_MEDIUM_TRANSFORMER,
    WAN22_TI2V_5B_TRANSFORMER,
    cast_like_from_pretrained,
    synchronize,
)

T0 = time.perf_counter()


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Configs. Published `transformer/config.json` of each checkpoint AS REMEMBERED (no hub here); the printed
# parameter count is the check. Only architecture keys; diffusers' bookkeeping keys are left out.
# ---------------------------------------------------------------------------------------------------------

# stabilityai/stable-diffusion-3.5-medium — published ~2.5 B (MMDiT-X): SD35_MEDIUM_TRANSFORMER, shared with the
# other bench scripts in miles/testing/real_size.py.

# black-forest-labs/FLUX.1-dev — published 12 B.
FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)

# Qwen/Qwen-Image — published 20 B MMDiT.
QWEN_IMAGE = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)

# Wan-AI/Wan2.2-T2V-A14B-Diffusers — one of the two experts (`transformer` / `transformer_2` share this config).
WAN22_A14B_EXPERT = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
    pos_embed_seq_len=None,
)

# Wan-AI/Wan2.2-TI2V-5B-Diffusers — single expert on the 48-channel Wan2.2 VAE (16x spatial, 4x temporal);
# shared with `make_tiny --real-size` in miles/testing/real_size.py.
WAN22_TI2V_5B = WAN22_TI2V_5B_TRANSFORMER

# Lightricks/LTX-Video 0.9.x (2 B; e.g. 0.9.1 / 0.9.5 diffusers folders).
LTX_VIDEO_09 = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=64,
    cross_attention_dim=2048,
    num_layers=28,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=4096,
    attention_bias=True,
    attention_out_bias=True,
)

# Cosmos 3 (`Cosmos3OmniTransformer`) — ASSUMED CONFIG. No published config.json is known to this script;
# this is the class's own `__init__` defaults in diffusers 0.42.1, which describe a Qwen3-VL-8B-shaped language
# backbone (hidden 4096, 36 layers, 32 query / 8 KV heads of 128, MLP 12288, vocab 151936, mRoPE sections
# (24, 20, 20), theta 5e6) duplicated into an understanding and a generation tower (mixture of transformers),
# on the 48-channel Wan2.2 VAE (16x spatial) with 2x2 patches. `lm_head` is part of the module but unused by the
# denoising forward; `params_no_embed_b` in the JSON leaves it and `embed_tokens` out.
COSMOS3_ASSUMED = dict(
    head_dim=128,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=36,
    latent_channel=48,
    latent_patch_size=2,
    patch_latent_dim=2 * 2 * 48,
    rope_axes_dim=[24, 20, 20],
    rope_theta=5000000.0,
    vocab_size=151936,
    hidden_act="silu",
)


# ---------------------------------------------------------------------------------------------------------
# Input builders: (model config, shape, batch, device, dtype) -> (forward kwargs, description). The forward
# kwargs follow what each diffusers pipeline passes its transformer in one denoising step.
# ---------------------------------------------------------------------------------------------------------


def _rand(*size, device, dtype):
    return torch.randn(*size, device=device, dtype=dtype)


def inputs_sd3(cfg, shape, batch, device, dtype):
    h, w = shape["height"] // shape["vae_spatial"], shape["width"] // shape["vae_spatial"]
    p = cfg["patch_size"]
    txt = shape["text_tokens"]
    kwargs = dict(
        hidden_states=_rand(batch, cfg["in_channels"], h, w, device=device, dtype=dtype),
        encoder_hidden_states=_rand(batch, txt, cfg["joint_attention_dim"], device=device, dtype=dtype),
        pooled_projections=_rand(batch, cfg["pooled_projection_dim"], device=device, dtype=dtype),
        timestep=torch.full((batch,), 500.0, device=device),
        return_dict=False,
    )
    return kwargs, dict(latent=(cfg["in_channels"], h, w), img_tokens=(h // p) * (w // p), txt_tokens=txt)


def _packed_2x2(shape, in_channels, batch, device, dtype):
    """FLUX / Qwen-Image latents: [B, (H/2)(W/2), 4C] after 2x2 packing of the 8x VAE latent."""
    h, w = shape["height"] // shape["vae_spatial"], shape["width"] // shape["vae_spatial"]
    gh, gw = h // 2, w // 2
    return _rand(batch, gh * gw, in_channels, device=device, dtype=dtype), (in_channels // 4, h, w), gh, gw


def inputs_flux(cfg, shape, batch, device, dtype):
    hidden, latent, gh, gw = _packed_2x2(shape, cfg["in_channels"], batch, device, dtype)
    txt = shape["text_tokens"]
    img_ids = torch.zeros(gh, gw, 3, device=device)
    img_ids[..., 1] = torch.arange(gh, device=device)[:, None]
    img_ids[..., 2] = torch.arange(gw, device=device)[None, :]
    kwargs = dict(
        hidden_states=hidden,
        encoder_hidden_states=_rand(batch, txt, cfg["joint_attention_dim"], device=device, dtype=dtype),
        pooled_projections=_rand(batch, cfg["pooled_projection_dim"], device=device, dtype=dtype),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),  # pipeline passes t / 1000
        img_ids=img_ids.reshape(-1, 3).to(dtype),
        txt_ids=torch.zeros(txt, 3, device=device, dtype=dtype),
        guidance=torch.full((batch,), shape["guidance"], device=device, dtype=torch.float32)
        if cfg.get("guidance_embeds")
        else None,
        return_dict=False,
    )
    return kwargs, dict(latent=latent, img_tokens=gh * gw, txt_tokens=txt)


def inputs_qwen_image(cfg, shape, batch, device, dtype):
    hidden, latent, gh, gw = _packed_2x2(shape, cfg["in_channels"], batch, device, dtype)
    txt = shape["text_tokens"]
    kwargs = dict(
        hidden_states=hidden,
        encoder_hidden_states=_rand(batch, txt, cfg["joint_attention_dim"], device=device, dtype=dtype),
        encoder_hidden_states_mask=None,  # the pipeline drops an all-valid mask
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),  # pipeline passes t / 1000
        img_shapes=[[(1, gh, gw)]] * batch,
        return_dict=False,
    )
    return kwargs, dict(latent=latent, img_tokens=gh * gw, txt_tokens=txt)


def _video_latent(shape):
    t = (shape["frames"] - 1) // shape["vae_temporal"] + 1
    return t, shape["height"] // shape["vae_spatial"], shape["width"] // shape["vae_spatial"]


def inputs_wan(cfg, shape, batch, device, dtype):
    t, h, w = _video_latent(shape)
    pt, ph, pw = cfg["patch_size"]
    txt = shape["text_tokens"]
    n_vid = (t // pt) * (h // ph) * (w // pw)
    # Wan2.2-TI2V-5B's pipeline runs with `expand_timesteps=True`: one timestep per video token ([B, N]), so the
    # time embedding and its 6x modulation projection run per token.
    ts_shape = (batch, n_vid) if shape.get("expand_timesteps") else (batch,)
    kwargs = dict(
        hidden_states=_rand(batch, cfg["in_channels"], t, h, w, device=device, dtype=dtype),
        timestep=torch.full(ts_shape, 500.0, device=device),
        encoder_hidden_states=_rand(batch, txt, cfg["text_dim"], device=device, dtype=dtype),
        return_dict=False,
    )
    return kwargs, dict(latent=(cfg["in_channels"], t, h, w), img_tokens=n_vid, txt_tokens=txt)


def inputs_ltx(cfg, shape, batch, device, dtype):
    t, h, w = _video_latent(shape)
    txt = shape["text_tokens"]
    kwargs = dict(
        hidden_states=_rand(batch, t * h * w, cfg["in_channels"], device=device, dtype=dtype),  # packed, patch 1
        encoder_hidden_states=_rand(batch, txt, cfg["caption_channels"], device=device, dtype=dtype),
        timestep=torch.full((batch,), 500.0, device=device),
        encoder_attention_mask=torch.ones(batch, txt, device=device, dtype=torch.long),
        num_frames=t,
        height=h,
        width=w,
        rope_interpolation_scale=(shape["vae_temporal"] / shape["fps"], shape["vae_spatial"], shape["vae_spatial"]),
        return_dict=False,
    )
    return kwargs, dict(latent=(cfg["in_channels"], t, h, w), img_tokens=t * h * w, txt_tokens=txt)


def inputs_cosmos3(cfg, shape, batch, device, dtype):
    """One packed text+vision sequence (the model has no batch axis), as Cosmos3OmniPipeline builds it for
    text-to-image: every vision token noisy, mRoPE positions from diffusers' own helpers."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    if batch != 1:
        raise ValueError("Cosmos3OmniTransformer packs one sample per call (no batch axis)")
    defaults = dict(enable_fps_modulation=True, unified_3d_mrope_temporal_modality_margin=15000,
                    unified_3d_mrope_reset_spatial_ids=True, base_fps=24)
    cfg = {**defaults, **cfg}
    t, h, w = _video_latent(shape)
    p, c = cfg["latent_patch_size"], cfg["latent_channel"]
    gh, gw = math.ceil(h / p), math.ceil(w / p)
    n_vis, und = t * gh * gw, shape["text_tokens"]
    text_pos, next_offset = get_3d_mrope_ids_text_tokens(
        num_tokens=und, temporal_offset=0, use_float_positions=cfg["enable_fps_modulation"]
    )
    vis_pos, _ = get_3d_mrope_ids_vae_tokens(
        grid_t=t, grid_h=gh, grid_w=gw,
        temporal_offset=next_offset + cfg["unified_3d_mrope_temporal_modality_margin"],
        reset_spatial_indices=cfg["unified_3d_mrope_reset_spatial_ids"],
        fps=None, base_fps=float(cfg["base_fps"]), temporal_compression_factor=1,
    )
    vis_idx = torch.arange(und, und + n_vis, dtype=torch.long, device=device)
    kwargs = dict(
        input_ids=torch.randint(0, cfg["vocab_size"], (und,), device=device),
        text_indexes=torch.arange(und, dtype=torch.long, device=device),
        position_ids=torch.cat([text_pos, vis_pos.to(text_pos.dtype)], dim=1).to(device),
        und_len=und,
        sequence_length=und + n_vis,
        vision_tokens=[_rand(1, c, t, h, w, device=device, dtype=dtype)],
        vision_token_shapes=[(t, gh, gw)],
        vision_sequence_indexes=vis_idx,
        vision_mse_loss_indexes=vis_idx,
        vision_timesteps=torch.full((n_vis,), 500.0, device=device),  # fp32 t = 1000·σ per token
        vision_noisy_frame_indexes=[torch.arange(t, dtype=torch.long, device=device)],
        return_dict=False,
    )
    return kwargs, dict(latent=(c, t, h, w), img_tokens=n_vis, txt_tokens=und)


# ---------------------------------------------------------------------------------------------------------
# What to run.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    shape: dict
    batch: int = 1
    label: str = ""  # appended to the model name in the table


@dataclass
class Spec:
    family: str
    model: str
    cls_name: str
    config: dict
    inputs: Callable
    runs: list[Run]
    config_source: str = "published (as remembered)"
    tiny_config: dict = field(default_factory=dict)
    tiny_shape: dict = field(default_factory=dict)  # overrides applied to every run's shape under --tiny


SD3_SHAPE = dict(height=512, width=512, vae_spatial=8, text_tokens=SD35_MEDIUM_TEXT_TOKENS)  # 77 CLIP + 256 T5
SPECS = [
    Spec(
        "sd3", "SD3.5-Medium", "SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER, inputs_sd3,
        [Run(SD3_SHAPE), Run(SD3_SHAPE, batch=2, label=" (CFG batch 2)")],
        tiny_config=dict(num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                         caption_projection_dim=16, pooled_projection_dim=16, sample_size=8, pos_embed_max_size=16,
                         dual_attention_layers=(0,)),
        tiny_shape=dict(height=64, width=64, text_tokens=12),
    ),
    Spec(
        "flux", "FLUX.1-dev", "FluxTransformer2DModel", FLUX1_DEV, inputs_flux,
        [Run(dict(height=1024, width=1024, vae_spatial=8, text_tokens=512, guidance=3.5))],
        tiny_config=dict(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                         axes_dims_rope=(4, 6, 6)),
        tiny_shape=dict(height=64, width=64, text_tokens=12),
    ),
    Spec(
        # 1024x1024 = diffusers' QwenImagePipeline default (default_sample_size 128 x VAE 8). Qwen's own 1:1
        # bucket is 1328x1328 (6889 image tokens, ~1.7x the tokens). Prompts are not padded: 256 text tokens
        # is an assumed long prompt (max_sequence_length 512).
        "qwen_image", "Qwen-Image", "QwenImageTransformer2DModel", QWEN_IMAGE, inputs_qwen_image,
        [Run(dict(height=1024, width=1024, vae_spatial=8, text_tokens=256))],
        tiny_config=dict(in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                         joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        tiny_shape=dict(height=64, width=64, text_tokens=12),
    ),
    Spec(
        # 480x832, 81 frames -> latent 16x21x60x104, 32760 video tokens; umT5 prompts padded to 512.
        "wan2_2", "Wan2.2-T2V-A14B (one expert)", "WanTransformer3DModel", WAN22_A14B_EXPERT, inputs_wan,
        [Run(dict(height=480, width=832, frames=81, vae_spatial=8, vae_temporal=4, text_tokens=512))],
        tiny_config=dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
                         freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64),
        tiny_shape=dict(height=64, width=64, frames=5, text_tokens=12),
    ),
    Spec(
        # 704x1280, 121 frames -> latent 48x31x44x80, 27280 video tokens; per-token timesteps.
        "wan2_2", "Wan2.2-TI2V-5B", "WanTransformer3DModel", WAN22_TI2V_5B, inputs_wan,
        [Run(dict(height=704, width=1280, frames=121, vae_spatial=16, vae_temporal=4, text_tokens=512,
                  expand_timesteps=True))],
        tiny_config=dict(num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=8, text_dim=32,
                         freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64),
        tiny_shape=dict(height=128, width=128, frames=5, text_tokens=12),
    ),
    Spec(
        # LTXPipeline: 512x768, 121 frames -> latent 128x16x16x24 (32x spatial, 8x temporal), 6144 tokens after
        # packing (patch 1); T5 prompts padded to 128; rope scale (8/fps, 32, 32) at 25 fps.
        "ltx", "LTX-Video 0.9.x", "LTXVideoTransformer3DModel", LTX_VIDEO_09, inputs_ltx,
        [Run(dict(height=512, width=768, frames=121, vae_spatial=32, vae_temporal=8, fps=25, text_tokens=128))],
        tiny_config=dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                         cross_attention_dim=32, num_layers=2, caption_channels=32),
        tiny_shape=dict(height=64, width=64, frames=9, text_tokens=12),
    ),
    Spec(
        # Text-to-image (the cosmos3 family's mode) at Cosmos3OmniPipeline's default 720x1280 -> latent 48x1x45x80,
        # padded to 23x40 = 920 patches. 256 und (text) tokens: system prompt + chat template + resolution
        # template + a prompt, assumed.
        "cosmos3", "Cosmos3 Omni (assumed config)", "Cosmos3OmniTransformer", COSMOS3_ASSUMED, inputs_cosmos3,
        [Run(dict(height=720, width=1280, frames=1, vae_spatial=16, vae_temporal=4, text_tokens=256))],
        config_source="assumed: diffusers 0.42.1 Cosmos3OmniTransformer __init__ defaults",
        tiny_config=dict(head_dim=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, latent_channel=16, patch_latent_dim=64,
                         rope_axes_dim=[2, 1, 1], rope_theta=10000.0, vocab_size=1000),
        tiny_shape=dict(height=64, width=64, text_tokens=12),
    ),
]
FAMILIES = list(dict.fromkeys(s.family for s in SPECS))


# ---------------------------------------------------------------------------------------------------------
# Build, measure, report.
# ---------------------------------------------------------------------------------------------------------


def build_model(spec: Spec, config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Construct on `device` (fp32 init), then cast to `dtype` tensor by tensor like from_pretrained(torch_dtype)."""
    import diffusers

    cls = getattr(diffusers, spec.cls_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**config)
    model.to(device)  # stragglers created on the CPU in __init__ (numpy-built position tables)
    cast_like_from_pretrained(model, dtype)
    model.eval().requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    embed = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in ("embed_tokens", "lm_head"))
    return total, total - embed


def first_tensor(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _sdpa_flops_gqa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Fused attention FLOPs that also allow fewer key/value heads than query heads (grouped-query attention,
    which torch's own formula rejects): 2·B·Hq·Lq·Lk·(Dqk + Dv)."""
    batch, query_heads, query_len, head_dim = query_shape
    key_len, value_dim = key_shape[-2], value_shape[-1]
    return 2 * batch * query_heads * query_len * key_len * (head_dim + value_dim)


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    sdpa_ops = [aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                aten._scaled_dot_product_cudnn_attention]
    return FlopCounterMode(display=False, custom_mapping={op: _sdpa_flops_gqa for op in sdpa_ops})


def measure(model, kwargs, device: torch.device, warmup: int, repeats: int) -> dict:

    cuda = device.type == "cuda"
    with torch.no_grad():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        counter = _flop_counter()
        with counter:  # the counted forward doubles as the first warm-up
            out = model(**kwargs)
        sample = first_tensor(out)
        finite = bool(torch.isfinite(sample).all().item())
        out_shape = list(sample.shape)
        del out, sample
        for _ in range(warmup):
            model(**kwargs)
        synchronize(device)
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            model(**kwargs)
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    flops = counter.get_total_flops()
    ms = statistics.median(times)
    return dict(
        flops=flops,
        tflop=flops / 1e12,
        ms=ms,
        ms_all=[round(t, 3) for t in times],
        tflops_achieved=(flops / 1e12) / (ms / 1e3) if ms > 0 else float("nan"),
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        output_finite=finite,
        output_shape=out_shape,
    )


def resolution_str(shape: dict) -> str:
    res = f"{shape['width']}x{shape['height']}"
    return res + (f", {shape['frames']} frames" if shape.get("frames", 1) > 1 else "")


def bench_spec(spec: Spec, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    config = {**spec.config, **(spec.tiny_config if args.tiny else {})}
    rows = []
    base = dict(family=spec.family, config_source=spec.config_source, class_name=spec.cls_name, config=config)
    log(f"{spec.family}: building {spec.model} ({spec.cls_name}) on {device} ...")
    model = None
    try:
        t_build = time.perf_counter()
        model = build_model(spec, config, device, dtype)
        synchronize(device)
        build_s = time.perf_counter() - t_build
        params, params_no_embed = count_params(model)
        log(f"{spec.family}: built in {build_s:.1f}s, {_num(params / 1e9, 3)} B params")
    except Exception as exc:  # noqa: BLE001 — a failing family reports and the script goes on
        traceback.print_exc()
        model = None
        err = f"build failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        for run in spec.runs:
            shape = {**run.shape, **(spec.tiny_shape if args.tiny else {})}
            rows.append(dict(base, model=spec.model + run.label, resolution=resolution_str(shape), batch=run.batch,
                             error=err))
        _free(device)
        return rows
    for run in spec.runs:
        shape = {**run.shape, **(spec.tiny_shape if args.tiny else {})}
        row = dict(base, model=spec.model + run.label, resolution=resolution_str(shape), batch=run.batch,
                   params=params, params_b=params / 1e9, params_no_embed_b=params_no_embed / 1e9, build_s=build_s)
        try:
            kwargs, desc = spec.inputs(config, shape, run.batch, device, dtype)
            row.update(latent=list(desc["latent"]), img_tokens=desc["img_tokens"], txt_tokens=desc["txt_tokens"],
                       tokens=desc["img_tokens"] + desc["txt_tokens"])
            log(f"{spec.family}: forward {row['model']} at {row['resolution']}, batch {run.batch}, "
                f"{desc['img_tokens']} latent + {desc['txt_tokens']} text tokens ...")
            row.update(measure(model, kwargs, device, args.warmup, args.repeats))
            log(f"{spec.family}: {_num(row['tflop'], 2)} TFLOP, {row['ms']:.1f} ms, "
                f"{_num(row['tflops_achieved'], 1)} TFLOP/s"
                + (f", peak {row['peak_mem_gib']:.1f} GiB" if row["peak_mem_gib"] is not None else ""))
            del kwargs
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"forward failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        rows.append(row)
        _free(device)
    del model
    _free(device)
    return rows


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _num(x: float, digits: int) -> str:
    """Fixed decimals for real sizes; significant digits for the tiny smoke test's very small numbers."""
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (1 - digits) or x == 0 else f"{x:.2g}"


def markdown(rows: list[dict]) -> str:
    head = ("| family | model | resolution / frames | tokens (latent + text) | batch | params (B) | TFLOP / fwd "
            "| ms / fwd | TFLOP/s | peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r and "ms" not in r:
            tok = f"{r['img_tokens']} + {r['txt_tokens']}" if "img_tokens" in r else "–"
            params = _num(r["params_b"], 3) if "params_b" in r else "–"
            lines.append(f"| {r['family']} | {r['model']} | {r['resolution']} | {tok} | {r['batch']} | {params} "
                         f"| ERROR: {r['error']} | | | |")
            continue
        peak = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "–"
        lines.append(
            f"| {r['family']} | {r['model']} | {r['resolution']} | {r['img_tokens']} + {r['txt_tokens']} "
            f"| {r['batch']} | {_num(r['params_b'], 3)} | {_num(r['tflop'], 2)} | {r['ms']:.1f} "
            f"| {_num(r['tflops_achieved'], 1)} "
            f"| {peak} |"
        )
    return "\n".join(lines)


def meta_check(specs: list[Spec], tiny: bool, flops: bool) -> None:
    """Build each selected model on the meta device (no memory) and print its parameter count; with `flops`,
    also run each forward on meta tensors (shape check + FLOP count; SDPA on meta is counted like on CUDA)."""
    for spec in specs:
        config = {**spec.config, **(spec.tiny_config if tiny else {})}
        try:
            model = build_model(spec, config, torch.device("meta"), torch.bfloat16)
            total, no_embed = count_params(model)
            extra = f" ({no_embed / 1e9:.3f} B without embed_tokens/lm_head)" if no_embed != total else ""
            print(f"{spec.family:11s} {spec.model:32s} {total:>15,d} params = {total / 1e9:.3f} B{extra}", flush=True)
            if flops:  # a forward on meta tensors: checks the input shapes and counts FLOPs without compute
                from torch.utils.flop_counter import FlopCounterMode

                if spec.cls_name == "Cosmos3OmniTransformer":
                    # torch.autocast(device_type="meta") raises, so stand in for the mRoPE table (no FLOPs counted
                    # there anyway): [1, N, head_dim] cos and sin, as the real module returns for [3, 1, N] ids.
                    def _meta_rope(position_ids, device, dtype, _d=config["head_dim"]):
                        n = position_ids.shape[-1]
                        return (torch.empty(1, n, _d, device=device, dtype=dtype),) * 2

                    model.rotary_emb.forward = _meta_rope

                for run in spec.runs:
                    shape = {**run.shape, **(spec.tiny_shape if tiny else {})}
                    try:
                        kwargs, desc = spec.inputs(config, shape, run.batch, torch.device("meta"), torch.bfloat16)
                        counter = FlopCounterMode(display=False)
                        with torch.no_grad(), counter:
                            out = first_tensor(model(**kwargs))
                        print(f"{'':11s}   {resolution_str(shape)}, batch {run.batch}: {desc['img_tokens']} latent + "
                              f"{desc['txt_tokens']} text tokens, out {list(out.shape)}, "
                              f"{counter.get_total_flops() / 1e12:.2f} TFLOP per forward", flush=True)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{'':11s}   meta forward failed: {type(exc).__name__}: {exc}", flush=True)
            del model
        except Exception as exc:  # noqa: BLE001
            print(f"{spec.family:11s} {spec.model:32s} build failed: {type(exc).__name__}: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="1-2-layer miniature configs and shapes (CPU smoke test)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards; the median is reported")
    ap.add_argument("--warmup", type=int, default=1, help="untimed forwards after the FLOP-counted one")
    ap.add_argument("--out", default=None, help="write the table and all numbers as JSON here")
    ap.add_argument("--meta-check", action="store_true", help="only build on the meta device and print param counts")
    ap.add_argument("--meta-forward", action="store_true", help="with --meta-check: also a forward on meta tensors")
    args = ap.parse_args()

    wanted = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(wanted) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {FAMILIES}")
    specs = [s for s in SPECS if s.family in wanted]

    if args.meta_check:
        meta_check(specs, args.tiny, args.meta_forward)
        return

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    dtype = torch.bfloat16
    import diffusers

    env = dict(torch=torch.__version__, diffusers=diffusers.__version__, device=str(device), tiny=args.tiny,
               repeats=args.repeats, warmup=args.warmup, dtype="bfloat16")
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_mem_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        env["threads"] = torch.get_num_threads()
    log(f"start: {env}")

    rows: list[dict] = []
    for spec in specs:
        rows.extend(bench_spec(spec, args, device, dtype))
        if args.out:  # keep partial results if a later family takes the machine down
            _write(args.out, env, rows)

    table = markdown(rows)
    log("done")
    print()
    print(table)
    if args.out:
        _write(args.out, env, rows)
        print(f"\nwrote {args.out}")


def _write(path: str, env: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(env=env, rows=rows, markdown=markdown(rows), total_s=time.perf_counter() - T0), f, indent=2,
                  default=str)


if __name__ == "__main__":
    main()
