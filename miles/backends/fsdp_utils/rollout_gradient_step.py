"""The trainer's step under `--diffusion-rollout-gradient`: the engines already took each sample's gradient.

Rank 0 fetches Σ_b c_b·G_b from the engines (c_b = −clip(A_b)/P; gradient_fetch.py) and broadcasts it to the
other ranks. That is the gradient the replayed clipped loss would give at ratio 1
(docs/algorithms.md §5), so the trainer only puts it in each adapter's `.grad` (its shard, under FSDP) and takes
the ordinary optimizer step: clipping, the NaN guard, the LR schedule and the EMA as in `DiffusionTrainer.train`.

The metrics a replay would log are exact here without one: the ratio is exp(ℓ − ℓ) of the very forward that
sampled, so `train/rollout_train_log_prob_abs_diff` is 0, `train/clipfrac` 0, `train/ratio_mean` 1, and the
loss Σ_pairs −clip(A)/P is the mean over samples' pairs of −clip(A_b).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient
from miles.backends.fsdp_utils.weight_export import is_lora_param, strip_peft_name
from miles.diffusion.losses import rollout_gradient_coefficients
from miles.engine.weight_sync import canonical_lora_name
from miles.types import Sample
from miles.utils.errors import PartDiedError


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


def train_on_rollout_gradient(trainer, rollout_id: int, samples: list[Sample],
                              fetched: FetchedGradient) -> dict[str, float]:
    started = time.perf_counter()
    params = adapter_params_by_pushed_name(trainer)
    flat = _everyone_holds(fetched, sum(p.numel() for p in params.values()), trainer.device)
    trainer.optimizer.zero_grad(set_to_none=True)
    offset = 0
    for param in params.values():
        full = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
        param.grad = _like(param, full.to(param.dtype))
    # no loss was computed: a non-finite gradient makes the gradient norm non-finite, which skips the step (the flag
    # on the trainer's device: several ranks reduce it, and NCCL takes no host tensor)
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
    if grad_norm is not None:
        result["train/grad_norm"] = float(grad_norm)
    if trainer.ema is not None:
        result["train/ema_num_updates"] = float(trainer.ema.num_updates)
    return result
