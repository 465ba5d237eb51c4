"""Opaque kernels: a compiled block whose forward value does not depend on how the compiler fuses it.

A compiled engine runs each block's inference graph; a compiled trainer runs the forward half of the same block's
training graph. Inductor fuses the two differently (what is saved for the backward changes the kernels' borders),
autotunes their reductions separately, and may move a linear layer's bias into a neighbouring kernel in one graph
and not in the other. Each of these rounds differently, so the trainer's log-probs drift from the engine's
(4e-4 per log-prob at SD3.5-Medium size in bf16, four times the default clip range).

Under the `batch_invariant` patch group a compiled side therefore calls every order-sensitive kernel as a custom
op that the compiler cannot look into:

- every `nn.Linear` (and the trainer's merged-weight LoRA value): the same cuBLAS call, on the same tile shapes
  (the group's fixed forward tiles), on both sides;
- every `nn.LayerNorm` (and diffusers' `FP32LayerNorm`): ATen's fused layer norm;
- the one reduction of diffusers' `RMSNorm` (the mean of squares, one Triton pass on CUDA:
  miles/models/row_mean_square.py); its element-wise rest stays compiled.

What is left to the compiler is element-wise, and `emulate_precision_casts` makes it round after every op as eager
PyTorch does, so its fusions cannot change a value. Attention is already one extern kernel (the group pins it).
Backward formulas are plain ATen math: gradients need not match anything bit for bit.

On CUDA both sides run these kernels whenever the group is on, compiled or not (`wanted`): the RMS reduction
is a kernel of its own there, so an eager side must run it too to give a compiled side's bits. On the CPU the
kernels compute eager PyTorch's values, so only compiled sides need them.
"""

from __future__ import annotations

import logging
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.row_mean_square import empty_like_result, row_mean_square

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------
# linear
# --------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("miles::linear", mutates_args=())
def opaque_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, weight, bias)


@opaque_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    # the frozen base needs no weight gradient, so its input is not kept for one
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = grad_bias = None
    if ctx.needs_input_grad[1]:
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, grad_weight, grad_bias


opaque_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


# --------------------------------------------------------------------------------------------------------------
# layer norm
# --------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("miles::layer_norm", mutates_args=())
def opaque_layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    return out, mean, rstd


@opaque_layer_norm.register_fake
def _(x, weight, bias, eps):
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    return torch.empty_like(out), torch.empty_like(mean), torch.empty_like(rstd)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _layer_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2]]
    grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad_out, x, [x.shape[-1]], mean, rstd, weight, bias, mask)
    return grad_x, grad_weight, grad_bias, None


opaque_layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# --------------------------------------------------------------------------------------------------------------
# the reduction of an RMS norm
# --------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("miles::mean_square", mutates_args=())
def opaque_mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x², last dim) in fp32, keepdim: diffusers' RMSNorm variance (one Triton pass on CUDA)."""
    return row_mean_square(x)


@opaque_mean_square.register_fake
def _(x):
    return empty_like_result(x)


def _mean_square_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _mean_square_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return (grad * x.to(torch.float32) * (2.0 / x.shape[-1])).to(x.dtype)


opaque_mean_square.register_autograd(_mean_square_backward, setup_context=_mean_square_setup)


# --------------------------------------------------------------------------------------------------------------
# installing them
# --------------------------------------------------------------------------------------------------------------
def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return opaque_linear(x, self.weight, self.bias)


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return opaque_layer_norm(x, self.weight, self.bias, self.eps)[0]


def _fp32_layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FP32LayerNorm (Wan, LTX): the norm in fp32, cast back."""
    weight = self.weight.float() if self.weight is not None else None
    bias = self.bias.float() if self.bias is not None else None
    return opaque_layer_norm(x.float(), weight, bias, self.eps)[0].to(x.dtype)


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm, op for op, with its reduction opaque."""
    input_dtype = hidden_states.dtype
    variance = opaque_mean_square(hidden_states)
    hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
    if self.weight is not None:
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        hidden_states = hidden_states * self.weight
        if getattr(self, "bias", None) is not None:
            hidden_states = hidden_states + self.bias
    else:
        hidden_states = hidden_states.to(input_dtype)
    return hidden_states


def _lora_factors(module: nn.Module) -> set[int]:
    """The ids of the A and B layers inside `module`'s merged-value LoRA layers."""
    factors = set()
    for sub in module.modules():
        if getattr(sub, "_miles_unpatched_forward", None) is not None:
            for name in ("lora_A", "lora_B"):
                factors.update(id(layer) for layer in getattr(sub, name).values())
    return factors


def install_opaque_kernels(module: nn.Module, linear: bool = True) -> dict[str, int]:
    """Route `module`'s linear layers, layer norms and RMS norms through the opaque kernels (in place, before
    compiling). PEFT LoRA wrappers patched by `batch_invariant.patch_lora_layers` are marked, so their
    merged-weight value goes through `opaque_linear` and `opaque_merged_lora_weight`. Their A and B layers stay
    as they are: the merged-value forward adds their term as `lora - lora.detach()`, exactly 0, so how the
    compiler fuses them reaches the gradients of A and B only, never a value the engine must match; as opaque
    calls they were half of a LoRA forward's custom-op dispatches, each paid by the host thread.
    `linear=False` leaves every linear layer to the compiler (measured by bench/bench_train_host.py's
    `--linear native`). Returns counts per kind."""
    counts = {"linear": 0, "layer_norm": 0, "rms_norm": 0, "lora": 0}
    factors = _lora_factors(module)
    for sub in module.modules():
        if getattr(sub, "_miles_opaque", False) or id(sub) in factors:
            continue
        if getattr(sub, "_miles_unpatched_forward", None) is not None:  # a merged-value LoRA layer
            if not linear:
                continue
            counts["lora"] += 1
        elif type(sub) is nn.Linear:
            if not linear:
                continue
            sub.forward = types.MethodType(_linear_forward, sub)
            counts["linear"] += 1
        elif type(sub) is nn.LayerNorm and len(sub.normalized_shape) == 1:
            sub.forward = types.MethodType(_layer_norm_forward, sub)
            counts["layer_norm"] += 1
        elif type(sub).__name__ == "FP32LayerNorm" and len(sub.normalized_shape) == 1:
            sub.forward = types.MethodType(_fp32_layer_norm_forward, sub)
            counts["layer_norm"] += 1
        elif type(sub).__name__ == "RMSNorm" and hasattr(sub, "eps") and not isinstance(sub, nn.RMSNorm):
            sub.forward = types.MethodType(_rms_norm_forward, sub)
            counts["rms_norm"] += 1
        else:
            continue
        sub._miles_opaque = True
    return counts


def wanted(group_on: bool, compiled: bool, device_type: str) -> bool:
    """Whether a side (engine or trainer) installs the opaque kernels: the one rule both sides follow."""
    return group_on and (compiled or device_type == "cuda")


def enable_eager_rounding() -> None:
    """Inductor rounds every low-precision op's result as eager PyTorch does (not once per fused kernel), so
    element-wise fusions give the same bits however the graph is cut. In the calling thread only: torch keeps a
    setting made in code per thread (torch ≥ 2.13), so the thread that compiles calls this too
    (`ModelRunner.prepare_thread` on the engine's worker thread)."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True


def install_in_blocks(block_lists: list[nn.ModuleList]) -> dict[str, int]:
    """The group's compiled form on every block about to be compiled (the engine's and the trainer's
    `compile_blocks` callers): opaque kernels in each, and eager rounding. Returns the counts, summed."""
    enable_eager_rounding()
    counts: dict[str, int] = {}
    for block_list in block_lists:
        for block in block_list:
            for kind, count in install_opaque_kernels(block).items():
                counts[kind] = counts.get(kind, 0) + count
    logger.info("batch_invariant, compiled: opaque kernels in the blocks: %s", counts)
    return counts
