"""Which compile mode runs the no-replay engine's blocks fastest: one SD3.5-Medium block of each kind, its forward
and backward as the engine's gradient step runs them at its tile, timed per mode in one process.

    python bench/bench_block_compile.py --device cuda                          # eager vs the engine's default
    python bench/bench_block_compile.py --device cuda --modes default,max-autotune-no-cudagraphs   # > 9 min
    python bench/bench_block_compile.py --device cuda --modes default --inductor coordinate_descent_tuning=True
    python bench/bench_block_compile.py --device cpu --image-tokens 16 --text-tokens 8 --tile 1 --modes eager

Why: the `--diffusion-rollout-gradient` engine's denoising steps are the documented LoRA iteration (8.9 of 9.7 s on
an H100, bench/RESULTS.md), kernel-bound: cuBLAS matmuls ≈ 49 %, cuDNN attention ≈ 28 %, compiled elementwise
kernels (GELU, the norms and their backwards) ≈ 22 %. Inductor's default leaves every matmul to cuBLAS, so none
of those elementwise kernels can join a matmul; `max-autotune` also tries its Triton matmul templates, which can
take a neighbouring norm or GELU into their epilogue, and keeps whichever is faster per shape. Timing the whole
engine that way costs a compile of every graph (more than a 600 s call); a block of each kind compiles in minutes
and says whether it pays. It did not (H100, thirty-third session in bench/RESULTS.md): for every matmul shape of
these blocks cuBLAS beat the fastest Triton template by 15–22 %, so the autotuner keeps cuBLAS and fuses nothing,
and the three blocks' autotuning outlasted a 580 s call; so the default modes are now eager and the engine's.

A block here is diffusers' `JointTransformerBlock` with SD3.5-Medium's widths (random bf16 weights, frozen), run
as the engine's gradient step runs it: the CFG-doubled tile (2 × `--tile` sequences of 1024 image and 333 text
tokens at 512²), the inputs requiring gradients, the backward taking the input gradients (the weights are frozen)
and, through the engine's own LoRA taps on the family's targets (miles/engine/rollout_gradients.py, random
rank-`--lora-rank` factors), each sample's factor gradients. The kinds: dual attention
(blocks 0–12), joint (13–22), the last (23, context pre-only); "one step" sums them over SD3.5-Medium's 24 blocks
and the rollout's tiles, to set against the engine's measured steps. Attention runs what PyTorch's dispatcher
picks, as the engine's SD3 blocks do (cuDNN on Hopper).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from bench.bench_e2e import measured_peak_tflops  # noqa: E402
from bench.profile_rollout import inductor_settings, random_lora_factors  # noqa: E402
from miles.testing.real_size import SD35_MEDIUM_TRANSFORMER, synchronize  # noqa: E402

# (kind, how many of SD3.5-Medium's 24 blocks are of it, JointTransformerBlock's switches)
BLOCK_KINDS = (
    ("dual", 13, dict(context_pre_only=False, use_dual_attention=True)),
    ("joint", 10, dict(context_pre_only=False, use_dual_attention=False)),
    ("last", 1, dict(context_pre_only=True, use_dual_attention=False)),
)


def build_block(switches: dict, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from diffusers.models.attention import JointTransformerBlock

    config = SD35_MEDIUM_TRANSFORMER
    torch.manual_seed(seed)
    with torch.device(device):
        block = JointTransformerBlock(
            dim=config["num_attention_heads"] * config["attention_head_dim"],
            num_attention_heads=config["num_attention_heads"], attention_head_dim=config["attention_head_dim"],
            qk_norm=config["qk_norm"], **switches,
        )
    return block.to(dtype).eval().requires_grad_(False)


def block_inputs(sequences: int, image_tokens: int, text_tokens: int, dim: int, device: str, dtype: torch.dtype,
                 seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    return {"hidden": draw(sequences, image_tokens, dim), "text": draw(sequences, text_tokens, dim),
            "temb": draw(sequences, dim), "grad_hidden": draw(sequences, image_tokens, dim),
            "grad_text": draw(sequences, text_tokens, dim)}


def install_lora_taps(blocks: dict[str, torch.nn.Module], rank: int, device: str):
    """The engine's per-sample LoRA taps on the blocks' SD3 targets (None without a rank)."""
    if not rank:
        return None
    from miles.engine.rollout_gradients import RolloutGradients
    from miles.models.sd3 import SD3_LORA_TARGETS

    holder = torch.nn.ModuleDict(blocks)
    gradients = RolloutGradients({"blocks": holder})
    random_lora_factors(gradients, "blocks", holder, SD3_LORA_TARGETS, rank, device)
    return gradients


def gradient_step(fn, inputs: dict[str, torch.Tensor], taps=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's forward with the inputs requiring gradients (and, with `taps`, a tile of per-sample factor
    rows, one per CFG pair of sequences), then the backward of its outputs against fixed output gradients: the
    input gradients (the weights are frozen, as the base is under LoRA) and the rows' gradients."""
    hidden = inputs["hidden"].detach().requires_grad_(True)
    text = inputs["text"].detach().requires_grad_(True)
    if taps is not None:
        taps.forward_rows(taps.tile_rows(hidden.shape[0] // 2))
    try:
        text_out, hidden_out = fn(hidden, text, inputs["temb"])
    finally:
        if taps is not None:
            taps.forward_rows(None)
    outputs, grads = [hidden_out], [inputs["grad_hidden"]]
    if text_out is not None:  # the last block returns no text stream
        outputs.append(text_out)
        grads.append(inputs["grad_text"])
    torch.autograd.backward(outputs, grads)
    return hidden.grad, text.grad


def count_tflop(block: torch.nn.Module, inputs: dict[str, torch.Tensor], taps) -> float:
    """The step's FLOPs by torch's formulas (matmuls and attention), counted on the eager block."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        gradient_step(block, inputs, taps)
    return counter.get_total_flops() / 1e12


def time_step(fn, inputs: dict[str, torch.Tensor], taps, device: str, repeats: int) -> float:
    """Seconds of one step, the best of three rounds of `repeats`."""
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        began = time.perf_counter()
        for _ in range(repeats):
            gradient_step(fn, inputs, taps)
        synchronize(device)
        best = min(best, (time.perf_counter() - began) / repeats)
    return best


def measure_mode(mode: str, blocks: dict, inputs: dict, taps, reference: dict, settings: dict, device: str,
                 repeats: int) -> dict:
    """Per kind: compile (first two steps), seconds per step, the input gradient's largest difference from the
    eager block's, relative to its largest value."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # each mode compiles from nothing
    row = {"mode": mode, "kinds": {}}
    with inductor_config.patch(settings):
        for kind, block in blocks.items():
            fn = block if mode == "eager" else torch.compile(block, mode=None if mode == "default" else mode,
                                                             dynamic=False)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            for _ in range(2):
                grad_hidden, _ = gradient_step(fn, inputs, taps)
            synchronize(device)
            warm = time.perf_counter() - began
            seconds = time_step(fn, inputs, taps, device, repeats)
            scale = reference[kind].abs().max().clamp_min(1e-30)
            row["kinds"][kind] = {
                "warm_s": warm, "s": seconds,
                "rel_diff": float((grad_hidden.float() - reference[kind]).abs().max() / scale),
                "peak_gib": torch.cuda.max_memory_allocated() / (1 << 30) if device == "cuda" else None,
            }
            print(f"  {mode:>28} {kind:>5}: warm-up {warm:7.1f} s, {seconds * 1e3:8.2f} ms a step", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default="eager,default",
                        help="comma-separated: eager, default (the engine's), or a torch.compile mode")
    parser.add_argument("--tile", type=int, default=8, help="samples per tile (the engine's --rollout-gradient-tile)")
    parser.add_argument("--samples", type=int, default=32, help="samples per rollout (for the per-step sum)")
    parser.add_argument("--image-tokens", type=int, default=1024, help="1024 at 512² (64 × 64 latents, patch 2)")
    parser.add_argument("--text-tokens", type=int, default=333, help="77 CLIP + 256 T5 tokens")
    parser.add_argument("--lora-rank", type=int, default=32, help="the engine's LoRA taps' rank (0: no taps)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="a torch._inductor.config setting for every compiled mode (repeatable)")
    opts = parser.parse_args()

    device = opts.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dim = SD35_MEDIUM_TRANSFORMER["num_attention_heads"] * SD35_MEDIUM_TRANSFORMER["attention_head_dim"]
    sequences = 2 * opts.tile  # CFG doubles the tile
    blocks = {kind: build_block(switches, device, dtype, seed) for seed, (kind, _, switches) in enumerate(BLOCK_KINDS)}
    inputs = block_inputs(sequences, opts.image_tokens, opts.text_tokens, dim, device, dtype, seed=0)
    taps = install_lora_taps(blocks, opts.lora_rank, device)
    reference = {kind: gradient_step(block, inputs, taps)[0].float() for kind, block in blocks.items()}
    tflop = {kind: count_tflop(block, inputs, taps) for kind, block in blocks.items()}
    peak = measured_peak_tflops(device)
    settings = inductor_settings(opts.inductor)
    tiles = opts.samples // opts.tile
    counts = {kind: count for kind, count, _ in BLOCK_KINDS}
    step_tflop = tiles * sum(counts[kind] * tflop[kind] for kind in blocks)
    print(f"{device}, {dtype}, tile {opts.tile} ({sequences} sequences of {opts.image_tokens} + {opts.text_tokens} "
          f"tokens), LoRA taps of rank {opts.lora_rank} on {len(taps.layers) if taps else 0} layers, measured peak "
          f"{peak:.3g} TFLOP/s, inductor {settings or 'as is'}", flush=True)

    rows = [measure_mode(mode, blocks, inputs, taps, reference, settings, device, opts.repeats)
            for mode in opts.modes.split(",") if mode]

    print(f"\n| mode | {' | '.join(f'{kind} ms (TFLOP/s)' for kind in blocks)} | one step's blocks s | "
          f"MFU | warm-up s | input-gradient rel. diff from eager | peak GiB |")
    print("|---|" + "---|" * (len(blocks) + 5))
    print(f"| floor ({step_tflop:.3g} TFLOP at {peak:.3g} TFLOP/s) | "
          + " | ".join(f"{tflop[kind] / peak * 1e3:.2f}" for kind in blocks)
          + f" | {step_tflop / peak:.3f} | 100 % | – | – | – |")
    for row in rows:
        kinds = row["kinds"]
        step = tiles * sum(counts[kind] * kinds[kind]["s"] for kind in kinds)
        cells = " | ".join(f"{kinds[k]['s'] * 1e3:.2f} ({tflop[k] / kinds[k]['s']:.3g})" for k in kinds)
        peaks = [kinds[k]["peak_gib"] for k in kinds if kinds[k]["peak_gib"] is not None]
        peak_gib = f"{max(peaks):.2f}" if peaks else "–"
        print(f"| {row['mode']} | {cells} | {step:.3f} | {step_tflop / peak / step:.0%} | "
              f"{sum(kinds[k]['warm_s'] for k in kinds):.1f} | "
              f"{max(kinds[k]['rel_diff'] for k in kinds):.1e} | {peak_gib} |")
    print(f"\n(one step: {tiles} tiles × (13 dual + 10 joint + 1 last) blocks; the engine's measured step also has "
          f"the embeddings, the final layer and the SDE step)")


if __name__ == "__main__":
    main()
