"""The engine takes the trainer's optimizer step on its own adapter (`--diffusion-rollout-gradient`, the trainer on
the host; `--rollout-gradient-engine-step`).

After a rollout the trainer asks the engine for Σ_b c_b·G_b (`POST /policy_gradient`). When the request also
carries the step's AdamW settings (`AdamWStep`), the engine, which holds that gradient and the adapter's fp32
factors on its device, steps them itself with the arithmetic the trainer runs too (miles/diffusion/mirrored_adamw.py),
merges the new factors into its weights and moves to the next weight version: a rollout sent ahead for that
version starts denoising before the trainer has even read the answer, and no weight push follows. The trainer takes
the same step on its own copy (its weights and moments stay the run's, for checkpoints and exports) and compares
the two with the answer's exact checksum.

The engine keeps AdamW's two moments for that (2 × 72 MiB at SD3.5-Medium, LoRA rank 32), in pinned host memory
on a GPU engine so that they sit outside the denoising steps' peak; they come to the device for the step. Its
moments are the trainer's only while its step count is the trainer's: a step whose number is not the next one
(the first after a resume, a restarted engine) is answered `no_state`, and the trainer then steps alone, pushes the
weights as before and sends its moments (`POST /optimizer_state`, `load_moments`).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from miles.diffusion.mirrored_adamw import AdamWStep, adamw_step, bits_checksum, clip_scale
from miles.engine.protocol import AdapterStepAnswer, ProtocolError
from miles.engine.rollout_gradients import RolloutGradients


class AdapterStepper:
    """One engine's AdamW moments over the adapter's flat layout (`RolloutGradients.layout`) and the step on them.
    `merge(module, layer, lora_a, lora_b)`: puts one layer's new factors into the engine's weights (the weight
    receiver's merge, which also hands them back to `gradients`)."""

    def __init__(self, gradients: RolloutGradients, merge: Callable[[str, str, torch.Tensor, torch.Tensor], None]):
        self.gradients = gradients
        self.merge = merge
        self.moments: tuple[torch.Tensor, torch.Tensor] | None = None  # (exp_avg, exp_avg_sq), flat fp32
        self.count = 0  # the steps these moments have taken

    def _numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.gradients.layout())

    def _fresh_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        on_gpu = self.gradients.device.type == "cuda"
        return tuple(torch.zeros(self._numel(), dtype=torch.float32, pin_memory=on_gpu) for _ in range(2))

    def load_moments(self, count: int, flat: torch.Tensor) -> None:
        """The trainer's moments after its step `count`: `flat` is exp_avg then exp_avg_sq, fp32 in layout order."""
        numel = self._numel()
        if count < 0 or flat.numel() < 2 * numel:
            raise ProtocolError(f"optimizer_state: {flat.numel()} values for 2 × {numel} moments at step {count}")
        moments = self._fresh_moments()
        for index, moment in enumerate(moments):
            moment.copy_(flat[index * numel : (index + 1) * numel])
        self.moments, self.count = moments, count

    def step(self, gradient: torch.Tensor, step: AdamWStep) -> AdapterStepAnswer:
        """One AdamW step on the factors from `gradient` (Σ_b c_b·G_b, flat fp32 in layout order, on the device)."""
        began = time.perf_counter()
        g = torch.zeros_like(gradient).add_(gradient)  # the trainer reads the sum added into zeros: −0 becomes +0
        grad_norm = float(torch.linalg.vector_norm(g))
        if step.count == 1:  # the run's first step: the trainer's moments are zero too
            self.moments, self.count = self._fresh_moments(), 0
        if self.moments is None or self.count != step.count - 1:
            return AdapterStepAnswer("no_state", grad_norm, seconds=time.perf_counter() - began)
        if not math.isfinite(grad_norm):
            return AdapterStepAnswer("skipped", grad_norm, seconds=time.perf_counter() - began)
        device = g.device
        exp_avg, exp_avg_sq = (m.to(device, non_blocking=True) for m in self.moments)
        flat = self.gradients.flat_factors().clone()
        adamw_step(flat, g, exp_avg, exp_avg_sq, step, clip_scale(grad_norm, step.clip))
        for held, moved in zip(self.moments, (exp_avg, exp_avg_sq)):
            if held is not moved:  # queued behind the step on this stream, as the next step's copy to the device
                held.copy_(moved, non_blocking=True)
        offset = 0
        for key, factors in list(self.gradients.factors.items()):
            module, _, layer = key.partition(".")
            a = flat[offset : offset + factors.a.numel()].view(factors.a.shape)
            offset += factors.a.numel()
            b = flat[offset : offset + factors.b.numel()].view(factors.b.shape)
            offset += factors.b.numel()
            self.merge(module, layer, a, b)
        self.count = step.count
        return AdapterStepAnswer("stepped", grad_norm, bits_checksum([flat]), time.perf_counter() - began)
