"""Bitwise engine/trainer parity: the same sample gets the same velocity in the engine and in the trainer.

A sample's DiT output depends on more than its own inputs: GEMM libraries (MKL/oneDNN on CPU, cuBLAS on GPU)
pick their blocking and split-K from the row count, and the engine forwards a whole denoising step of every
request at once while the trainer forwards micro-batches of pairs. The ratio π_new/π_old then is not 1 at the
first step, and a clip range of 1e-4 clips on numerics alone. The `batch_invariant` patch group removes the
sources of difference (docs/sde-backends.md):

1. **Fixed forward tiles**: both sides run every DiT forward on exactly `tile` samples (the trainer's pairs per
   forward, `--micro-batch-size`), padding the last tile by repeating its last sample. Every kernel then sees
   the same shapes on both sides, and no kernel mixes rows, so a sample's output ignores its neighbours.
2. **One attention kernel**: on CUDA both sides use one PyTorch SDPA kernel (flash; memory-efficient in fp32 or
   for families that mask attention; math for fp32 grouped-query attention), since without a pin the dispatcher
   may choose differently with and without autograd. SD3's processors call PyTorch's SDPA themselves and take no
   pin: both sides get PyTorch's choice, cuDNN for its heads on Hopper, which keeps a sample's bits with and
   without autograd (measured at SD3.5-Medium's shapes, bench/attention_parity.py).
3. **Every tensor in the same dtype on both sides**: FSDP's mixed precision casts every parameter of the trainer
   to the forward dtype, including those diffusers keeps in fp32 at load time (`_keep_in_fp32_modules`: Wan's
   norms and modulation tables, Cosmos 3's time embedder), so the engine casts those too
   (`cast_parameters_like_fsdp`); FSDP casts no buffer, so the trainer casts the ones the engine's load put in the
   forward dtype (`engine_holds_in_forward_dtype`; `cast_buffers_like_the_engine` in
   miles/backends/fsdp_utils/parallelize.py), e.g. SD3's positional table, and leaves fp32 rotary tables fp32.
4. **LoRA seen as the engine sees it**: the engine runs the merged weight W' = W + s·B·A (rounded to the
   forward dtype, `merged_lora_weight`). The trainer's LoRA layers compute the forward value with that same
   W' and take the LoRA gradients from the unmerged path, whose value is added as `lora − lora.detach()`
   (exactly 0), so values match the engine bit for bit and gradients are LoRA's own. Between two optimizer
   steps W' is formed once (`lora_merged_once`), where the weights are whole on the rank.

The SDE log-prob reduces each sample on its own (`miles.diffusion.sde.mean_over_non_batch`), always.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.opaque_kernels import opaque_linear

logger = logging.getLogger(__name__)

GROUP = "batch_invariant"
FLASH_ATTENTION_BACKEND = "_native_flash"  # diffusers' name for PyTorch's flash SDPA kernel (fp16/bf16 only)
EFFICIENT_ATTENTION_BACKEND = "_native_efficient"  # the memory-efficient kernel, which also takes fp32
MATH_ATTENTION_BACKEND = "_native_math"  # the composite kernel: everything, slowly
CUDNN_ATTENTION_BACKEND = "_native_cudnn"  # cuDNN's fused attention (16-bit; the fastest on Hopper)


def predict_velocity_in_tiles(
    family: Any,
    modules: Mapping[str, nn.Module],
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    guidance: Any,
    shape: Any,
    dtype: torch.dtype,
    tile: int,
) -> torch.Tensor:
    """`family.predict_velocity` with every DiT forward on exactly `tile` samples (the last tile padded)."""
    batch = latents.shape[0]
    velocities = []
    for start in range(0, batch, tile):
        count = min(tile, batch - start)

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            part = tensor[start : start + count]
            if count < tile:
                part = torch.cat([part, part[-1:].expand(tile - count, *part.shape[1:])])
            return part

        velocity = family.predict_velocity(
            modules, cut(latents), cut(sigmas), {k: cut(v) for k, v in conditioning.items()}, guidance, shape, dtype
        )
        velocities.append(velocity[:count])
    return torch.cat(velocities) if len(velocities) > 1 else velocities[0]


def pin_attention(modules: Mapping[str, nn.Module], dtype: torch.dtype, device_type: str | None = None,
                  family: Any = None) -> None:
    """On CUDA, route attention through one SDPA kernel on every module that can choose (`parity_attention_backend`).
    Each of them treats every (sample, head) on its own. Processors that ignore diffusers' backend (SD3's) are not
    pinned: they take PyTorch's own choice on both sides (cuDNN for SD3's heads on Hopper, bench/RESULTS.md).

    `device_type`: where the modules will run (default: where their parameters are now)."""
    on_cuda = [module for module in modules.values() if hasattr(module, "set_attention_backend") and (
        device_type == "cuda" if device_type else any(p.is_cuda for p in module.parameters()))]
    set_diffusers_backend(on_cuda, parity_attention_backend(dtype, family))


def set_diffusers_backend(modules: Iterable[nn.Module], backend: str) -> None:
    """`set_attention_backend(backend)` on each module. Diffusers also makes the backend its process-wide default;
    that default is put back, so other models in the process are unaffected."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    previous = _AttentionBackendRegistry.get_active_backend()[0]
    for module in modules:
        module.set_attention_backend(backend)
    _AttentionBackendRegistry.set_active_backend(previous)


def parity_attention_backend(dtype: torch.dtype, family: Any = None) -> str:
    """Flash for 16-bit forwards; memory-efficient for fp32 (flash has no fp32 kernel) or when the family masks
    attention (flash takes no mask); math for fp32 grouped-query attention (memory-efficient has none)."""
    uses_mask = bool(getattr(family, "attention_uses_mask", False))
    uses_gqa = bool(getattr(family, "attention_uses_gqa", False))
    if dtype != torch.float32 and not uses_mask:
        return FLASH_ATTENTION_BACKEND
    if dtype == torch.float32 and uses_gqa:
        return MATH_ATTENTION_BACKEND
    return EFFICIENT_ATTENTION_BACKEND


# diffusers' native SDPA backends and the PyTorch kernel each restricts SDPA to
_SDPA_KERNEL_OF_BACKEND = {
    FLASH_ATTENTION_BACKEND: "FLASH_ATTENTION",
    CUDNN_ATTENTION_BACKEND: "CUDNN_ATTENTION",
    EFFICIENT_ATTENTION_BACKEND: "EFFICIENT_ATTENTION",
    MATH_ATTENTION_BACKEND: "MATH",
}


def route_attention(modules: Mapping[str, nn.Module], backend: str) -> None:
    """Every attention of `modules` through `backend`. Diffusers' newer processors take a backend
    (`set_attention_backend`); older ones call PyTorch's SDPA themselves and ignore it (SD3's joint attention,
    `JointAttnProcessor2_0`), so a native SDPA backend's kernel also goes first in this process's SDPA priority,
    which they follow. A priority, not a restriction: inputs that kernel does not take fall back as before."""
    set_diffusers_backend(modules.values(), backend)
    kernel = _SDPA_KERNEL_OF_BACKEND.get(backend)
    if kernel is not None:
        prefer_sdpa_kernel(kernel)


def prefer_sdpa_kernel(kernel: str) -> None:
    """PyTorch's SDPA kernel `kernel` (an `SDPBackend` name) first in the process-wide priority (flash, efficient,
    math, cuDNN by default), the others in their order after it."""
    from torch.nn.attention import SDPBackend

    first = int(getattr(SDPBackend, kernel))
    order = [first] + [int(k) for k in torch._C._get_sdp_priority_order() if int(k) != first]
    torch._C._set_sdp_priority_order(order)


def gradient_engine_attention_backend(dtype: torch.dtype, family: Any, device: torch.device) -> str | None:
    """The attention kernel of an engine whose forward no other side reproduces (`--diffusion-rollout-gradient`:
    the trainer runs no forward, the gradient is the engine's own): cuDNN's on Hopper, where it runs. Measured on
    an H100 (torch 2.11, cuDNN 9.19; bench/attention_parity.py, bench/RESULTS.md): its forward and backward are
    2.0× flash's at SD3.5-Medium's 64-wide heads and 1.7× at a 128-wide head's shapes, with a sample's bits the same
    with and without autograd and at any tile position. PyTorch's dispatcher already picks cuDNN for the 64-wide
    heads (SD3, whose processors ignore diffusers' backend and so the pin), flash for the 128-wide ones, which the
    pin also holds for the families whose processors take a backend (FLUX, Wan, Qwen-Image, ...): those gain.
    None where nothing changes: not CUDA, not Hopper (flash is as fast or faster on Ampere and Blackwell), fp32,
    a mask, grouped-query attention, or a cuDNN build that refuses the probe."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if getattr(family, "attention_uses_mask", False) or getattr(family, "attention_uses_gqa", False):
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:  # faster on Hopper only (slower on Ampere and Blackwell)
        return None
    return CUDNN_ATTENTION_BACKEND if cudnn_attention_runs(device, dtype) else None


def cudnn_attention_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention takes a small 16-bit forward and backward here (its availability depends on the
    cuDNN build and the driver, which nothing cheaper than trying tells)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, 2, 128, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).sum().backward()
    except RuntimeError as err:  # "No available kernel", a cuDNN graph that fails to build
        logger.info("cuDNN attention does not run here (%s); the engine keeps the pinned kernel",
                    str(err).splitlines()[0][:200])
        return False
    return True


def cast_parameters_like_fsdp(modules: Mapping[str, nn.Module], dtype: torch.dtype) -> int:
    """Engine side: every floating parameter in `dtype`, as the trainer's FSDP mixed precision computes with them
    (diffusers' `_keep_in_fp32_modules` would otherwise stay fp32 here and be bf16 there). Returns how many were
    cast."""
    count = 0
    for module in modules.values():
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                count += 1
    if count:
        logger.info("batch_invariant: %d parameters kept in fp32 by diffusers now run in %s, as in the trainer",
                    count, dtype)
    return count


def engine_holds_in_forward_dtype(module: nn.Module, owner_name: str, buffer_name: str) -> bool:
    """Whether a diffusers load in the forward dtype puts this buffer (or parameter) in that dtype: parameters and
    persistent buffers are loaded in `torch_dtype` unless their module is in `_keep_in_fp32_modules`;
    non-persistent buffers (rotary tables built at construction) keep the dtype they were built in."""
    owner = module.get_submodule(owner_name) if owner_name else module
    if buffer_name in owner._non_persistent_buffers_set:
        return False
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return not keep.intersection(f"{owner_name}.{buffer_name}".split("."))


def merged_lora_weight(
    base: torch.Tensor, adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype
) -> torch.Tensor:
    """W' = W + Σ s·B·A in fp32 from the forward-dtype values of W, A and B, rounded to `dtype`.

    The one formula both the weight export (what the engine runs) and the trainer's LoRA forward use: rounding
    the inputs to the forward dtype first makes it independent of whether they come from fp32 master weights
    (export) or from FSDP's forward-dtype copies (forward)."""
    merged = base.to(dtype).float()
    for lora_a, lora_b, scaling in adapters:
        merged = merged + scaling * (lora_b.to(dtype).float() @ lora_a.to(dtype).float())
    return merged.to(dtype)


@torch.library.custom_op("miles::merged_lora_weight", mutates_args=())
def opaque_merged_lora_weight(
    base: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scalings: list[float]
) -> torch.Tensor:
    """`merged_lora_weight` as an opaque op for compiled blocks: fused into a graph, W + s·B·A would round
    differently (one fused multiply-add) from the weight export the engine runs. Takes detached tensors."""
    return merged_lora_weight(base, list(zip(lora_a, lora_b, scalings)), base.dtype)


@opaque_merged_lora_weight.register_fake
def _(base, lora_a, lora_b, scalings):
    return torch.empty_like(base)


def lora_adapters(layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, B, scaling) of each active adapter of a PEFT LoRA layer."""
    return [
        (layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))
        for name in layer.active_adapters
        if name in layer.lora_A
    ]


def _merged_value_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT LoRA Linear whose value is `x @ W'ᵀ` (the engine's merged weight) and whose LoRA gradients are the
    unmerged path's. W' is detached: the frozen base needs no weight gradient, and x's gradient through W'
    already includes the adapter's share."""
    if self.disable_adapters or self.merged:
        return self._miles_unpatched_forward(x, *args, **kwargs)
    base = self.base_layer
    opaque = getattr(self, "_miles_opaque", False)  # compiled: the merge and the matmul outside the graph's fusions
    weight = getattr(self, "_miles_merged_weight", None)  # formed once per optimizer step (`lora_merged_once`)
    if weight is None:
        adapters = lora_adapters(self)
        if opaque:
            weight = opaque_merged_lora_weight(base.weight.detach(), [a.detach() for a, _, _ in adapters],
                                               [b.detach() for _, b, _ in adapters], [s for _, _, s in adapters])
        else:
            weight = merged_lora_weight(base.weight, adapters, base.weight.dtype).detach()
    if opaque:
        result = opaque_linear(x.to(weight.dtype), weight, base.bias)
    else:
        result = F.linear(x.to(weight.dtype), weight, base.bias)
    lora = None
    detached = x.detach()
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        dropout = self.lora_dropout[name]
        term = self.lora_B[name](self.lora_A[name](dropout(detached.to(self.lora_A[name].weight.dtype))))
        term = term * self.scaling[name]
        lora = term if lora is None else lora + term
    if lora is not None:
        result = result + (lora - lora.detach()).to(result.dtype)  # adds exactly 0, carries the LoRA gradients
    return result


def _patched_lora_layers(module: nn.Module) -> list[nn.Module]:
    return [sub for sub in module.modules() if getattr(sub, "_miles_unpatched_forward", None) is not None]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local tensor where that is the whole tensor (a one-rank shard mesh)."""
    if hasattr(tensor, "to_local"):
        local = tensor.to_local()
        if local.shape != tensor.shape:
            raise RuntimeError("lora_merged_once needs every weight whole on this rank (one shard rank); "
                               f"a weight of shape {list(tensor.shape)} is sharded to {list(local.shape)}")
        return local
    return tensor


@contextlib.contextmanager
def lora_merged_once(module: nn.Module) -> Iterator[None]:
    """Within the block, every patched LoRA layer of `module` runs one W' formed on entry instead of forming it
    on every forward: for the micro-batches between two optimizer steps the weights do not change, so W' is
    the same tensor each would form (the same `merged_lora_weight` of the same forward-dtype values: FSDP's
    forward copy of a master weight is its rounding to the forward dtype, which the formula applies first).
    It saves one merge per layer per micro-batch, on the device and in the dispatching host thread. Needs the
    weights whole on this rank (`holds_weights_whole`); anything that changes them inside the block (an EMA
    swap) runs under `lora_merge_suspended`."""
    layers = _patched_lora_layers(module)
    with torch.no_grad():
        for layer in layers:
            adapters = [(_whole(a), _whole(b), scaling) for a, b, scaling in lora_adapters(layer)]
            base = _whole(layer.base_layer.weight)
            layer._miles_merged_weight = merged_lora_weight(base, adapters, base.dtype)
    try:
        yield
    finally:
        for layer in layers:
            layer._miles_merged_weight = None


@contextlib.contextmanager
def lora_merge_suspended(module: nn.Module) -> Iterator[None]:
    """Within the block the patched LoRA layers form W' per forward again (the weights are swapped); on exit
    the W' formed by an enclosing `lora_merged_once` is back."""
    held = {layer: getattr(layer, "_miles_merged_weight", None) for layer in _patched_lora_layers(module)}
    for layer in held:
        layer._miles_merged_weight = None
    try:
        yield
    finally:
        for layer, weight in held.items():
            layer._miles_merged_weight = weight


def patch_lora_layers(module: nn.Module) -> int:
    """Give every PEFT LoRA Linear of `module` the merged-value forward; returns how many were patched."""
    count = 0
    for sub in module.modules():
        if hasattr(sub, "lora_A") and hasattr(sub, "base_layer") and isinstance(sub.base_layer, nn.Linear):
            if getattr(sub, "_miles_unpatched_forward", None) is None:
                sub._miles_unpatched_forward = sub.forward
                sub.forward = types.MethodType(_merged_value_forward, sub)
                count += 1
    logger.info("batch_invariant: %d LoRA layers run the merged weight's value", count)
    return count
