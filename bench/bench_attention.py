"""Each SDPA kernel at a DiT's attention shape: forward, forward + backward, against the FLOP floor, one table.

    python bench/bench_attention.py --device cuda                      # SD3.5-Medium at 512², a tile of 8 with CFG
    python bench/bench_attention.py --device cuda --batch 32 --tokens 1357
    python bench/bench_attention.py --device cpu --batch 2 --tokens 256  # a smoke test of the script

The no-replay engine's gradient pass and the trainer's replay spend a fifth of their kernel time in attention's
backward (bench/RESULTS.md, ninth session: cuDNN's 1.65 s of a train step's 7.4 s), for a few percent of the
FLOPs. This measures, at one shape, every kernel torch's `scaled_dot_product_attention` can dispatch to (flash,
cuDNN, memory-efficient, math), so the choice for `--fsdp-attention-backend` and the engine's attention backend
rests on a number. Default shape: SD3.5-Medium at 512² (1,024 image + 333 text tokens in one joint attention,
24 heads of 64), batch 16 (a tile of 8 samples, CFG doubled), bf16.

The kernels are diffusers' attention backends `_native_flash`, `_native_cudnn`, `_native_efficient` and
`_native_math`, the names `--fsdp-attention-backend` (trainer) and `--sglang-attention-backend` (engines) take.

FLOPs: forward 4·B·H·S²·D (QKᵀ and PV); backward 2.5× that (the recomputed scores and the three gradient
matmuls). `deterministic`: two backward passes on the same inputs give the same bits.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - began)
    return sorted(seconds)[len(seconds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1357)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[opts.dtype]
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (opts.batch, opts.heads, opts.tokens, opts.head_dim)
    q, k, v = (torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_(True)
               for _ in range(3))
    grad = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    forward_flops = 4 * opts.batch * opts.heads * opts.tokens ** 2 * opts.head_dim
    print(f"{device}, torch {torch.__version__}, q/k/v {list(shape)} {opts.dtype}: forward {forward_flops / 1e9:.1f} "
          f"GFLOP, backward {2.5 * forward_flops / 1e9:.1f} GFLOP")
    print("| kernel | forward ms | forward TFLOP/s | forward + backward ms | forward + backward TFLOP/s | deterministic "
          "backward |")
    print("|---|---|---|---|---|---|")
    for name in [b.strip() for b in opts.backends.split(",") if b.strip()]:
        backend = BACKENDS[name]

        def forward():
            with sdpa_kernel(backend), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v)

        def forward_backward():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v)
            return torch.autograd.grad(out, (q, k, v), grad)

        try:
            fwd = timed(forward, device, opts.repeats)
            both = timed(forward_backward, device, opts.repeats)
            first, second = forward_backward(), forward_backward()
        except RuntimeError as err:  # this kernel does not take this shape, dtype or device
            print(f"| {name} | not available: {str(err).splitlines()[0][:80]} | | | | |")
            continue
        same = all(torch.equal(a, b) for a, b in zip(first, second))
        print(f"| {name} | {fwd * 1e3:.2f} | {forward_flops / fwd / 1e12:.1f} | {both * 1e3:.2f} | "
              f"{3.5 * forward_flops / both / 1e12:.1f} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
