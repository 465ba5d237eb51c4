"""mean(x², last dim) in fp32 in one pass over x: the reduction of diffusers' `RMSNorm` for the opaque kernels.

The q/k norms of a DiT reduce rows of one head (64 or 128 values) hundreds of thousands of times per forward.
ATen spells x.float().pow(2).mean(-1) as three kernels (an fp32 copy of x, the square, a reduction built for
long rows): at SD3.5-Medium size that was a fifth of a compiled engine's denoising time. On CUDA this computes
it as one Triton kernel whose configuration depends on the row length only, so a row's value ignores how many
rows share the call (what the batch_invariant group needs) and the engine and the trainer get the same bits.
Elsewhere (CPU, or no Triton) it is ATen's formula, bit for bit diffusers' own.
"""

from __future__ import annotations

import functools

import torch

ELEMENTS_PER_PROGRAM = 4096  # rows × padded row length handled by one program (a 16 KiB fp32 tile)


def mean_square_formula(x: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm variance: x in fp32, squared, averaged over the last dim (keepdim)."""
    return x.to(torch.float32).pow(2).mean(-1, keepdim=True)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing Triton is slow and absent on some CPU installs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_mean_square(x_ptr, out_ptr, rows, length: tl.constexpr, block: tl.constexpr, rows_per_program: tl.constexpr):
        row = tl.program_id(0) * rows_per_program + tl.arange(0, rows_per_program)
        col = tl.arange(0, block)
        mask = (row[:, None] < rows) & (col[None, :] < length)
        x = tl.load(x_ptr + row[:, None] * length + col[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row, tl.sum(x * x, axis=1) / length, mask=row < rows)

    return triton, row_mean_square


def uses_triton(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def _row_major_order(x: torch.Tensor) -> list[int] | None:
    """The order of x's leading dims that makes it contiguous (x is often a transposed view of the projection's
    output: heads before tokens), or None when no reordering does."""
    if x.dim() < 2 or x.stride(-1) != 1:
        return None
    lead = sorted(range(x.dim() - 1), key=lambda d: (-x.stride(d), d))
    order = lead + [x.dim() - 1]
    return order if x.permute(order).is_contiguous() else None


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def empty_like_result(x: torch.Tensor) -> torch.Tensor:
    """The result's layout (shape x.shape[:-1] + (1,), fp32) without computing it: for the fake kernel."""
    if not uses_triton(x):
        return mean_square_formula(x)  # on a fake tensor: only the formula's layout is computed
    order = _row_major_order(x) or list(range(x.dim()))
    permuted = x.permute(order)
    out = x.new_empty((*permuted.shape[:-1], 1), dtype=torch.float32)
    return out.permute(_inverse(order))


def row_mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x², last dim, keepdim) in fp32; on CUDA one Triton pass in x's own memory order."""
    if not uses_triton(x) or x.numel() == 0:
        return mean_square_formula(x)
    order = _row_major_order(x)
    if order is None:
        x, order = x.contiguous(), list(range(x.dim()))
    permuted = x.permute(order)
    length = permuted.shape[-1]
    rows = permuted.numel() // length
    out = torch.empty((*permuted.shape[:-1], 1), device=x.device, dtype=torch.float32)
    triton, kernel = _kernel()
    block = triton.next_power_of_2(length)
    rows_per_program = max(1, ELEMENTS_PER_PROGRAM // block)
    grid = (triton.cdiv(rows, rows_per_program),)
    kernel[grid](permuted, out, rows, length=length, block=block, rows_per_program=rows_per_program, num_warps=4)
    return out.permute(_inverse(order))
