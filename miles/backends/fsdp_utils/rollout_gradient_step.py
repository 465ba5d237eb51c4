"""The trainer's step under `--diffusion-rollout-gradient`: the engines already took each sample's gradient.

Rank 0 fetches Σ_b c_b·G_b from the engines (c_b = −clip(A_b)/P; gradient_fetch.py) and broadcasts it to the
other ranks. That is the gradient the replayed clipped loss would give at ratio 1
(docs/algorithms.md §5), so the trainer only puts it in each adapter's `.grad` (its shard, under FSDP) and takes
the ordinary optimizer step: clipping, the NaN guard, the LR schedule and the EMA as in `DiffusionTrainer.train`.
Where one engine holds the rollout and shares the trainer's memory (a trainer on the host), that engine takes the
step too (`--rollout-gradient-engine-step`, miles/engine/adapter_step.py): both run miles/diffusion/mirrored_adamw.py's
arithmetic with the engine's gradient norm, the trainer checks the engine's checksum of the new factors, and no
weight push follows.

The metrics a replay would log are exact here without one: the ratio is exp(ℓ − ℓ) of the very forward that
sampled, so `train/rollout_train_log_prob_abs_diff` is 0, `train/clipfrac` 0, `train/ratio_mean` 1, and the
loss Σ_pairs −clip(A)/P is the mean over samples' pairs of −clip(A_b).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient
from miles.backends.fsdp_utils.weight_export import is_lora_param, strip_peft_name
from miles.diffusion.losses import rollout_gradient_coefficients
from miles.diffusion.mirrored_adamw import AdamWStep, adamw_step, bits_checksum, clip_scale
from miles.engine.weight_sync import WeightSyncError, canonical_lora_name
from miles.types import Sample
from miles.utils.errors import PartDiedError

logger = logging.getLogger(__name__)


def adapter_params_by_pushed_name(trainer) -> dict[str, torch.nn.Parameter]:
    """Each trainable LoRA factor under the name the engines know it by (`<module>.<layer>.lora_A.weight`)."""
    params = {}
    for prefix, module in trainer.model.items():
        for name, param in module.named_parameters():
            if param.requires_grad and is_lora_param(name):
                params[canonical_lora_name(f"{prefix}.{strip_peft_name(name)}")] = param
    return params


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `param` is: this rank's FSDP shard (a DTensor), cut from `full`, which every rank holds
    (no communication), or `full` itself. On a mesh of one rank the shard is `full` itself, wrapped as it is:
    `distribute_tensor`'s checks and split cost a third of the host trainer's step at SD3.5-Medium's 382 factors
    (bench/RESULTS.md, thirtieth section)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor, distribute_tensor

        if param.device_mesh.size() == 1:
            return DTensor.from_local(full, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def _everyone_holds(fetched: FetchedGradient, numel: int, device: torch.device) -> torch.Tensor:
    """The flat gradient on every rank: rank 0 fetched it; one broadcast (of the held count, then of the
    vector) gives it to the others, and every rank stops alike when an engine lost samples."""
    flat = fetched.flat
    if dist.is_initialized() and dist.get_world_size() > 1:
        held = torch.tensor([fetched.held], dtype=torch.int64, device=device)
        dist.broadcast(held, src=0)
        fetched.held = int(held.item())
        if fetched.held == fetched.expected:
            flat = flat if flat is not None else torch.empty(numel, dtype=torch.float32, device=device)
            dist.broadcast(flat, src=0)
    if fetched.held != fetched.expected:
        raise PartDiedError(f"--diffusion-rollout-gradient: the engines held the gradients of {fetched.held} of the "
                            f"rollout's {fetched.expected} samples (an engine restarted during the rollout?)")
    assert flat is not None and flat.numel() == numel
    return flat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def steps_taken(trainer) -> int:
    """The optimizer steps the trainer's adapter has taken (AdamW's `step` in its state; 0 before the first)."""
    first = trainer.optimizer.param_groups[0]["params"][0]
    state = trainer.optimizer.state.get(first, {})
    return int(state["step"]) if "step" in state else 0


def next_adamw_step(trainer) -> AdamWStep | None:
    """The settings of the trainer's next optimizer step, for the engine to take it too (miles/engine/adapter_step.py);
    None where that step is not plain AdamW on one parameter group of one rank (fp16's loss scaling, several ranks
    that would all have to skip the weight push alike)."""
    optimizer = trainer.optimizer
    if len(optimizer.param_groups) != 1 or trainer.scaler.is_enabled() or trainer.world_size != 1:
        return None
    group = optimizer.param_groups[0]
    return AdamWStep(lr=float(group["lr"]), beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
                     eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                     clip=float(trainer.config.trainer.clip_grad), count=steps_taken(trainer) + 1)


def engine_step_wanted(config, engine_holds_rollout: bool) -> bool:
    """Whether the run asks its engine to take the trainer's optimizer step (`--rollout-gradient-engine-step
    auto`): the trainer on the host, one engine holding the whole rollout in memory the trainer shares, and no
    `--check-weight-sync` (it compares pushed weights)."""
    trainer = config.trainer
    return (trainer.on_host and trainer.rollout_gradient_engine_step == "auto" and not config.rollout.check_weight_sync
            and engine_holds_rollout)


def engine_may_step(config, engine_holds_rollout: bool, engine_info: dict) -> bool:
    """`engine_step_wanted`, and an engine whose device steps this AdamW with the host's bits (its start-up check,
    `adamw_matches_host` in its server info)."""
    return engine_step_wanted(config, engine_holds_rollout) and bool(engine_info.get("adamw_matches_host"))


def adapter_moments(trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapter factor's AdamW moments (exp_avg, exp_avg_sq) by the name the engines know it by."""
    state = trainer.optimizer.state
    return {name: (_local(state[p]["exp_avg"]), _local(state[p]["exp_avg_sq"]))
            for name, p in adapter_params_by_pushed_name(trainer).items()}


def _mirrored_step(trainer, where: str, params: dict[str, torch.nn.Parameter], flat: torch.Tensor,
                   fetched: FetchedGradient) -> torch.Tensor | None:
    """The step the engine took on its copy (or, where it had no moments, would have taken), on the trainer's
    factors, with the same arithmetic and the engine's gradient norm: the same bits on both sides, checked."""
    step, answer = fetched.step, fetched.engine_step
    assert step is not None and answer is not None
    trainer.optimizer.zero_grad(set_to_none=True)
    if not math.isfinite(answer.grad_norm):
        logger.warning("%s: non-finite gradient (norm %s); optimizer step skipped, weights unchanged", where,
                       answer.grad_norm)
        return None
    scale, offset = clip_scale(answer.grad_norm, step.clip), 0
    for param in params.values():
        grad = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
        state = trainer.optimizer.state[param]
        if not state:  # as torch's AdamW lays its state out, for checkpoints and a later run without this mode
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        adamw_step(_local(param.detach()), grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), step, scale)
        state["step"] = torch.tensor(float(step.count))
    trainer.lr_scheduler.step()
    trainer.global_step += 1
    if answer.outcome == "stepped":
        ours = bits_checksum(_local(p.detach()) for p in params.values())
        if ours != answer.checksum:
            raise WeightSyncError(f"{where}: the engine's optimizer step gave other weights than the trainer's "
                                  f"(checksums {answer.checksum} and {ours}); rerun with --rollout-gradient-engine-"
                                  "step off and report this")
    return torch.tensor(answer.grad_norm)


def train_on_rollout_gradient(trainer, rollout_id: int, samples: list[Sample],
                              fetched: FetchedGradient) -> dict[str, float]:
    started = time.perf_counter()
    params = adapter_params_by_pushed_name(trainer)
    flat = _everyone_holds(fetched, sum(p.numel() for p in params.values()), trainer.device)
    if fetched.step is not None:
        grad_norm = _mirrored_step(trainer, f"rollout {rollout_id}", params, flat, fetched)
    else:
        trainer.optimizer.zero_grad(set_to_none=True)
        offset = 0
        for param in params.values():
            full = flat[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()
            param.grad = _like(param, full.to(param.dtype))
        # no loss was computed: a non-finite gradient makes the gradient norm non-finite, which skips the step (the
        # flag on the trainer's device: several ranks reduce it, and NCCL takes no host tensor)
        grad_norm = trainer.optimizer_step(f"rollout {rollout_id}", torch.tensor(True, device=flat.device))
    if trainer.ema is not None:
        trainer.ema.update()
    kept = [s for s in samples if not s.remove_sample]
    pairs = torch.tensor([len(s.sde_step_indices) for s in kept], dtype=torch.float32)
    coefficients = rollout_gradient_coefficients(torch.tensor([float(s.advantage) for s in kept]), pairs,
                                                 trainer.config.trainer.diffusion_adv_clip_max)
    loss = float((coefficients * pairs).sum())  # the mean over pairs of −clip(A) at ρ = 1
    seconds = time.perf_counter() - started
    result = {
        "train/loss": loss, "train/policy_loss": loss, "train/clipfrac": 0.0, "train/ratio_mean": 1.0,
        "train/rollout_train_log_prob_abs_diff": 0.0, "train/lr": trainer.optimizer.param_groups[0]["lr"],
        "train/num_pairs": float(pairs.sum()), "train/skipped_steps": float(grad_norm is None),
        "perf/train_time_s": seconds + fetched.seconds,
        "perf/train_pairs_per_s": float(pairs.sum()) / max(seconds + fetched.seconds, 1e-9),
        "perf/policy_gradient_fetch_s": fetched.seconds,
        # of which the engines' answers: waiting for their worker thread, and forming and adding the sum
        "perf/policy_gradient_engine_wait_s": fetched.engine_wait_seconds,
        "perf/policy_gradient_engine_sum_s": fetched.engine_sum_seconds,
        "perf/policy_gradient_engines_by_reference": float(fetched.engines_by_reference),
        "perf/policy_gradient_engines_by_body": float(fetched.engines_by_body),
    }
    if fetched.engine_step is not None:  # the engine's own optimizer step and merge (miles/engine/adapter_step.py)
        result["perf/policy_gradient_engine_step_s"] = fetched.engine_step.seconds
        result["train/engine_stepped"] = float(fetched.engine_step.outcome != "no_state")
    if grad_norm is not None:
        result["train/grad_norm"] = float(grad_norm)
    if trainer.ema is not None:
        result["train/ema_num_updates"] = float(trainer.ema.num_updates)
    return result
