"""The messages that travel between the parts: guidance settings, samples and train pairs.

Wire formats (HTTP bodies, Ray object refs) convert to and from these in one place each
(`miles/engine/protocol.py` for the engine protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass(frozen=True)
class GuidanceConfig:
    """Classifier-free guidance settings (docs/algorithms.md §1, CFG)."""

    guidance_scale: float = 4.0
    guidance_scale_2: float | None = None  # Wan2.2 low-noise expert
    true_cfg_scale: float | None = None  # Qwen-Image true CFG (per-token renormalisation)

    @property
    def scale(self) -> float:
        return self.true_cfg_scale if self.true_cfg_scale is not None else self.guidance_scale

    @property
    def do_cfg(self) -> bool:
        return self.scale > 1.0 or (self.guidance_scale_2 is not None and self.guidance_scale_2 > 1.0)


@dataclass
class Sample:
    """One generated image or video with its trajectory, reward and advantage.

    `latents` maps a denoising step index k to x_k (no batch axis); the engine returns x_k for every
    k in S ∪ (S + 1), where S = `sde_step_indices`. `sigmas` has n + 1 entries (terminal 0),
    `timesteps` n entries, in the family's DiT timestep units. `rollout_log_probs[j]` belongs to
    step `sde_step_indices[j]`. `conditioning` holds the tensors the trainer needs to replay the DiT
    forward (prompt embeddings, negative embeddings, masks), each without a batch axis.
    """

    prompt: str
    index: int = 0  # position in the rollout batch (group-contiguous)
    group_index: int = 0  # monotone prompt-group counter across the run
    metadata: dict[str, Any] = field(default_factory=dict)
    input_image: str | None = None  # the prompt row's input image (an absolute path), for image-conditioned families
    seed: int = 0
    image: torch.Tensor | None = None  # uint8 [F, H, W, 3]
    sde_step_indices: list[int] = field(default_factory=list)
    latents: dict[int, torch.Tensor] = field(default_factory=dict)
    sigmas: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    clean_latents: torch.Tensor | None = None  # x0: the rollout's final latent x_n (NFT) or an encoded image (SFT)
    debug_model_outputs: dict[int, torch.Tensor] | None = None  # step k -> combined velocity (debug mode)
    reward: float | dict[str, float] | None = None
    advantage: float = 0.0
    remove_sample: bool = False  # set by --rollout-sample-filter-path: counts for statistics, no loss
    weight_version: int = 0
    engine_url: str | None = None

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else int(self.timesteps.shape[0])

    def to_record(self) -> dict[str, Any]:
        """The sample as a dict of plain values and tensors: what files store (`torch.load(weights_only=True)`
        reads it back; a pickled `Sample` would need the unsafe loader)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_record(cls, record: Any, where: str) -> "Sample":
        """Inverse of `to_record`; `where` (file and position) names a malformed record in the error."""
        from miles.utils.errors import MilesUserError

        if not isinstance(record, dict):
            raise MilesUserError(f"{where}: expected a sample record (a dict), got {type(record).__name__}")
        unknown = sorted(set(record) - {f.name for f in fields(cls)})
        if unknown or "prompt" not in record:
            raise MilesUserError(f"{where}: not a Sample record (unknown keys {unknown}, prompt present: "
                                 f"{'prompt' in record})")
        return cls(**record)


@dataclass
class TrainPair:
    """One trained transition, the unit the trainer batches (docs/design.md §5).

    RL (policy_loss): (x_k, x_{k+1}) with sigmas, old log-prob and advantage.
    NFT / SFT: `latents` holds the clean x0 and `sigma` the noise level to train at; `next_latents` is None.
    """

    sample_index: int
    step_index: int
    latents: torch.Tensor
    next_latents: torch.Tensor | None
    sigma: float
    sigma_next: float
    sigma_1: float  # the schedule's second sigma (the 'sde' kind's sigma = 1 rule, docs/algorithms.md §2)
    timestep: float  # the DiT's time input for this step, in the family's convention
    advantage: float = 0.0
    old_log_prob: float = 0.0
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_mask: float = 1.0
    debug_model_output: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyGradientAsk:
    """`--diffusion-rollout-gradient`: what the trainer asks the engines for after a rollout. Per engine URL, the
    coefficients c_b = −clip(A_b)/P of the samples it served, by seed (docs/algorithms.md §5); `samples`: how many
    the rollout kept, every one of which some engine must hold."""

    coefficients: dict[str, dict[int, float]]
    samples: int

    @property
    def engines(self) -> list[str]:
        """The URLs of the engines that served some of the rollout's samples (the ones asked)."""
        return [url for url, coefficients in self.coefficients.items() if coefficients]
