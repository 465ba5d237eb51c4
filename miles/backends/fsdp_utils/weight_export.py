"""Named tensors for weight sync and LoRA export, gathered from the FSDP2 shards one tensor at a time.

Every rank must iterate the same generator (each `DTensor.full_tensor()` is a collective); only the rank that
pushes keeps the tensors. Names are the engine's module names: `<module>.<param>` (e.g.
`transformer.transformer_blocks.0.attn.to_q.weight`) with PEFT's `.base_layer` and adapter names removed.

- full (default): every parameter of the synced modules; under LoRA the adapters are merged,
  W = W_base + (α/r)·B·A, so the engine needs no PEFT.
- LoRA pairs (`--lora-ipc-weight-sync`): only `...lora_A.weight` and `...lora_B.weight` (unscaled) plus the
  scale α/r (`lora_scaling`), which the engine merges as W_base + (α/r)·B·A (miles.engine.weight_sync).
- `--ema-rollout-policy ema`: the EMA weights θ̄ are swapped in while the tensors are gathered (§8).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from miles.models.batch_invariant import lora_adapters, merged_lora_weight
from miles.utils.errors import MilesUserError

LORA_MARKERS = (".lora_A.", ".lora_B.")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The gathered tensor, never aliasing the parameter (on one rank `full_tensor()` may return the local
    storage, which an EMA swap-out would then overwrite under the receiver's feet)."""
    tensor = tensor.detach()
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()
    return full


def is_lora_param(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def strip_peft_name(name: str, adapter: str = "default") -> str:
    """`a.to_q.base_layer.weight` -> `a.to_q.weight`; `a.to_q.lora_A.default.weight` -> `a.to_q.lora_A.weight`."""
    return name.replace(".base_layer.", ".").replace(f".lora_A.{adapter}.", ".lora_A.").replace(
        f".lora_B.{adapter}.", ".lora_B."
    )


def _lora_layer(module: nn.Module, name: str):
    owner = module.get_submodule(name)
    if not hasattr(owner, "scaling") or not hasattr(owner, "lora_A"):
        raise RuntimeError(f"{name!r} holds a base_layer but is not a PEFT LoRA layer")
    return owner


def _merged_tensors(prefix: str, module: nn.Module, forward_dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of one module with LoRA adapters merged into their base weights.

    A merged weight is `merged_lora_weight` in the forward dtype: the very tensor the trainer's LoRA forward
    values itself with under the batch_invariant group, so the engine runs the trainer's policy bit for bit."""
    for name, param in module.named_parameters():
        if is_lora_param(name):
            continue
        full = _full(param)
        if ".base_layer." in name and name.endswith(".weight"):
            owner_name = name.split(".base_layer.")[0]
            layer = _lora_layer(module, owner_name)
            if full.dim() != 2:
                raise MilesUserError(
                    f"full weight sync with LoRA merges only Linear layers; {prefix}.{owner_name} is not one "
                    "(use --lora-ipc-weight-sync or restrict --lora-target-modules)"
                )
            adapters = [(_full(a), _full(b), s) for a, b, s in lora_adapters(layer)]
            # a base kept on the host (`base_stays_on_host`) is merged where its adapters are
            full = merged_lora_weight(full.to(adapters[0][0].device) if adapters else full, adapters, forward_dtype)
        yield f"{prefix}.{strip_peft_name(name)}", full


def _lora_tensors(prefix: str, module: nn.Module, fold_scale: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters():
        if not is_lora_param(name):
            continue
        full = _full(param)
        if fold_scale and ".lora_B." in name:
            owner_name = name.split(".lora_B.")[0]
            adapter = name.split(".lora_B.")[1].split(".")[0]
            full = full * _lora_layer(module, owner_name).scaling[adapter]
        yield f"{prefix}.{strip_peft_name(name)}", full


@contextlib.contextmanager
def _policy_weights(trainer, use_ema: bool):
    if use_ema:
        if trainer.ema is None:
            raise MilesUserError("--ema-rollout-policy ema requires --use-ema")
        with torch.no_grad(), trainer.ema.swapped():
            yield
    else:
        with torch.no_grad():
            yield


def iter_named_tensors(trainer, lora_only: bool = False, use_ema: bool = False, fold_lora_scale: bool = False):
    """(engine name, full tensor) for every synced tensor; a collective on every rank (see module doc)."""
    if lora_only and not trainer.config.trainer.use_lora:
        raise MilesUserError("--lora-ipc-weight-sync requires --use-lora")
    with _policy_weights(trainer, use_ema):
        for prefix, module in trainer.model.items():
            if lora_only:
                yield from _lora_tensors(prefix, module, fold_lora_scale)
            else:
                yield from _merged_tensors(prefix, module, trainer.forward_dtype)


def iter_sync_tensors(trainer):
    """The tensors `--lora-ipc-weight-sync` / `--ema-rollout-policy` ask to push to the engines."""
    config = trainer.config
    return iter_named_tensors(
        trainer,
        lora_only=config.trainer.lora_ipc_weight_sync,
        use_ema=config.trainer.ema_rollout_policy == "ema",
        fold_lora_scale=False,
    )


def lora_scaling(trainer) -> float:
    """PEFT's α/r, the factor the engine applies to B·A when merging pushed LoRA pairs."""
    config = getattr(trainer, "lora_config", None)
    return 1.0 if config is None else float(config.lora_alpha) / float(config.r)


def iter_buckets(named_tensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) into lists of at most `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def lora_adapter_state(trainer, module_name: str) -> dict[str, torch.Tensor]:
    """PEFT-format adapter tensors of one module (`<param>.lora_A.weight`, unscaled), gathered on every rank."""
    module = trainer.model[module_name]
    return {name[len(module_name) + 1 :]: tensor.cpu() for name, tensor in _lora_tensors(module_name, module, False)}
