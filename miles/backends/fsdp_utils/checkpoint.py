"""Checkpoints (torch.distributed.checkpoint) and the LoRA export for inference (docs/design.md §5).

Layout under `--save`:
    iter_0000007/            one checkpoint (7 = the rollout id it was saved after)
        *.distcp, .metadata  DCP shards: "model" (trainable parameters: the full model, or only the LoRA
                             adapter), "optimizer" (unless --no-save-optim), "ema" (θ̄, when --use-ema)
        meta.pt              rank 0: rollout id, model family, LR scheduler, EMA update count, grad scaler,
                             extra_state
        rng/rank_<r>.pt      each rank's RNG states (python, numpy, torch, cuda)
    latest_checkpointed_iteration.txt    "7"

Atomicity: every rank writes into `iter_0000007.tmp/`; once every rank reports success, rank 0 renames it to
`iter_0000007/` and then replaces the pointer file with `os.replace` on a fully written temp file. A crash at
any point leaves the pointer on the previous complete checkpoint; a failed write (disk full, ...) also removes
the temp folder and ends in one `MilesUserError` on every rank. `--save-keep-latest K` then deletes all but
the newest K checkpoints.

Loading trusts no file (miles.backends.fsdp_utils.checkpoint_files): `meta.pt` and the RNG files hold only
tensors and plain values and are read with `weights_only=True`, each meta value type-checked; the DCP index is
read once, through an allow-list unpickler, checked field by field, and that checked copy is what DCP loads with
(it never opens an index file itself); shards must be files inside the checkpoint folder. `inspect_checkpoint`
checks a checkpoint without loading weights (meta, index, every shard present and long enough, same model
family and LoRA setting as the run); the entry point runs it before Ray starts and every rank again before
loading.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from miles.backends.fsdp_utils import deterministic
from miles.backends.fsdp_utils.checkpoint_files import (
    META_FILE,
    POINTER_FILE,
    CheckpointFiles,
    describe_failure,
    iteration_dir,
    load_dcp,
    read_checkpoint,
    read_latest_iteration,
    run_family_label,
    saved_iterations,
)
from miles.backends.fsdp_utils.model_export import lora_settings, recorded_base, write_lora_adapter
from miles.config.sections import RunConfig
from miles.utils.errors import MilesUserError
from miles.utils.safe_load import load_plain, save_plain

logger = logging.getLogger(__name__)


def same_directory(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def checkpoint_to_resume(config: RunConfig) -> CheckpointFiles | None:
    """The checkpoint `--load` (and `--ckpt-step`) names, checked (`inspect_checkpoint`); None to start fresh.

    Starting fresh is allowed only when `--load` is the `--save` folder and holds no checkpoint yet (a job that
    resumes itself after a restart, the reference's behaviour); any other `--load` without a checkpoint is an
    error, so a typo in the path cannot silently train from scratch.
    """
    root = config.checkpoint.load
    if not root:
        return None
    step = config.checkpoint.ckpt_step
    resumes_itself = same_directory(root, config.checkpoint.save)
    if step is None:
        if os.path.exists(root) and not os.path.isdir(root):
            raise MilesUserError(f"--load {root!r} is a file, not a checkpoint folder")
        step = read_latest_iteration(root) if os.path.isdir(root) else None
        if step is None:
            if resumes_itself:
                logger.info("--load %s (= --save) holds no checkpoint yet: starting from scratch", root)
                return None
            if not os.path.isdir(root):
                raise MilesUserError(f"--load {root!r}: no such folder (to start from scratch drop --load; "
                                     "--load equal to --save resumes only if a checkpoint is there)")
            found = saved_iterations(root)
            hint = f"; it holds {os.path.basename(iteration_dir(root, found[-1]))}: pass --ckpt-step {found[-1]}" \
                if found else ""
            raise MilesUserError(f"--load {root!r}: no {POINTER_FILE}, so no checkpoint to resume{hint}")
    return inspect_checkpoint(iteration_dir(root, int(step)), config)


def inspect_checkpoint(directory: str, config: RunConfig) -> CheckpointFiles:
    """`read_checkpoint` (meta, index and shards checked without loading weights), then the model family and
    --use-lora must match the run's. Every problem is one line."""
    checked = read_checkpoint(directory)
    _check_meta_matches_run(directory, checked.meta, config)
    return checked


def _check_meta_matches_run(directory: str, meta: dict[str, Any], config: RunConfig) -> None:
    saved_family = meta.get("family")  # absent in checkpoints written before the family was recorded
    run_family = run_family_label(config.model)
    if saved_family is not None and saved_family != run_family:
        raise MilesUserError(
            f"--load {directory!r} holds model family {saved_family!r}, but this run trains {run_family!r} "
            "(--hf-checkpoint / --diffusion-model-family / --train-pipeline-config-path)"
        )
    use_lora = config.trainer.use_lora
    if meta["use_lora"] != use_lora:
        raise MilesUserError(
            f"--load {directory!r} was saved with use_lora={meta['use_lora']}; this run has --use-lora={use_lora}"
        )
    saved_lora = meta.get("lora")  # absent in checkpoints written before the LoRA settings were recorded
    if use_lora and isinstance(saved_lora, dict):
        trainer = config.trainer
        for key, flag, value in (("r", "--lora-rank", trainer.lora_rank), ("lora_alpha", "--lora-alpha",
                                                                             trainer.lora_alpha)):
            if key in saved_lora and int(saved_lora[key]) != int(value):
                raise MilesUserError(f"--load {directory!r} holds a LoRA adapter of {key} {saved_lora[key]}, but this "
                                     f"run has {flag} {value}: pass {flag} {saved_lora[key]} to resume it")


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
    try:
        with open(temp, "w") as handle:
            handle.write(f"{rollout_id}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, os.path.join(root, POINTER_FILE))
    except OSError as err:
        if os.path.exists(temp):
            os.remove(temp)  # the old pointer stays in force; no half-written copy next to it
        raise OSError(err.errno, err.strerror, temp) from err  # name the file in the one-line error


# ---- RNG states as plain values (weights_only=True loads them) -------------------------------------------
def _plain_rng_state() -> dict[str, Any]:
    state = deterministic.rng_state()
    bit_generator, key, position, has_gauss, cached_gaussian = state["numpy"]
    state["numpy"] = {"bit_generator": bit_generator, "key": torch.from_numpy(key.astype(np.int64)),
                      "pos": int(position), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return state


def _restore_plain_rng_state(state: dict[str, Any]) -> None:
    numpy_state = state["numpy"]
    state = {**state, "numpy": (numpy_state["bit_generator"], numpy_state["key"].numpy().astype(np.uint32),
                                numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"])}
    deterministic.set_rng_state(state)


# ---- saving ---------------------------------------------------------------------------------------------
def _failed_on_any_rank(failed_here: bool) -> bool:
    """Whether any rank failed (a collective: every rank calls it), so no rank waits for one that gave up."""
    if not dist.is_initialized():
        return failed_here
    device = "cuda" if str(dist.get_backend()) == "nccl" else "cpu"  # gloo, or a cpu:gloo,cuda:nccl group
    flag = torch.tensor([1 if failed_here else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_checkpoint(trainer, rollout_id: int, extra_state: dict | None = None, root: str | None = None) -> str:
    """Save everything needed to resume after `rollout_id`; every rank calls it. Returns the iteration dir.

    A failed write on any rank (disk full, permissions, a state that is not plain values) removes the temp
    folder and raises one `MilesUserError` on every rank; the pointer still names the previous checkpoint.
    """
    config = trainer.config
    root = root or config.checkpoint.save
    if not root:
        raise MilesUserError("saving a checkpoint needs --save")
    final_dir = iteration_dir(root, rollout_id)
    temp_dir = final_dir + ".tmp"
    error: BaseException | None = None
    try:
        if _rank() == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(temp_dir, ignore_errors=True)  # a stale half-written save of an earlier crash
            os.makedirs(os.path.join(temp_dir, "rng"))
    except OSError as err:
        error = err
    _stop_if_any_rank_failed(root, rollout_id, temp_dir, error)
    try:
        _write_checkpoint(trainer, rollout_id, extra_state, temp_dir)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank must hear of it, see below
        error = err
    _stop_if_any_rank_failed(root, rollout_id, temp_dir, error)
    try:
        if _rank() == 0:
            _publish(root, rollout_id, temp_dir, final_dir)
    except OSError as err:
        error = err
    _stop_if_any_rank_failed(root, rollout_id, temp_dir, error)
    keep = config.checkpoint.save_keep_latest
    if keep and _rank() == 0:
        try:
            delete_old_checkpoints(root, int(keep), keep_rollout_id=rollout_id)
        except OSError as err:  # the new checkpoint is complete; an old one that stays only costs disk
            logger.warning("--save-keep-latest %s: could not delete an old checkpoint under %s: %s", keep, root, err)
    return final_dir


def _write_checkpoint(trainer, rollout_id: int, extra_state: dict | None, temp_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    config = trainer.config
    state: dict = {"model": _model_state(trainer)}
    save_optim = not config.checkpoint.no_save_optim
    if save_optim:
        state["optimizer"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    if trainer.ema is not None:
        state["ema"] = trainer.ema.shadow_tensors()
    dcp.save(state, checkpoint_id=temp_dir)
    save_plain(_plain_rng_state(), os.path.join(temp_dir, "rng", f"rank_{_rank()}.pt"), "--save RNG state")
    if _rank() == 0:
        meta = {
            "rollout_id": rollout_id,
            "global_step": trainer.global_step,
            "has_optimizer": save_optim,
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "grad_scaler": trainer.scaler.state_dict(),
            "ema_num_updates": None if trainer.ema is None else trainer.ema.num_updates,
            "use_lora": config.trainer.use_lora,
            "family": run_family_label(config.model),
            # what `python -m miles.export` needs besides the shards (absent from older checkpoints)
            "hf_checkpoint": recorded_base(config.model.hf_checkpoint),
            "modules": list(trainer.model.keys()),
            "lora": lora_settings(trainer.lora_config) if config.trainer.use_lora else None,
            "world_size": trainer.world_size,
            "extra_state": extra_state or {},
        }
        save_plain(meta, os.path.join(temp_dir, META_FILE), "--save checkpoint meta (extra_state comes from the "
                   "data source's state_dict())")


def _publish(root: str, rollout_id: int, temp_dir: str, final_dir: str) -> None:
    """Rank 0: the complete temp folder becomes the checkpoint, then the pointer moves to it."""
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


# Failures of a save that are the environment's or the user's (one line); anything else is a bug (traceback).
_SAVE_ERRORS = (OSError, CheckpointException, MilesUserError)


def _stop_if_any_rank_failed(root: str, rollout_id: int, temp_dir: str, error: BaseException | None) -> None:
    """Every rank calls it after each step of a save: if any rank failed, all stop here (none waits forever in
    the next collective), the temp folder goes, and each rank raises: one line for an environment or user
    failure, the original exception (with its traceback) for a bug."""
    if not _failed_on_any_rank(error is not None):
        return
    if _rank() == 0 and os.path.isdir(temp_dir):
        try:
            shutil.rmtree(temp_dir)  # a half-written checkpoint must not fill the disk further
        except OSError as cleanup_error:
            logger.warning("--save %s: could not remove the incomplete %s: %s", root, temp_dir, cleanup_error)
    if error is not None and not isinstance(error, _SAVE_ERRORS):
        raise error
    latest = read_latest_iteration(root) if os.path.isdir(root) else None
    still = f"{POINTER_FILE} still names {os.path.basename(iteration_dir(root, latest))}" if latest is not None \
        else "no earlier checkpoint exists"
    cause = describe_failure(error) if error is not None else "another rank failed (its log says why)"
    raise MilesUserError(f"--save {root!r}: saving the checkpoint of rollout {rollout_id} failed: {cause}; {still}")


def delete_old_checkpoints(root: str, keep: int, keep_rollout_id: int | None = None) -> list[str]:
    """`--save-keep-latest`: delete all but the newest `keep` checkpoints (by rollout id); returns what went.

    The checkpoint just saved (`keep_rollout_id`) and the one the pointer names always stay, even when a resumed
    run saves below an older run's later checkpoints.
    """
    iterations = saved_iterations(root)
    protected = {keep_rollout_id, read_latest_iteration(root)}
    kept = set(iterations[-keep:]) | protected
    deleted = []
    for rollout_id in iterations:
        if rollout_id not in kept:
            directory = iteration_dir(root, rollout_id)
            shutil.rmtree(directory)
            deleted.append(directory)
    if deleted:
        logger.info("--save-keep-latest %d: deleted %s", keep, ", ".join(os.path.basename(d) for d in deleted))
    return deleted


# ---- loading --------------------------------------------------------------------------------------------
def load_checkpoint(trainer) -> int:
    """Resume from `--load` (iteration `--ckpt-step` or the pointer file); returns the next rollout id.

    Sets `trainer.loaded_extra_state` (the caller's data-source position) to the saved dict, or None.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    config = trainer.config
    trainer.loaded_extra_state = None
    resume = checkpoint_to_resume(config)  # the checked index is the one DCP loads with: no file is read twice
    if resume is None:
        return 0
    directory, meta = resume.directory, resume.meta
    load_optim = not config.checkpoint.no_load_optim
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
    load_dcp(state, directory, resume.index)
    if load_optim:
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=state["optimizer"])
        # validation turns use_checkpoint_lr_scheduler off under --override-lr-scheduler
        use_checkpoint_schedule = config.trainer.use_checkpoint_lr_scheduler
        trainer.lr_scheduler.load_state_dict(meta["lr_scheduler"], use_checkpoint_schedule=use_checkpoint_schedule)
        trainer.scaler.load_state_dict(meta["grad_scaler"])
    if ema_template is not None:
        trainer.ema.load_state_dict({"num_updates": meta["ema_num_updates"], "shadow": ema_template})
    elif trainer.ema is not None:
        logger.warning("--load %s holds no EMA: the EMA starts from the loaded weights", directory)
    trainer.global_step = int(meta["global_step"])
    if not config.checkpoint.no_load_rng:
        _load_rng(directory, meta, trainer.world_size)
    trainer.loaded_extra_state = meta["extra_state"]
    logger.info("loaded checkpoint %s (rollout %d)", directory, meta["rollout_id"])
    return int(meta["rollout_id"]) + 1


def _load_rng(directory: str, meta: dict[str, Any], world_size: int) -> None:
    rng_path = os.path.join(directory, "rng", f"rank_{_rank()}.pt")
    if meta["world_size"] != world_size or not os.path.exists(rng_path):
        logger.warning("--load %s: RNG states not restored (saved with %d ranks, %s)", directory, meta["world_size"],
                       "no file for this rank" if not os.path.exists(rng_path) else f"this run has {world_size}")
        return
    try:
        state = load_plain(rng_path, "--load checkpoint RNG state")
    except MilesUserError as err:
        raise MilesUserError(f"{err}; --no-load-rng resumes without the RNG states") from None
    if not isinstance(state.get("numpy") if isinstance(state, dict) else None, dict):
        raise MilesUserError(f"--load checkpoint RNG state {rng_path}: not a miles RNG state file")
    _restore_plain_rng_state(state)


def export_lora(trainer, path: str) -> None:
    """Write the LoRA adapter in the diffusers/PEFT format `pipeline.load_lora_weights(path)` reads.

    Every rank calls it (the adapter tensors are gathered); rank 0 writes. `python -m miles.export` does the same
    from a checkpoint (miles.backends.fsdp_utils.model_export).
    """
    from miles.backends.fsdp_utils.weight_export import lora_adapter_state

    if not trainer.config.trainer.use_lora:
        raise MilesUserError("export_lora needs a run with --use-lora")
    adapters = {name: lora_adapter_state(trainer, name) for name in trainer.model.keys()}
    if _rank() == 0:
        write_lora_adapter(trainer.family.pipeline_class_name, adapters, trainer.lora_config, path)
        logger.info("exported LoRA adapter to %s", path)
    _barrier()
