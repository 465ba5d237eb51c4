"""The trainer's step under `--diffusion-rollout-gradient`: the engines already took each sample's gradient.

The rollout manager hands the trainer Σ_b c_b·G_b (c_b = −clip(A_b)/P; miles/engine/rollout_gradients.py),
by the names the LoRA pairs were pushed under. That is the gradient the replayed clipped loss would give at ratio 1
(docs/algorithms.md §5), so the trainer only puts it in each adapter's `.grad` (its shard, under FSDP) and takes
the ordinary optimizer step: clipping, the NaN guard, the LR schedule and the EMA as in `DiffusionTrainer.train`.

The metrics a replay would log are exact here without one: the ratio is exp(ℓ − ℓ) of the very forward that
sampled, so `train/rollout_train_log_prob_abs_diff` is 0, `train/clipfrac` 0, `train/ratio_mean` 1, and the
loss Σ_pairs −clip(A)/P is the mean over samples' pairs of −clip(A_b).
"""

from __future__ import annotations

import time

import torch

from miles.backends.fsdp_utils.weight_export import is_lora_param, strip_peft_name
from miles.diffusion.losses import rollout_gradient_coefficients
from miles.engine.weight_sync import canonical_lora_name
from miles.types import Sample
from miles.utils.errors import MilesUserError


def adapter_params_by_pushed_name(trainer) -> dict[str, torch.nn.Parameter]:
    """Each trainable LoRA factor under the name the engines know it by (`<module>.<layer>.lora_A.weight`)."""
    params = {}
    for prefix, module in trainer.model.items():
        for name, param in module.named_parameters():
            if param.requires_grad and is_lora_param(name):
                params[canonical_lora_name(f"{prefix}.{strip_peft_name(name)}")] = param
    return params


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `param` is: its FSDP shard (a DTensor), or itself."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, param.device_mesh, param.placements)
    return full


def train_on_rollout_gradient(trainer, rollout_id: int, samples: list[Sample],
                              gradient: dict[str, torch.Tensor]) -> dict[str, float]:
    started = time.perf_counter()
    params = adapter_params_by_pushed_name(trainer)
    if set(params) != set(gradient):
        missing, extra = sorted(set(params) - set(gradient)), sorted(set(gradient) - set(params))
        raise MilesUserError(f"--diffusion-rollout-gradient: the engines' gradient names do not match the adapter "
                             f"(missing {missing[:3]}, unknown {extra[:3]})")
    trainer.optimizer.zero_grad(set_to_none=True)
    finite = torch.ones((), dtype=torch.bool, device=trainer.device)
    for name, param in params.items():
        full = gradient[name].to(device=trainer.device, dtype=param.dtype)
        finite &= torch.isfinite(full).all()
        param.grad = _like(param, full)
    grad_norm = trainer.optimizer_step(f"rollout {rollout_id}", finite)
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
        "perf/train_time_s": seconds, "perf/train_pairs_per_s": float(pairs.sum()) / max(seconds, 1e-9),
    }
    if grad_norm is not None:
        result["train/grad_norm"] = float(grad_norm)
    if trainer.ema is not None:
        result["train/ema_num_updates"] = float(trainer.ema.num_updates)
    return result
