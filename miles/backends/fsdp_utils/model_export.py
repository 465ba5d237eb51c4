"""Trained weights as diffusers artifacts for inference: a LoRA adapter, or a complete pipeline folder.

Two sources feed the same writer (`export_weights`):
- a checkpoint (`load_checkpoint_weights`, used by `python -m miles.export`): the DCP shards under `--save`,
  read in one process without Ray, a process group or a GPU: `dcp.load(no_dist=True)` into plain CPU tensors
  shaped from the shard index. As for a resume, the index is read once and checked, and DCP loads with that
  checked copy (miles.backends.fsdp_utils.checkpoint_files);
- a live trainer (`trainer_weights`, used by `--export-interval`): every rank gathers each trained tensor
  (`full_tensor()` is a collective), rank 0 keeps them.

Outputs:
- a LoRA run without `merge`: `pytorch_lora_weights.safetensors` with the adapter config (rank, alpha,
  targets), which `pipeline.load_lora_weights(DIR)` reads on top of the base pipeline;
- a full fine-tune, or a LoRA run with `merge` (W + (α/r)·B·A, the formula the engines use): a pipeline folder
  that `DiffusionPipeline.from_pretrained(DIR)` loads. Every component that was not trained is copied from the
  base pipeline (copies, not links: a later `save_pretrained` into the export must not rewrite the base's
  files), and each trained module is loaded from the base, given the trained values and saved with
  `save_pretrained`, in the dtype the base stores it in unless `dtype` says otherwise.
Both also hold `miles_export.json` (base pipeline, source, EMA or live weights). A folder is written under
`<out>.tmp` and renamed when complete, so an interrupted export never looks like a finished one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.checkpoint_files import (
    META_FILE,
    POINTER_FILE,
    iteration_dir,
    load_dcp,
    read_checkpoint,
    read_latest_iteration,
    run_family_label,
    saved_iterations,
)
from miles.config.sections import RunConfig
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

EXPORT_INFO_FILE = "miles_export.json"
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default name for save_lora_weights
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class TrainedWeights:
    """What a run trained, full tensors on the CPU, named as the trainer names its parameters."""

    tensors: dict[str, torch.Tensor]  # "<module>.<parameter>", PEFT names under LoRA (`...lora_A.default.weight`)
    modules: list[str]  # the trained pipeline components ("transformer", or "transformer,transformer_2")
    lora: dict[str, Any] | None  # `lora_settings(...)` of a --use-lora run, else None
    family: str | None  # a family key or a --train-pipeline-config-path class (run_family_label)
    base: str | None  # the run's --hf-checkpoint
    source: str  # where the weights came from, for messages and miles_export.json
    ema: bool  # θ̄ rather than the live weights


# ---- LoRA settings as plain values (they go into checkpoint meta, which only holds plain values) ----------
def lora_settings(config) -> dict[str, Any]:
    """The PEFT LoraConfig fields needed to rebuild the adapter for inference, as plain values."""
    targets = config.target_modules
    return {
        "r": int(config.r),
        "lora_alpha": int(config.lora_alpha),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        "init_lora_weights": config.init_lora_weights,
    }


def lora_config(settings: dict[str, Any]):
    from peft import LoraConfig

    return LoraConfig(**settings)


def lora_scale(settings: dict[str, Any]) -> float:
    """PEFT's scaling α/r (miles never turns on rsLoRA)."""
    return float(settings["lora_alpha"]) / float(settings["r"])


def module_parameter_name(name: str) -> str:
    """A trainer parameter name without wrapper prefixes (activation checkpointing's `checkpoint_wrapper`)."""
    return name.replace("._checkpoint_wrapped_module.", ".").replace("_checkpoint_wrapped_module.", "")


def split_by_module(tensors: dict[str, torch.Tensor], modules: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """{"transformer.a.b": t} -> {"transformer": {"a.b": t}}, wrapper prefixes removed."""
    by_module: dict[str, dict[str, torch.Tensor]] = {name: {} for name in modules}
    for name, tensor in tensors.items():
        module, _, rest = name.partition(".")
        if module not in by_module:
            raise MilesUserError(f"trained tensor {name!r} belongs to no trained module {modules}")
        by_module[module][module_parameter_name(rest)] = tensor
    return by_module


# ---- source 1: a checkpoint, read in one process -----------------------------------------------------------
def checkpoint_directory(root: str, step: int | None) -> str:
    """The `iter_*` folder `--load ROOT [--ckpt-step N]` names; ROOT may also be an `iter_*` folder itself."""
    if not os.path.isdir(root):
        raise MilesUserError(f"--load {root!r}: no such folder")
    if step is None and os.path.isfile(os.path.join(root, META_FILE)):
        return root
    if step is None:
        step = read_latest_iteration(root)
    if step is None:
        found = saved_iterations(root)
        hint = f"; it holds {os.path.basename(iteration_dir(root, found[-1]))}: pass --ckpt-step {found[-1]}" \
            if found else ""
        raise MilesUserError(f"--load {root!r}: no {POINTER_FILE} and no {META_FILE}, so no checkpoint{hint}")
    return iteration_dir(root, int(step))


def load_checkpoint_weights(root: str, step: int | None = None, use_ema: bool = False,
                            lora_alpha: int | None = None) -> TrainedWeights:
    """The trained tensors of one checkpoint (or their EMA), loaded without Ray, a process group or a GPU.

    `lora_alpha` is needed only for LoRA checkpoints written before meta.pt recorded the LoRA settings: rank and
    target layers are read off the adapter tensors, but α cannot be."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = checkpoint_directory(root, step)
    checked = read_checkpoint(directory)  # meta, index and shards checked; DCP loads with this very index
    meta, index = checked.meta, checked.index
    part = "ema" if use_ema else "model"
    if use_ema and meta.get("ema_num_updates") is None:
        raise MilesUserError(f"--ema: the checkpoint {directory} holds no EMA weights (the run had no --use-ema)")
    prefix = f"{part}."
    templates = {
        fqn: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for fqn, item in index.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not templates:
        raise MilesUserError(f"--load {directory}: the shard index holds no {part!r} tensors")
    load_dcp(templates, directory, index, no_dist=True)
    tensors = {fqn[len(prefix):]: tensor for fqn, tensor in templates.items()}
    modules = meta.get("modules") or sorted({name.partition(".")[0] for name in tensors})
    lora = meta.get("lora")
    if meta["use_lora"] and lora is None:
        if lora_alpha is None:
            raise MilesUserError(f"--lora-alpha: the checkpoint {directory} predates recorded LoRA settings in "
                                 "meta.pt; pass the run's --lora-alpha (rank and targets are read off the adapter)")
        lora = _lora_settings_from_tensors(tensors, lora_alpha, directory)
    return TrainedWeights(tensors=tensors, modules=list(modules), lora=lora if meta["use_lora"] else None,
                          family=meta.get("family"), base=meta.get("hf_checkpoint"),
                          source=f"checkpoint {directory}", ema=use_ema)


def _lora_settings_from_tensors(tensors: dict[str, torch.Tensor], lora_alpha: int, directory: str) -> dict[str, Any]:
    """`lora_settings` of an adapter whose α is known: r from a `lora_A` weight's rows, the targets are the
    adapted layers' names (PEFT matches a full name as well as a suffix)."""
    downs = {name.split(".lora_A.")[0]: t for name, t in tensors.items() if ".lora_A." in name}
    if not downs:
        raise MilesUserError(f"--load {directory}: meta.pt says use_lora, but the shards hold no lora_A tensors")
    targets = sorted({module_parameter_name(owner.partition(".")[2]) for owner in downs})
    return {"r": int(next(iter(downs.values())).shape[0]), "lora_alpha": int(lora_alpha),
            "target_modules": targets, "init_lora_weights": True}


# ---- source 2: a live trainer --------------------------------------------------------------------------------
def trainer_weights(trainer, use_ema: bool = False, source: str = "trainer") -> TrainedWeights | None:
    """The trained tensors of a running trainer (θ̄ with `use_ema`); every rank calls it, rank 0 gets them."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if use_ema and trainer.ema is None:
        raise MilesUserError("exporting the EMA weights (--ema-rollout-policy ema) needs --use-ema")
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if use_ema:
            trainer.ema.swap_in()
        try:
            for name, param in trainer.trainable:
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                if rank == 0:
                    tensors[name] = full.detach().to("cpu", copy=True)
        finally:
            if use_ema:
                trainer.ema.swap_out()
    if rank != 0:
        return None
    config = trainer.config
    use_lora = config.trainer.use_lora
    return TrainedWeights(tensors=tensors, modules=list(trainer.model.keys()),
                          lora=lora_settings(trainer.lora_config) if use_lora else None,
                          family=run_family_label(config.model), base=recorded_base(config.model.hf_checkpoint),
                          source=source, ema=use_ema)


def recorded_base(hf_checkpoint: str | None) -> str | None:
    """The --hf-checkpoint to record: an absolute path for a local folder (exports run elsewhere), else the hub id."""
    if hf_checkpoint and os.path.isdir(hf_checkpoint):
        return os.path.abspath(hf_checkpoint)
    return hf_checkpoint


# ---- the writer ------------------------------------------------------------------------------------------------
def family_for(weights: TrainedWeights, base: str | None):
    """The family object the weights were trained with (its pipeline class and module loader)."""
    from miles.models import FAMILY_MODULES
    from miles.models.common import build_train_pipeline_config

    custom = weights.family if weights.family and weights.family not in FAMILY_MODULES else None
    return build_train_pipeline_config(base, train_pipeline_config_path=custom,
                                       diffusion_model_family=None if custom else weights.family)


def _save_lora_parameters(pipeline_class) -> set[str]:
    import inspect

    return set(inspect.signature(pipeline_class.save_lora_weights).parameters)


def lora_format_problem(pipeline_class_name: str, modules: list[str]) -> str | None:
    """Why the diffusers LoRA format of this pipeline cannot hold adapters of `modules` (None when it can): some
    pipelines have no LoRA loader (Cosmos 3), others save fewer modules than were trained (Wan2.2 A14B's
    transformer_2)."""
    import diffusers

    pipeline_class = getattr(diffusers, pipeline_class_name, None)
    if pipeline_class is None or not hasattr(pipeline_class, "save_lora_weights"):
        return f"{pipeline_class_name} cannot save LoRA weights in the diffusers format"
    unknown = [name for name in modules if f"{name}_lora_layers" not in _save_lora_parameters(pipeline_class)]
    if unknown:
        return (f"{pipeline_class_name}.save_lora_weights takes no adapter for {unknown}: the diffusers LoRA format "
                "of this family covers fewer modules than --update-weight-target-module")
    return None


def write_lora_adapter(pipeline_class_name: str, adapters: dict[str, dict[str, torch.Tensor]], config,
                       path: str) -> None:
    """`<pipeline class>.save_lora_weights(path, <module>_lora_layers=..., <module>_lora_adapter_metadata=...)`.

    `adapters`: module -> {"<layer>.lora_A.weight": A, "<layer>.lora_B.weight": B} (unscaled; the scale α/r
    travels in the adapter metadata, `config` a PEFT LoraConfig)."""
    import diffusers

    problem = lora_format_problem(pipeline_class_name, list(adapters))
    if problem:
        raise MilesUserError(f"{problem}; export with --merge for a complete pipeline instead")
    pipeline_class = getattr(diffusers, pipeline_class_name)
    accepted = _save_lora_parameters(pipeline_class)
    layers = {f"{name}_lora_layers": tensors for name, tensors in adapters.items()}
    metadata = {f"{name}_lora_adapter_metadata": config.to_dict() for name in adapters}
    kwargs = {**layers, **{key: value for key, value in metadata.items() if key in accepted}}
    os.makedirs(path, exist_ok=True)
    pipeline_class.save_lora_weights(path, **kwargs)


def lora_adapters_by_module(weights: TrainedWeights) -> dict[str, dict[str, torch.Tensor]]:
    """module -> the diffusers/PEFT adapter names (`<layer>.lora_A.weight`), adapter name "default" removed."""
    from miles.backends.fsdp_utils.weight_export import is_lora_param, strip_peft_name

    by_module = split_by_module(weights.tensors, weights.modules)
    return {module: {strip_peft_name(name): tensor for name, tensor in tensors.items() if is_lora_param(name)}
            for module, tensors in by_module.items()}


def resolve_base_folder(base: str | None) -> str:
    """A local pipeline folder for `base`: the folder itself, or the hub cache's snapshot of a hub id."""
    if not base:
        raise MilesUserError("--hf-checkpoint: the checkpoint does not record the base pipeline; pass the "
                             "--hf-checkpoint the run trained")
    if os.path.isdir(base):
        if not os.path.isfile(os.path.join(base, "model_index.json")):
            raise MilesUserError(f"--hf-checkpoint {base!r}: no model_index.json, not a diffusers pipeline folder")
        return base
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.download(base)
    except (OSError, ValueError) as err:
        raise MilesUserError(f"--hf-checkpoint {base!r}: not a local folder, and the hub (or its offline cache) "
                             f"cannot provide it: {' '.join(str(err).split())[:200]}") from None


def stored_dtype(folder: str) -> torch.dtype | None:
    """The dtype of the first floating-point tensor in a component folder's safetensors files, or None."""
    from safetensors import safe_open

    for file_name in sorted(os.listdir(folder)):
        if not file_name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, file_name), framework="pt") as handle:
            for key in handle.keys():
                dtype = SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def _merge_lora(module_name: str, module: torch.nn.Module, tensors: dict[str, torch.Tensor],
                settings: dict[str, Any]) -> int:
    """W ← W + (α/r)·B·A for every adapted Linear of `module` (the engines' formula, `merged_lora_weight`, in
    fp32 from values rounded to W's dtype, then rounded to it); returns how many layers were merged."""
    from miles.backends.fsdp_utils.weight_export import strip_peft_name
    from miles.models.batch_invariant import merged_lora_weight

    scale = lora_scale(settings)
    adapters = {strip_peft_name(name): tensor for name, tensor in tensors.items()}
    owners = sorted(name[: -len(".lora_A.weight")] for name in adapters if name.endswith(".lora_A.weight"))
    for owner in owners:
        down, up = adapters[f"{owner}.lora_A.weight"], adapters.get(f"{owner}.lora_B.weight")
        try:
            layer = module.get_submodule(owner)
        except AttributeError:
            raise MilesUserError(f"--merge: the adapter of {module_name}.{owner} has no layer in the base "
                                 "pipeline's module (was it trained from another --hf-checkpoint?)") from None
        weight = getattr(layer, "weight", None)
        if up is None or weight is None or weight.dim() != 2 or tuple(weight.shape) != (up.shape[0], down.shape[1]):
            raise MilesUserError(f"--merge: {module_name}.{owner} is not a Linear layer matching its adapter "
                                 f"(base weight {None if weight is None else tuple(weight.shape)}, adapter "
                                 f"{tuple(up.shape) if up is not None else None} x {tuple(down.shape)})")
        with torch.no_grad():
            weight.copy_(merged_lora_weight(weight, [(down, up, scale)], weight.dtype))
    return len(owners)


def _load_full_weights(module_name: str, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise MilesUserError(f"the trained {module_name} does not match the base pipeline's (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}); was it trained from another "
                             "--hf-checkpoint?")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise MilesUserError(f"the trained {module_name}.{name} has shape {tuple(tensor.shape)}, the base "
                                     f"pipeline's {tuple(params[name].shape)} (another --hf-checkpoint?)")
            params[name].copy_(tensor)


def _copy_untrained_components(base_folder: str, out: str, trained: list[str]) -> None:
    for entry in sorted(os.listdir(base_folder)):
        if entry in trained or entry.startswith("."):
            continue
        source = os.path.join(base_folder, entry)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(out, entry))  # follows the hub cache's symlinks
        else:
            shutil.copy2(source, os.path.join(out, entry))


def write_pipeline(weights: TrainedWeights, family, base_folder: str, out: str, dtype: torch.dtype | None) -> dict:
    """The base pipeline with the trained modules replaced (LoRA merged); returns the dtypes written."""
    _copy_untrained_components(base_folder, out, weights.modules)
    by_module = split_by_module(weights.tensors, weights.modules)
    written = {}
    for name, tensors in by_module.items():
        out_dtype = dtype or stored_dtype(os.path.join(base_folder, name)) or torch.float32
        # loaded in the output dtype (diffusers keeps a model's fp32-only modules in fp32), then overwritten: the
        # trained values round once, as the trainer's forward in that dtype rounds them
        module = family.load_modules(base_folder, [name], out_dtype)[name]
        if weights.lora is not None:
            if not _merge_lora(name, module, tensors, weights.lora):
                raise MilesUserError(f"--merge: {weights.source} holds no LoRA adapter for {name}")
        else:
            _load_full_weights(name, module, tensors)
        module.save_pretrained(os.path.join(out, name))
        written[name] = str(out_dtype).removeprefix("torch.")
    return written


def export_weights(weights: TrainedWeights, out: str, merge: bool = False, base: str | None = None,
                   dtype: torch.dtype | None = None, replace: bool = False) -> str:
    """Write `weights` for inference into `out` (see the module doc); returns "lora" or "pipeline".

    `base` overrides the base pipeline the weights record; `replace` lets an existing `out` be replaced (the
    trainer's periodic exports), otherwise a non-empty `out` is an error.
    """
    base = base or weights.base
    out = os.path.normpath(out)
    if os.path.exists(out) and not (os.path.isdir(out) and (replace or not os.listdir(out))):
        raise MilesUserError(f"--out {out!r} already exists and is not an empty folder; remove it or choose another")
    kind = "lora" if weights.lora is not None and not merge else "pipeline"
    family = family_for(weights, base)
    temp = out + ".tmp"
    shutil.rmtree(temp, ignore_errors=True)  # a stale half-written export of an earlier crash
    os.makedirs(temp)
    info = {"format": kind, "base": base, "source": weights.source, "weights": "ema" if weights.ema else "live",
            "family": weights.family, "modules": weights.modules}
    try:
        if kind == "lora":
            write_lora_adapter(family.pipeline_class_name, lora_adapters_by_module(weights), lora_config(weights.lora),
                               temp)
            info["lora"] = weights.lora
        else:
            info["dtype"] = write_pipeline(weights, family, resolve_base_folder(base), temp, dtype)
            info["merged_lora"] = weights.lora
        with open(os.path.join(temp, EXPORT_INFO_FILE), "w") as handle:
            json.dump(info, handle, indent=2)
        follow_umask(temp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # an interrupted export leaves nothing that looks finished
        raise
    logger.info("exported %s (%s) to %s", weights.source, "LoRA adapter" if kind == "lora" else "pipeline", out)
    return kind


# ---- exports during training (--export-interval) -------------------------------------------------------------
def follow_umask(folder: str) -> None:
    """Give every file and folder under `folder` the mode the umask allows (0644 / 0755 under umask 022): an
    export is for others to read, but safetensors writes through a private temp file (0600) and copies of the
    base pipeline keep its files' modes."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def should_export(config: RunConfig, rollout_id: int) -> bool:
    """With `--export-interval N`: every N rollouts and after the last one (miles.config.schedule)."""
    from miles.config.schedule import interval_due

    return interval_due(config.checkpoint.export_interval, config.data.num_rollout, rollout_id)


def export_dir(config: RunConfig, rollout_id: int) -> str:
    """`<--output-dir>/export/iter_<rollout id>` (absolute: the trainer ranks may run in another folder)."""
    return os.path.join(os.path.abspath(config.logging.output_dir), "export",
                        f"iter_{rollout_id:07d}")


def export_from_trainer(trainer, out: str, rollout_id: int) -> str | None:
    """Every rank calls it: gather the policy the engines serve (θ̄ under `--ema-rollout-policy ema`) and write
    it on rank 0, as a LoRA adapter for a --use-lora run (a merged pipeline where the family's diffusers LoRA
    format cannot hold the adapter), else as a pipeline folder. Returns the kind on rank 0."""
    use_ema = trainer.config.trainer.ema_rollout_policy == "ema"
    weights = trainer_weights(trainer, use_ema, source=f"rollout {rollout_id} of the run")
    if weights is None:
        return None
    merge = False
    if weights.lora is not None:
        problem = lora_format_problem(trainer.family.pipeline_class_name, weights.modules)
        if problem:  # an export must not end a run that trained fine: write what every family can load
            logger.warning("--export-interval: %s; exporting a merged pipeline instead", problem)
            merge = True
    return export_weights(weights, out, merge=merge, replace=True)
