"""Checkpoints (torch.distributed.checkpoint) and the LoRA export for inference (docs/design.md §5).

Layout under `--save`:
    iter_0000007/            one checkpoint (7 = the rollout id it was saved after)
        *.distcp, .metadata  DCP shards: "model" (trainable parameters: the full model, or only the LoRA
                             adapter), "optimizer" (unless --no-save-optim), "ema" (θ̄, when --use-ema)
        meta.pt              rank 0: rollout id, LR scheduler, EMA update count, grad scaler, extra_state
        rng/rank_<r>.pt      each rank's RNG states (python, numpy, torch, cuda)
    latest_checkpointed_iteration.txt    "7"

Atomicity: every rank writes into `iter_0000007.tmp/`; after a barrier rank 0 renames it to `iter_0000007/`
and then replaces the pointer file with `os.replace` on a fully written temp file. A crash at any point leaves
the pointer on the previous complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from miles.backends.fsdp_utils import deterministic
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

POINTER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def read_latest_iteration(root: str) -> int | None:
    pointer = os.path.join(root, POINTER_FILE)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as handle:
        text = handle.read().strip()
    try:
        return int(text)
    except ValueError as err:
        raise MilesUserError(f"--load {root!r}: {POINTER_FILE} holds {text!r}, not an iteration number") from err


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _model_state(trainer) -> dict[str, torch.Tensor]:
    return {name: param for name, param in trainer.trainable}


def _ema_template(trainer) -> dict[str, torch.Tensor]:
    return trainer.ema.state_dict()["shadow"]


def _write_pointer(root: str, rollout_id: int) -> None:
    temp = os.path.join(root, f".{POINTER_FILE}.tmp")
    with open(temp, "w") as handle:
        handle.write(f"{rollout_id}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, os.path.join(root, POINTER_FILE))


def save_checkpoint(trainer, rollout_id: int, extra_state: dict | None = None, root: str | None = None) -> str:
    """Save everything needed to resume after `rollout_id`; every rank calls it. Returns the iteration dir."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    args = trainer.args
    root = root or args.save
    if not root:
        raise MilesUserError("saving a checkpoint needs --save")
    final_dir = iteration_dir(root, rollout_id)
    temp_dir = final_dir + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(temp_dir, ignore_errors=True)  # a stale half-written save of an earlier crash
        os.makedirs(os.path.join(temp_dir, "rng"))
    _barrier()
    state: dict = {"model": _model_state(trainer)}
    save_optim = not getattr(args, "no_save_optim", False)
    if save_optim:
        state["optimizer"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    if trainer.ema is not None:
        state["ema"] = trainer.ema.shadow_tensors()
    dcp.save(state, checkpoint_id=temp_dir)
    torch.save(deterministic.rng_state(), os.path.join(temp_dir, "rng", f"rank_{_rank()}.pt"))
    if _rank() == 0:
        meta = {
            "rollout_id": rollout_id,
            "global_step": trainer.global_step,
            "has_optimizer": save_optim,
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "grad_scaler": trainer.scaler.state_dict(),
            "ema_num_updates": None if trainer.ema is None else trainer.ema.num_updates,
            "use_lora": bool(getattr(args, "use_lora", False)),
            "world_size": trainer.world_size,
            "extra_state": extra_state or {},
        }
        torch.save(meta, os.path.join(temp_dir, "meta.pt"))
    _barrier()
    if _rank() == 0:
        if os.path.exists(final_dir):  # re-saving the same iteration: keep the old one until the new one is in place
            old_dir = final_dir + ".old"
            shutil.rmtree(old_dir, ignore_errors=True)
            os.rename(final_dir, old_dir)
            os.rename(temp_dir, final_dir)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.rename(temp_dir, final_dir)
        _write_pointer(root, rollout_id)
        logger.info("saved checkpoint %s", final_dir)
    _barrier()
    return final_dir


def load_checkpoint(trainer) -> int:
    """Resume from `--load` (iteration `--ckpt-step` or the pointer file); returns the next rollout id.

    Sets `trainer.loaded_extra_state` (the caller's data-source position) to the saved dict, or None.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    args = trainer.args
    trainer.loaded_extra_state = None
    root = getattr(args, "load", None)
    if not root:
        return 0
    step = getattr(args, "ckpt_step", None)
    if step is None:
        step = read_latest_iteration(root)
        if step is None:
            logger.warning("--load %s: no %s, starting from scratch", root, POINTER_FILE)
            return 0
    directory = iteration_dir(root, int(step))
    if not os.path.exists(os.path.join(directory, "meta.pt")):
        raise MilesUserError(f"--load {root!r} --ckpt-step {step}: no complete checkpoint at {directory}")
    meta = torch.load(os.path.join(directory, "meta.pt"), weights_only=False)
    if meta["use_lora"] != bool(getattr(args, "use_lora", False)):
        raise MilesUserError(
            f"--load {directory!r} was saved with use_lora={meta['use_lora']}; this run has "
            f"--use-lora={bool(getattr(args, 'use_lora', False))}"
        )
    load_optim = not getattr(args, "no_load_optim", False)
    if load_optim and not meta["has_optimizer"]:
        logger.warning("--load %s: saved with --no-save-optim, optimizer and LR scheduler start fresh", directory)
        load_optim = False
    state: dict = {"model": _model_state(trainer)}
    if load_optim:
        state["optimizer"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    ema_template = None
    if trainer.ema is not None and meta["ema_num_updates"] is not None:
        ema_template = _ema_template(trainer)
        state["ema"] = ema_template
    dcp.load(state, checkpoint_id=directory)
    if load_optim:
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=state["optimizer"])
        use_checkpoint_schedule = getattr(args, "use_checkpoint_lr_scheduler", True) and not getattr(
            args, "override_lr_scheduler", False
        )
        trainer.lr_scheduler.load_state_dict(meta["lr_scheduler"], use_checkpoint_schedule=use_checkpoint_schedule)
        trainer.scaler.load_state_dict(meta["grad_scaler"])
    if ema_template is not None:
        trainer.ema.load_state_dict({"num_updates": meta["ema_num_updates"], "shadow": ema_template})
    elif trainer.ema is not None:
        logger.warning("--load %s holds no EMA: the EMA starts from the loaded weights", directory)
    trainer.global_step = int(meta["global_step"])
    rng_path = os.path.join(directory, "rng", f"rank_{_rank()}.pt")
    if not getattr(args, "no_load_rng", False):
        if os.path.exists(rng_path) and meta["world_size"] == trainer.world_size:
            deterministic.set_rng_state(torch.load(rng_path, weights_only=False))
        else:
            logger.warning("--load %s: RNG states not restored (saved with %d ranks)", directory, meta["world_size"])
    trainer.loaded_extra_state = meta["extra_state"]
    logger.info("loaded checkpoint %s (rollout %d)", directory, meta["rollout_id"])
    return int(meta["rollout_id"]) + 1


def export_lora(trainer, path: str) -> None:
    """Write the LoRA adapter in the diffusers/PEFT format `pipeline.load_lora_weights(path)` reads.

    Every rank calls it (the adapter tensors are gathered); rank 0 writes.
    """
    import diffusers

    from miles.backends.fsdp_utils.weight_export import lora_adapter_state

    if not getattr(trainer.args, "use_lora", False):
        raise MilesUserError("export_lora needs a run with --use-lora")
    pipeline_class = getattr(diffusers, trainer.family.pipeline_class_name, None)
    if pipeline_class is None or not hasattr(pipeline_class, "save_lora_weights"):
        raise MilesUserError(f"{trainer.family.pipeline_class_name} cannot save LoRA weights in the diffusers format")
    layers = {}
    metadata = {}
    for name in trainer.model.keys():
        layers[f"{name}_lora_layers"] = lora_adapter_state(trainer, name)
        metadata[f"{name}_lora_adapter_metadata"] = trainer.lora_config.to_dict()
    if _rank() == 0:
        import inspect

        accepted = inspect.signature(pipeline_class.save_lora_weights).parameters
        unknown = [key for key in layers if key not in accepted]
        if unknown:
            raise MilesUserError(
                f"{pipeline_class.__name__}.save_lora_weights does not take {unknown}: the diffusers LoRA format of "
                "this family covers fewer modules than --update-weight-target-module"
            )
        kwargs = {**layers, **{k: v for k, v in metadata.items() if k in accepted}}
        os.makedirs(path, exist_ok=True)
        pipeline_class.save_lora_weights(path, **kwargs)
        logger.info("exported LoRA adapter to %s", path)
    _barrier()


def should_save(args, rollout_id: int) -> bool:
    """The loop's rule: with `--save`, every `--save-interval` rollouts and after the last one."""
    if not getattr(args, "save", None):
        return False
    interval = getattr(args, "save_interval", None)
    last = int(getattr(args, "num_rollout", 0) or 0) - 1
    return bool(interval and (rollout_id + 1) % int(interval) == 0) or rollout_id == last
