"""Numeric-parity patch groups (`--rollout-patch-group a,b`).

The engine and the trainer run the same family modules, so their forwards agree by construction as long as
they make the same numeric choices. A patch group names one set of such choices; the engine applies the
groups when it loads the pipeline, and the trainer applies the same groups to its modules through
`apply_patch_groups`, so both sides stay bitwise comparable. Each group is documented in docs/engine.md.

Groups:
- `fp32_norms`: LayerNorm / RMSNorm / GroupNorm layers compute in fp32 and cast back (bf16 norms are the
  largest source of engine-vs-trainer drift in DiTs).
- `math_attention`: attention through PyTorch's math SDPA kernel (deterministic, identical on both sides;
  slow — use it for alignment probes, not for speed).
- `sgld`: what the sglang-diffusion engine does for flow-matching DiTs: `fp32_norms`.
- `ltx`: LTX-Video's parity set: `fp32_norms` (its RMSNorm without affine weights is especially sensitive).
- `batch_invariant`: bitwise engine/trainer parity (miles/models/batch_invariant.py): fixed forward tiles on
  both sides, one SDPA kernel on CUDA, parameters in the trainer's dtype, LoRA forwards valued with the merged weight, and
  in compiled blocks opaque matmuls and norms (miles/models/opaque_kernels.py; a rollout-gradient engine, which no
  trainer forward reproduces, keeps the tiles and skips those: `ModelRunner`). The default, eager or compiled
  (miles/config/validation.py `_rule_parity`); the trainer applies it too (`TRAINER_PATCH_GROUPS`).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from miles.models.batch_invariant import MATH_ATTENTION_BACKEND, cast_parameters_like_fsdp, pin_attention, route_attention
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES = _NORM_TYPES + (nn.RMSNorm,)


def _is_norm(module: nn.Module) -> bool:
    # diffusers has its own RMSNorm class; match it by name so the patch needs no diffusers import
    return isinstance(module, _NORM_TYPES) or type(module).__name__ in {"RMSNorm", "FP32LayerNorm", "AdaLayerNorm"}


def _fp32_norm_forward(norm: nn.Module, *args, **kwargs):
    """The norm's own forward (`_miles_fp32_inner_forward`) on fp32 inputs, its output cast back. One function
    bound to each norm, not a closure per norm: dynamo guards a forward attribute by identity, and an object
    per norm would compile every block on its own."""
    original = norm._miles_fp32_inner_forward
    first = args[0]
    out_dtype = first.dtype
    if out_dtype == torch.float32:
        return original(*args, **kwargs)
    cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    with torch.autocast(device_type=first.device.type, enabled=False):
        out = original(*cast, **kwargs)
    return out.to(out_dtype) if isinstance(out, torch.Tensor) else out


def _patch_fp32_norms(modules: Mapping[str, nn.Module]) -> None:
    count = 0
    for module in modules.values():
        for sub in module.modules():
            if _is_norm(sub) and not getattr(sub, "_miles_fp32_norm", False):
                for param in sub.parameters(recurse=False):
                    param.data = param.data.float()
                sub._miles_fp32_inner_forward = sub.forward
                sub.forward = types.MethodType(_fp32_norm_forward, sub)
                sub._miles_fp32_norm = True
                count += 1
    logger.info("patch fp32_norms: %d norm layers compute in fp32", count)


def _patch_math_attention(modules: Mapping[str, nn.Module]) -> None:
    for module in modules.values():
        if getattr(module, "set_attention_backend", None) is None:
            raise MilesUserError(
                f"--rollout-patch-group math_attention: {type(module).__name__} has no set_attention_backend"
            )
    route_attention(modules, MATH_ATTENTION_BACKEND)  # SD3's processors too, through the SDPA priority


def _forward_dtype(modules: Mapping[str, nn.Module]) -> torch.dtype:
    """The engine's forward dtype: the one most of its denoisers' weights were loaded in (diffusers keeps a few
    modules in fp32)."""
    counts: dict[torch.dtype, int] = {}
    for module in modules.values():
        for param in module.parameters():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.get)


def _patch_batch_invariant(modules: Mapping[str, nn.Module], family: Any = None) -> None:
    dtype = _forward_dtype(modules)
    cast_parameters_like_fsdp(modules, dtype)
    pin_attention(modules, dtype, family=family)


@dataclass(frozen=True)
class PatchGroup:
    name: str
    description: str
    apply: Callable[..., None]  # (modules) or, with `takes_family`, (modules, family)
    takes_family: bool = False


PATCH_GROUPS: dict[str, PatchGroup] = {}


def register_patch_group(group: PatchGroup) -> PatchGroup:
    PATCH_GROUPS[group.name] = group
    return group


register_patch_group(PatchGroup("fp32_norms", "norm layers in fp32", _patch_fp32_norms))
register_patch_group(PatchGroup("math_attention", "attention via the math SDPA kernel", _patch_math_attention))
register_patch_group(PatchGroup("sgld", "sglang-diffusion parity: fp32 norms", _patch_fp32_norms))
register_patch_group(PatchGroup("ltx", "LTX parity: fp32 norms", _patch_fp32_norms))
register_patch_group(
    PatchGroup(
        "batch_invariant",
        "bitwise engine/trainer parity: fixed tiles, one attention kernel, parameters in the trainer's dtype",
        _patch_batch_invariant,
        takes_family=True,
    )
)
# The groups the trainer applies to its own modules as well; the others are engine-side numerics choices that
# FSDP's mixed precision would undo.
TRAINER_PATCH_GROUPS = ("batch_invariant",)


def parse_patch_groups(value: str | Iterable[str] | None) -> list[str]:
    """`"a,b"` -> ["a", "b"], checking each name (MilesUserError naming the flag)."""
    if value is None:
        return []
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    unknown = [n for n in names if n not in PATCH_GROUPS]
    if unknown:
        raise MilesUserError(f"--rollout-patch-group: unknown group(s) {unknown}; known: {sorted(PATCH_GROUPS)}")
    return names


def apply_patch_groups(modules: Mapping[str, nn.Module], groups: str | Iterable[str] | None,
                       family: Any = None) -> list[str]:
    """Apply each named group to `modules` (engine and trainer call this with the same value); `family` is the
    modules' `TrainPipelineConfig`, for groups whose choices depend on it."""
    names = parse_patch_groups(groups)
    for name in names:
        group = PATCH_GROUPS[name]
        group.apply(modules, family) if group.takes_family else group.apply(modules)
    return names

