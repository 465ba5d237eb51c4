"""Which SDPA kernels the batch_invariant group could pin, and how fast each is, at one DiT's attention shapes.

    python bench/attention_parity.py --device cuda                      # SD3.5-Medium at 512²: [16, 24, 1357, 64]
    python bench/attention_parity.py --device cpu --batch 4 --tokens 77 --heads 2   # a smoke test of the script

The group pins one attention kernel on both sides (miles/models/batch_invariant.py) so that a sample's bits do not
depend on (1) whether autograd records the forward (the engine forwards without it, the trainer with it) or (2)
where the sample sits in its fixed tile. For each kernel this prints whether both hold, bit for bit, on random
bf16 inputs, and its forward and forward + backward speed (the backward at a random cotangent). A kernel that
fails (1) can still serve `--diffusion-rollout-gradient`, where no trainer forward reproduces the engine's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def attend(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v)


def parity(backend: SDPBackend, q, k, v) -> tuple[bool, bool]:
    """(the same bits with and without autograd, the same bits for every sample with the tile reversed)."""
    with torch.no_grad():
        plain = attend(backend, q, k, v)
        reversed_tile = attend(backend, q.flip(0), k.flip(0), v.flip(0)).flip(0)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    recorded = attend(backend, *leaves)
    recorded.backward(torch.randn_like(recorded))  # the path a trainer takes, backward included
    return torch.equal(plain, recorded.detach()), torch.equal(plain, reversed_tile)


def seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16, help="sequences per forward (a tile of 8 with CFG)")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1357, help="image + text tokens (SD3.5-M at 512²: 1024 + 333)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    opts = parser.parse_args()
    device = torch.device(opts.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[opts.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (opts.batch, opts.heads, opts.tokens, opts.head_dim)
    q, k, v = (torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))
    flops = 4 * opts.batch * opts.heads * opts.tokens ** 2 * opts.head_dim  # QK^T and PV, 2 FLOPs a multiply-add
    print(f"q, k, v {list(shape)} {dtype} on {device}"
          + (f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" if device.type == "cuda" else ""))
    print("| kernel | same bits with autograd | same bits at any tile position | forward ms | forward TFLOP/s "
          "| forward + backward ms | forward + backward TFLOP/s (backward counted as 2.5 forwards) |")
    print("|---|---|---|---|---|---|---|")
    for name in filter(None, opts.backends.split(",")):
        backend = BACKENDS[name]
        try:
            with_autograd, any_position = parity(backend, q, k, v)
        except RuntimeError as err:  # the kernel does not take these inputs (dtype, device, build)
            print(f"| {name} | – | – | – | – | – | – (unavailable: {str(err).splitlines()[0][:80]}) |", flush=True)
            continue
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        cotangent = torch.randn(shape, generator=generator, device=device, dtype=dtype)

        def forward():
            with torch.no_grad():
                attend(backend, q, k, v)

        def forward_backward():
            attend(backend, *leaves).backward(cotangent)

        fwd, both = seconds(forward, device, opts.repeats), seconds(forward_backward, device, opts.repeats)
        print(f"| {name} | {'yes' if with_autograd else 'NO'} | {'yes' if any_position else 'NO'} | {1e3 * fwd:.2f} | "
              f"{flops / fwd / 1e12:.0f} | {1e3 * both:.2f} | {3.5 * flops / both / 1e12:.0f} |", flush=True)


if __name__ == "__main__":
    main()
