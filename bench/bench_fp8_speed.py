"""What FP8 matmuls would save in the engine's step under `--diffusion-rollout-gradient`, before building one.

    python bench/bench_fp8_speed.py --device cuda            # SD3.5-Medium's block linears at 512², one tile of 8
    python bench/bench_fp8_speed.py --device cpu --tokens 16 --sequences 2   # a smoke run of the same code

The documented LoRA command's engine runs, per denoising step and tile, every linear layer of the DiT's blocks
forward and its input gradient backward (the adapter's gradient is two thin matmuls on top). Those matmuls were
49 % of the step on an H100 at ≈ 90 % of the bf16 peak (bench/RESULTS.md, seventeenth section), so FP8 is the
one lever left there that moves the matmuls themselves. This times, for each distinct linear shape of the real
architecture (read from `miles/testing/real_size.py`'s config on the meta device, so the counts are the model's),

- bf16: y = x·Wᵀ and the input gradient dX = dY·W, as the engine runs them today (adapter merged into W);
- FP8: x and dY rounded to e4m3 with a scale per row (compiled on CUDA, a kernel of its own: no fusion into the
  norm before it is assumed), the base W held twice in e4m3 (rows scaled for the forward, columns for the
  backward), `torch._scaled_mm` with fp32 accumulation and bf16 out, and the adapter's term kept out of the
  rounded weight, since merging an adapter into an e4m3 weight loses it (bench/bench_fp8_numerics.py): either
  beside the FP8 matmul in bf16 (y += s·(x·Aᵀ)·Bᵀ, dX += s·(dY·B)·A: two more passes over y or dX), or folded
  into it along the reduced dimension, y = [x | x·Aᵀ]·[W | s·B]ᵀ and dX = [dY | dY·B]·[W ; s·A] (r more columns;
  each element of B and A keeps e4m3's relative precision, as nothing is added to W before rounding),

and, as a bound, the folded matmuls alone on operands rounded beforehand (what fusing the rounding into the kernels
that produce x and dY could reach), and prints the matmul seconds per engine step each way with the measured peaks
beside them. A projection, not an engine: the step's other kernels (attention, norms, GELU) are unchanged by it
and not timed here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_attention import timed  # noqa: E402  (bench/bench_attention.py: the median over CUDA events)
from bench_fp8_numerics import quantize_rows  # noqa: E402  (bench/bench_fp8_numerics.py: the same rounding)
from miles.testing import real_size  # noqa: E402


def quantize_joined(*parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts side by side along the last dimension, as e4m3 with one scale per row (one kernel compiled)."""
    return quantize_rows(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))


def block_linear_shapes(tokens: int, text_tokens: int, sequences: int) -> Counter:
    """(rows, in, out) -> how many linear layers of SD3.5-Medium's transformer blocks have that shape, for a
    forward of `sequences` sequences: the image stream's layers see every image token, the text stream's
    (`add_*`, `ff_context`) every text token. The modulation's (`norm*.linear`, one row per sequence, on the
    timestep embedding, which takes no gradient) are left out: microseconds either way."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(**real_size.SD35_MEDIUM_TRANSFORMER)
    shapes: Counter = Counter()
    for name, module in model.transformer_blocks.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if ".norm" in name:
            continue
        if "add_" in name or "ff_context" in name:
            rows = sequences * text_tokens
        else:
            rows = sequences * tokens
        shapes[(rows, module.in_features, module.out_features)] += 1
    return shapes


def measure_shape(rows: int, k: int, n: int, rank: int, device: str, repeats: int, quantize) -> dict:
    """Seconds of one layer's forward and input-gradient backward on each path (bf16; FP8 with the adapter beside;
    FP8 with it folded; the folded matmuls alone), and the two FP8 forwards' relative error against bf16's."""
    generator = torch.Generator(device).manual_seed(rows * 7 + k * 3 + n)
    where = torch.device(device)
    bf16 = torch.bfloat16
    x = torch.randn(rows, k, device=device, dtype=bf16, generator=generator)
    dy = torch.randn(rows, n, device=device, dtype=bf16, generator=generator)
    weight = torch.randn(n, k, device=device, dtype=bf16, generator=generator) / k**0.5
    a = torch.randn(rank, k, device=device, dtype=bf16, generator=generator) / k**0.5
    b = torch.randn(n, rank, device=device, dtype=bf16, generator=generator) / rank**0.5
    w_rows, w_row_scale = quantize_rows(weight)  # [n, k]: the forward's operand, a scale per output feature
    w_cols, w_col_scale = quantize_rows(weight.t().contiguous())  # [k, n]: the backward's, a scale per input
    # the folded operands: the adapter's factor beside W along the reduced dimension, rounded with W's scales
    wb_rows, wb_row_scale = quantize_rows(torch.cat([weight, 0.5 * b], dim=1))  # [n, k + r]
    wa_cols, wa_col_scale = quantize_rows(torch.cat([weight, 0.5 * a], dim=0).t().contiguous())  # [k, n + r]

    def fp8_forward() -> torch.Tensor:
        q, scale = quantize(x)
        y = torch._scaled_mm(q, w_rows.t(), scale_a=scale, scale_b=w_row_scale.reshape(1, -1), out_dtype=bf16)
        return y.addmm_(x @ a.t(), b.t(), alpha=0.5)

    def fp8_backward() -> torch.Tensor:
        q, scale = quantize(dy)
        dx = torch._scaled_mm(q, w_cols.t(), scale_a=scale, scale_b=w_col_scale.reshape(1, -1), out_dtype=bf16)
        return dx.addmm_(dy @ b, a, alpha=0.5)

    def folded_forward() -> torch.Tensor:
        q, scale = quantize(x, x @ a.t())
        return torch._scaled_mm(q, wb_rows.t(), scale_a=scale, scale_b=wb_row_scale.reshape(1, -1), out_dtype=bf16)

    def folded_backward() -> torch.Tensor:
        q, scale = quantize(dy, dy @ b)  # dY·B: the adapter's own backward computes it anyway
        return torch._scaled_mm(q, wa_cols.t(), scale_a=scale, scale_b=wa_col_scale.reshape(1, -1), out_dtype=bf16)

    # the bound: the folded matmuls alone, their operands rounded beforehand, as if the rounding (and x·Aᵀ, dY·B)
    # came fused into the kernels that produce x and dY (the norms, GELU, attention's output)
    qx, sx = quantize(x, x @ a.t())
    qdy, sdy = quantize(dy, dy @ b)

    def bound_forward() -> torch.Tensor:
        return torch._scaled_mm(qx, wb_rows.t(), scale_a=sx, scale_b=wb_row_scale.reshape(1, -1), out_dtype=bf16)

    def bound_backward() -> torch.Tensor:
        return torch._scaled_mm(qdy, wa_cols.t(), scale_a=sdy, scale_b=wa_col_scale.reshape(1, -1), out_dtype=bf16)

    reference = (x @ weight.t()).addmm_(x @ a.t(), b.t(), alpha=0.5).float()
    return {
        "bf16_forward": timed(lambda: x @ weight.t(), where, repeats),
        "bf16_backward": timed(lambda: dy @ weight, where, repeats),
        "fp8_forward": timed(fp8_forward, where, repeats),
        "fp8_backward": timed(fp8_backward, where, repeats),
        "folded_forward": timed(folded_forward, where, repeats),
        "folded_backward": timed(folded_backward, where, repeats),
        "bound_forward": timed(bound_forward, where, repeats),
        "bound_backward": timed(bound_backward, where, repeats),
        "fp8_error": float((fp8_forward().float() - reference).norm() / reference.norm()),
        "folded_error": float((folded_forward().float() - reference).norm() / reference.norm()),
    }


def peak_tflops(device: str, fp8: bool) -> float:
    """The dense matmul rate this device reaches on square operands, bf16 or e4m3 (row-scaled)."""
    size = 8192 if device == "cuda" else 512
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    if fp8:
        (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
        seconds = timed(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1),
                                                 out_dtype=torch.bfloat16), torch.device(device), 10)
    else:
        seconds = timed(lambda: a @ b, torch.device(device), 10)
    return 2 * size**3 / seconds / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1024, help="image tokens per sequence (1024: 512² at 2×2 "
                        "patches of the 8× VAE's latents)")
    parser.add_argument("--text-tokens", type=int, default=real_size.SD35_MEDIUM_TEXT_TOKENS)
    parser.add_argument("--sequences", type=int, default=16, help="sequences per forward: a tile of 8 samples, "
                        "doubled by CFG")
    parser.add_argument("--tiles-per-step", type=int, default=4, help="tiles per denoising step (32 samples)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per rollout")
    parser.add_argument("--rank", type=int, default=32, help="the adapter's rank")
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()

    torch.manual_seed(0)
    quantize = torch.compile(quantize_joined, dynamic=False) if opts.device == "cuda" else quantize_joined
    shapes = block_linear_shapes(opts.tokens, opts.text_tokens, opts.sequences)
    peaks = {"bf16": peak_tflops(opts.device, False), "fp8": peak_tflops(opts.device, True)}
    device_name = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"
    print(f"{device_name}, torch {torch.__version__}; measured dense peak bf16 {peaks['bf16']:.4g}, "
          f"e4m3 {peaks['fp8']:.4g} TFLOP/s; {sum(shapes.values())} block linears per forward of "
          f"{opts.sequences} sequences")
    print("| rows × in → out | layers | bf16 fwd + bwd ms | FP8, adapter beside: ms | FP8, adapter folded: ms | "
          "FP8 folded, matmuls alone: ms | TFLOP/s bf16 / beside / folded / alone | forward's error beside / folded |")
    print("|---|---|---|---|---|---|---|---|")
    paths = ("bf16", "fp8", "folded", "bound")
    totals = dict.fromkeys(paths, 0.0)
    flops_total = 0.0
    for (rows, k, n), count in sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1] * item[0][2]):
        m = measure_shape(rows, k, n, opts.rank, opts.device, opts.repeats, quantize)
        seconds = {path: m[f"{path}_forward"] + m[f"{path}_backward"] for path in paths}
        flops = 2 * 2 * rows * k * n  # the base's forward and input gradient
        for path in paths:
            totals[path] += count * seconds[path]
        flops_total += count * flops
        milliseconds = " | ".join(f"{1e3 * seconds[path]:.3f}" for path in paths)
        rates = " / ".join(f"{flops / seconds[path] / 1e12:.4g}" for path in paths)
        print(f"| {rows} × {k} → {n} | {count} | {milliseconds} | {rates} | "
              f"{m['fp8_error']:.4f} / {m['folded_error']:.4f} |")
    tiles = opts.tiles_per_step
    print(f"\nper engine step ({tiles} tiles of {opts.sequences} sequences), the blocks' linear layers forward and "
          f"input-gradient backward: bf16 {tiles * totals['bf16']:.3f} s, FP8 with the adapter beside "
          f"{tiles * totals['fp8']:.3f} s, folded {tiles * totals['folded']:.3f} s, the folded matmuls alone "
          f"{tiles * totals['bound']:.3f} s; floors at the measured peaks "
          f"{tiles * flops_total / peaks['bf16'] / 1e12:.3f} s (bf16), "
          f"{tiles * flops_total / peaks['fp8'] / 1e12:.3f} s (e4m3)")
    for path, label in (("fp8", "beside"), ("folded", "folded"), ("bound", "folded, its rounding free")):
        saved = opts.steps * tiles * (totals["bf16"] - totals[path])
        print(f"per rollout of {opts.steps} steps, FP8 with the adapter {label}: {abs(saved):.2f} s "
              f"{'less' if saved >= 0 else 'more'} matmul time than bf16")


if __name__ == "__main__":
    main()
