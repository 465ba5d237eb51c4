"""Megatron-style learning-rate schedules (docs/algorithms.md §9; Megatron-LM arXiv 1909.08053, WSD arXiv 2404.06395).

s = scheduler steps taken (0 at construction, one `step()` after each optimizer step). lr(s):
warmup `init + (max − init)·s/W` for W > 0 and s ≤ W; then `constant` → max; s > D → min; `inverse-square-root`
→ max(min, max·sqrt(max(W,1))/sqrt(max(s,1))); else r = (s−W)/(D−W) and lr = min + c·(max − min) with linear,
cosine or WSD coefficients c.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from miles.utils.errors import MilesUserError

if TYPE_CHECKING:
    from miles.config.sections import TrainerConfig

__all__ = ["DECAY_STYLES", "WSD_DECAY_STYLES", "LRScheduler", "build_lr_scheduler"]

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _normalize_style(style: str) -> str:
    return "WSD" if style.lower() == "wsd" else style


class LRScheduler:
    """Sets every param group's lr to lr(s) at construction and after each `step()`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        min_lr: float,
        warmup_init: float,
        warmup_steps: float,
        decay_steps: float,
        decay_style: str,
        wsd_decay_steps: float | None = None,
        wsd_decay_style: str | None = None,
    ):
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_init = float(warmup_init)
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = _normalize_style(decay_style)
        self.wsd_decay_steps = wsd_decay_steps
        self.wsd_decay_style = wsd_decay_style
        self._validate()
        self.num_steps = 0
        self._apply(self.get_lr())

    def _validate(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise MilesUserError(f"--lr-decay-style {self.decay_style!r}: expected one of {', '.join(DECAY_STYLES)}")
        if not self.decay_steps > 0:
            raise MilesUserError(f"--lr-decay-iters {self.decay_steps}: must be > 0")
        if self.warmup_steps < 0:
            raise MilesUserError(f"--lr-warmup-iters {self.warmup_steps}: must be >= 0")
        if not self.warmup_steps < self.decay_steps:
            raise MilesUserError(
                f"LR warmup ({self.warmup_steps} steps, --lr-warmup-iters / --lr-warmup-fraction) must be shorter "
                f"than the decay ({self.decay_steps} steps, --lr-decay-iters)"
            )
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise MilesUserError(f"--min-lr {self.min_lr} / --lr {self.max_lr}: need 0 <= min-lr <= lr")
        if not self.warmup_init <= self.max_lr:
            raise MilesUserError(f"--lr-warmup-init {self.warmup_init}: must be <= --lr {self.max_lr}")
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.decay_steps:
                raise MilesUserError(
                    f"--lr-wsd-decay-iters {self.wsd_decay_steps}: WSD needs 0 < value <= the decay length "
                    f"({self.decay_steps}, --lr-decay-iters)"
                )
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise MilesUserError(
                    f"--lr-wsd-decay-style {self.wsd_decay_style!r}: expected one of {', '.join(WSD_DECAY_STYLES)}"
                )

    def get_lr(self, step: int | None = None) -> float:
        """lr(s) of §9 for s = `step` (default: the steps taken so far)."""
        s = self.num_steps if step is None else step
        lr_max, lr_min, warmup, decay = self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps
        if warmup > 0 and s <= warmup:
            return self.warmup_init + (lr_max - self.warmup_init) * s / warmup
        if self.decay_style == "constant":
            return lr_max
        if s > decay:
            return lr_min
        if self.decay_style == "inverse-square-root":
            return max(lr_min, lr_max * math.sqrt(max(warmup, 1)) / math.sqrt(max(s, 1)))
        ratio = (s - warmup) / (decay - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        else:  # WSD: flat until D − Dw, then the chosen decay over the last Dw steps
            anneal_start = decay - self.wsd_decay_steps
            if s <= anneal_start:
                coeff = 1.0
            else:
                q = (s - anneal_start) / self.wsd_decay_steps
                if self.wsd_decay_style == "linear":
                    coeff = 1.0 - q
                elif self.wsd_decay_style == "cosine":
                    coeff = 0.5 * (1.0 + math.cos(math.pi * q))
                elif self.wsd_decay_style == "exponential":
                    coeff = 2.0 * 0.5**q - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return lr_min + coeff * (lr_max - lr_min)

    def _apply(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """Advance one step (after an optimizer step) and set the new lr; returns it."""
        self.num_steps += 1
        lr = self.get_lr()
        self._apply(lr)
        return lr

    def state_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_init": self.warmup_init,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
            "wsd_decay_steps": self.wsd_decay_steps,
            "wsd_decay_style": self.wsd_decay_style,
        }

    def load_state_dict(self, state: dict, use_checkpoint_schedule: bool = True) -> None:
        """Restore the step counter and (default, `--use-checkpoint-lr-scheduler`) the checkpoint's schedule;
        with `use_checkpoint_schedule=False` (`--override-lr-scheduler`) keep this object's CLI schedule."""
        if use_checkpoint_schedule:
            for key in (
                "max_lr",
                "min_lr",
                "warmup_init",
                "warmup_steps",
                "decay_steps",
                "decay_style",
                "wsd_decay_steps",
                "wsd_decay_style",
            ):
                setattr(self, key, state[key])
            self._validate()
        self.num_steps = int(state["num_steps"])
        self._apply(self.get_lr())


def build_lr_scheduler(trainer: TrainerConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """The scheduler from the `--lr*` flags; `total_steps` = T = num_rollout × num_steps_per_rollout (§9).

    D = `--lr-decay-iters` or T; W = `--lr-warmup-fraction`·D if given else `--lr-warmup-iters`.
    """
    decay_steps = trainer.lr_decay_iters or total_steps
    if not decay_steps or decay_steps <= 0:
        raise MilesUserError(f"--lr-decay-iters: the decay length must be > 0 (got {decay_steps}; T = {total_steps})")
    fraction = trainer.lr_warmup_fraction
    if fraction is not None:
        if not 0.0 <= fraction < 1.0:
            raise MilesUserError(f"--lr-warmup-fraction {fraction}: must be in [0, 1)")
        warmup_steps = fraction * decay_steps
    else:
        warmup_steps = trainer.lr_warmup_iters
    return LRScheduler(
        optimizer,
        max_lr=trainer.lr,
        min_lr=trainer.min_lr,
        warmup_init=trainer.lr_warmup_init,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=trainer.lr_decay_style,
        wsd_decay_steps=trainer.lr_wsd_decay_iters,
        wsd_decay_style=trainer.lr_wsd_decay_style,
    )
