"""The rollout-gradient engine's LoRA taps: each sample's factor gradients in one engine step, timed per form.

    python bench/bench_adapter_tap.py --device cuda                  # SD3.5-Medium at 512², a tile of 8 with CFG
    python bench/bench_adapter_tap.py --device cpu --tokens 64 --text-tokens 16 --tiles 1

Why: in a profiled step of `--diffusion-rollout-gradient` (bench/RESULTS.md, thirty-third section) the taps'
thin matmuls (u = x·Aᵀ, v = g·B, ∇B = gᵀu, ∇A = vᵀx per sample, miles/engine/rollout_gradients.py) were
≈ 5 400 of the step's 20 104 kernels and ≈ 0.054 s of its 0.847 s. They are memory-bound: each reads a layer's
whole input x or output gradient g. This times the engine's form (`adapter_factor_gradients`: every CFG copy in
one batched matmul) beside the per-copy loop it replaced, for every LoRA target of SD3.5-Medium (8 attention
projections of width 1536 in each of 24 blocks, the last block's context output absent: 191 layers; image tokens
for the image stream's, text tokens for the context stream's), over one step's tiles, with the bytes the four
matmuls must read as the floor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from miles.engine.rollout_gradients import adapter_factor_gradients  # noqa: E402
from miles.testing.real_size import synchronize  # noqa: E402

# (tokens the layer sees, layers of SD3.5-Medium with it): the image stream's to_q/k/v/out in all 24 blocks; the
# context stream's add_q/k/v in all 24 and to_add_out in the first 23
LAYER_GROUPS = (("image", 4 * 24), ("text", 3 * 24 + 23))


def per_copy_factor_gradients(x, g, a, b):
    """The form before the thirty-third session: one set of four matmuls per CFG copy, summed as they come."""
    samples = a.shape[0]
    g = g.to(x.dtype)
    low_a, low_b = a.to(x.dtype), b.to(x.dtype)
    grad_a = grad_b = None
    for lo in range(0, x.shape[0], samples):
        xs, gs = x[lo : lo + samples], g[lo : lo + samples]
        u = torch.bmm(xs, low_a.transpose(1, 2))
        v = torch.bmm(gs, low_b)
        part_b = torch.bmm(gs.transpose(1, 2), u).to(b.dtype)
        part_a = torch.bmm(v.transpose(1, 2), xs).to(a.dtype)
        grad_a = part_a if grad_a is None else grad_a + part_a
        grad_b = part_b if grad_b is None else grad_b + part_b
    return grad_a, grad_b


FORMS = {"per copy (before)": per_copy_factor_gradients, "copies batched (the engine's)": adapter_factor_gradients}


def layer_inputs(tokens: int, opts, device: str, dtype: torch.dtype, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = opts.copies * opts.tile

    def draw(*shape, kind=dtype):
        return torch.randn(*shape, generator=generator, device=device, dtype=kind)

    return (draw(rows, tokens, opts.width), draw(rows, tokens, opts.width),
            draw(opts.tile, opts.rank, opts.width, kind=torch.float32),
            draw(opts.tile, opts.width, opts.rank, kind=torch.float32))


ROTATION = 3  # input sets per group, taken in turn, so that a layer's x and g are not still in the L2 cache


def time_form(fn, inputs: dict, opts, device: str) -> float:
    """Seconds of one step's taps in this form: each group's layers × the step's tiles, the best of three."""
    def one_step():
        for name, layers in LAYER_GROUPS:
            for i in range(layers * opts.tiles):
                fn(*inputs[name][i % ROTATION])

    one_step()
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        began = time.perf_counter()
        one_step()
        synchronize(device)
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tile", type=int, default=8, help="samples per tile (--rollout-gradient-tile)")
    parser.add_argument("--copies", type=int, default=2, help="CFG copies of each sample (2: the doubled batch)")
    parser.add_argument("--tiles", type=int, default=4, help="tiles per step (32 samples at a tile of 8)")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens (1024 at 512²)")
    parser.add_argument("--text-tokens", type=int, default=333, help="77 CLIP + 256 T5 tokens")
    parser.add_argument("--width", type=int, default=1536, help="the projections' width (SD3.5-Medium: 1536)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in TB/s for the floor (default: 3.35 on an H100, 4.8 on an H200)")
    opts = parser.parse_args()
    device = opts.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bandwidth = opts.bandwidth or (4.8 if "H200" in name else 3.35 if "H100" in name else None)
    inputs = {"image": [layer_inputs(opts.tokens, opts, device, dtype, i) for i in range(ROTATION)],
              "text": [layer_inputs(opts.text_tokens, opts, device, dtype, ROTATION + i) for i in range(ROTATION)]}

    reference = per_copy_factor_gradients(*inputs["image"][0])
    element = torch.finfo(dtype).bits // 8
    # each of the four matmuls reads x or g whole: 4 reads of [rows, tokens, width] per layer
    step_bytes = sum(4 * opts.copies * opts.tile * tokens * opts.width * element * layers * opts.tiles
                     for tokens, (_, layers) in zip((opts.tokens, opts.text_tokens), LAYER_GROUPS))
    print(f"{name}, {dtype}: {sum(n for _, n in LAYER_GROUPS)} layers of width {opts.width}, rank {opts.rank}, "
          f"{opts.tiles} tiles of {opts.tile} samples × {opts.copies} copies, {opts.tokens} image / "
          f"{opts.text_tokens} text tokens")
    print("\n| form | one step's taps s | reads GB/s | largest difference from the per-copy form |\n|---|---|---|---|")
    if bandwidth:
        print(f"| floor ({step_bytes / 1e9:.1f} GB read at {bandwidth} TB/s) | {step_bytes / bandwidth / 1e12:.4f} | "
              f"{bandwidth * 1e3:.0f} | – |")
    for label, fn in FORMS.items():
        seconds = time_form(fn, inputs, opts, device)
        got = fn(*inputs["image"][0])
        diff = max((g - r).abs().max().item() for g, r in zip(got, reference))
        print(f"| {label} | {seconds:.4f} | {step_bytes / seconds / 1e9:.0f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
