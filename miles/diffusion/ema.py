"""EMA of the trainable parameters, used as π_old (docs/algorithms.md §8; DiffusionNFT arXiv 2509.16117).

The shadow θ̄ is an fp32 copy of each tracked parameter on that parameter's device (for an FSDP2 DTensor
parameter: the local shard, so nothing here communicates). Update k: `θ̄ ← δ_k·θ̄ + (1 − δ_k)·θ` with
`δ_k = init if k ≤ F else min((k − F)·ramp, max)`. Swapping moves values without arithmetic: the live values come
back bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from miles.utils.errors import MilesUserError

__all__ = ["EMA"]


class EMA:
    """Shadow copy of `named_params` with the §8 decay schedule and exact swap in/out."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        decay_init: float = 0.001,
        decay_ramp: float = 0.001,
        decay_max: float = 0.5,
        flat_steps: int = 0,
    ):
        for flag, value in (
            ("--ema-decay-init", decay_init),
            ("--ema-decay-ramp", decay_ramp),
            ("--ema-decay-max", decay_max),
        ):
            if not 0.0 <= value <= 1.0:
                raise MilesUserError(f"{flag} {value}: must be in [0, 1]")
        if flat_steps < 0:
            raise MilesUserError(f"--ema-decay-flat-steps {flat_steps}: must be >= 0")
        self.decay_init = float(decay_init)
        self.decay_ramp = float(decay_ramp)
        self.decay_max = float(decay_max)
        self.flat_steps = int(flat_steps)
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, param in named_params:
            if name in self._params:
                raise ValueError(f"EMA: parameter {name!r} given twice")
            self._params[name] = param
        if not self._params:
            raise ValueError("EMA: no parameters to track (are any parameters trainable?)")
        with torch.no_grad():
            self._shadow = {name: p.detach().clone().to(torch.float32) for name, p in self._params.items()}
        self._num_updates = 0
        # while swapped in: names whose shadow holds the live values (same dtype: a plain exchange), and a backup
        # of the live values of the others (the shadow cast into a lower-precision parameter is not invertible)
        self._swapped = False
        self._exchanged: set[str] = set()
        self._live_backup: dict[str, torch.Tensor] = {}

    # -- schedule ---------------------------------------------------------------------------------------------

    def decay(self, k: int) -> float:
        """δ_k (§8): `init` for k ≤ F, then `min((k − F)·ramp, max)` (the ramp restarts from 0)."""
        if k <= self.flat_steps:
            return self.decay_init
        return min((k - self.flat_steps) * self.decay_ramp, self.decay_max)

    @property
    def num_updates(self) -> int:
        return self._num_updates

    @property
    def is_swapped(self) -> bool:
        return self._swapped

    @torch.no_grad()
    def update(self) -> float:
        """One EMA update (k += 1); returns the δ used. Refused while the shadow is swapped in."""
        if self._swapped:
            raise RuntimeError("EMA.update() while the EMA weights are swapped in; call swap_out() first")
        self._num_updates += 1
        delta = self.decay(self._num_updates)
        for name, param in self._params.items():
            shadow = self._shadow[name]
            shadow.mul_(delta).add_(param.detach().to(device=shadow.device, dtype=torch.float32), alpha=1.0 - delta)
        return delta

    # -- swapping ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put θ̄ into the live parameters (for a reference forward or a weight push)."""
        if self._swapped:
            raise RuntimeError("EMA.swap_in() while already swapped in")
        for name, param in self._params.items():
            live = param.detach()
            shadow = self._shadow[name]
            if live.dtype == shadow.dtype:
                held = live.clone()
                live.copy_(shadow)
                shadow.copy_(held)
                self._exchanged.add(name)
            else:
                self._live_backup[name] = live.clone()
                live.copy_(shadow)
        self._swapped = True

    @torch.no_grad()
    def swap_out(self) -> None:
        """Restore the live parameters bit for bit (and θ̄ into the shadow)."""
        if not self._swapped:
            raise RuntimeError("EMA.swap_out() without a matching swap_in()")
        for name, param in self._params.items():
            live = param.detach()
            if name in self._exchanged:
                shadow = self._shadow[name]
                held = live.clone()
                live.copy_(shadow)
                shadow.copy_(held)
            else:
                live.copy_(self._live_backup.pop(name))
        self._exchanged.clear()
        self._swapped = False

    @contextlib.contextmanager
    def swapped(self) -> Iterator[EMA]:
        """`with ema.swapped(): ...` runs with θ̄ in the live parameters and always swaps back."""
        self.swap_in()
        try:
            yield self
        finally:
            self.swap_out()

    @torch.no_grad()
    def to(self, device: torch.device | str) -> EMA:
        """Move the shadow (e.g. to the CPU while a colocated trainer is offloaded); refused while swapped in."""
        if self._swapped:
            raise RuntimeError("EMA.to() while swapped in")
        self._shadow = {name: t.to(device) for name, t in self._shadow.items()}
        return self

    # -- access and checkpoints -------------------------------------------------------------------------------

    def shadow_tensors(self) -> dict[str, torch.Tensor]:
        """name -> θ̄ (fp32, live tensors: do not modify). Correct while swapped in too."""
        return {
            name: (self._params[name].detach() if name in self._exchanged else shadow)
            for name, shadow in self._shadow.items()
        }

    def state_dict(self) -> dict:
        """θ̄ and k (§8 SPEC: both are checkpointed)."""
        return {
            "num_updates": self._num_updates,
            "shadow": {name: t.detach().clone() for name, t in self.shadow_tensors().items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self._swapped:
            raise RuntimeError("EMA.load_state_dict() while swapped in")
        shadow_state = state["shadow"]
        if set(shadow_state) != set(self._shadow):
            missing = sorted(set(self._shadow) - set(shadow_state))[:5]
            unexpected = sorted(set(shadow_state) - set(self._shadow))[:5]
            raise MilesUserError(
                f"EMA checkpoint does not match the tracked parameters (missing {missing}, unexpected {unexpected}); "
                "was it saved with the same --use-lora setting and model?"
            )
        for name, tensor in shadow_state.items():
            if tuple(tensor.shape) != tuple(self._shadow[name].shape):
                raise MilesUserError(
                    f"EMA checkpoint: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(self._shadow[name].shape)}"
                )
            self._shadow[name].copy_(tensor)
        self._num_updates = int(state["num_updates"])
