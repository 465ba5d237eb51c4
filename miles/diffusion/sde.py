"""One reverse denoising step with its Gaussian log-prob (docs/algorithms.md §2).

The engine calls `SdeStepBackend.sample` (SAMPLE mode: draw ε from each sample's generator, x' = μ + s·ε, ℓ from
ε), the trainer calls `SdeStepBackend.log_prob` (SCORE mode: ℓ of a recorded x' under a new velocity; the
gradient reaches the velocity through μ). Both go through the same `mean_std`, in fp32, which is what keeps the
train-side log-prob equal to the rollout's.

Sigma arguments are Python floats or tensors of shape [B] (one per sample); `per_sample` is the one place that
turns them into fp32 [B] vectors and views them over the latent's non-batch axes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from miles.utils.errors import MilesUserError

__all__ = [
    "StepOutput",
    "SdeStepBackend",
    "DiffusersSdeStepBackend",
    "CpsSdeStepBackend",
    "SDE_TYPES",
    "build_sde_backend",
    "use_no_const_log_prob",
    "ode_step",
    "per_sample",
    "batch_view",
    "mean_over_non_batch",
    "gaussian_log_prob",
    "gaussian_log_prob_from_noise",
    "draw_step_noise",
]

SDE_TYPES = ("sde", "cps", "ode")
SIGMA_ONE_TOLERANCE = 1e-6  # §2: a step starts at σ = 1 iff |σ − 1| < 1e-6, on both sides
HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


# ---------------------------------------------------------------------------------------------------------------
# broadcasting and reductions


def per_sample(value: float | torch.Tensor, batch_size: int, device: torch.device | str) -> torch.Tensor:
    """A float, a 0-d tensor or a [B] tensor as an fp32 [B] vector on `device`."""
    if isinstance(value, torch.Tensor):
        vector = value.detach().to(device=device, dtype=torch.float32)
        if vector.ndim == 0:
            return vector.expand(batch_size).clone()
        if vector.shape != (batch_size,):
            raise ValueError(f"expected a per-sample tensor of shape [{batch_size}], got {tuple(vector.shape)}")
        return vector
    return torch.full((batch_size,), float(value), dtype=torch.float32, device=device)


def batch_view(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View a [B] vector as [B, 1, ..., 1] so it broadcasts over `like`'s non-batch axes."""
    return vector.reshape((vector.shape[0],) + (1,) * (like.ndim - 1))


def mean_over_non_batch(values: torch.Tensor) -> torch.Tensor:
    """`mean_D`: the mean over every non-batch axis (§2: a mean, never a sum) -> [B].

    Each sample is reduced on its own: a row reduction over a [B, D] tensor may split its sum differently with
    the number of rows (CUDA picks the block layout from the output count, CPU splits work across threads),
    and the engine (a step's whole batch) and the trainer (a micro-batch) must get the same ℓ bit for bit."""
    rows = values.reshape(values.shape[0], -1)
    return torch.stack([row.mean() for row in rows])


def gaussian_log_prob(
    next_latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, no_const: bool
) -> torch.Tensor:
    """ℓ of x' under N(μ, s²I), reduced by `mean_D` (§2). `std` is [B].

    full: `mean_D[−(x'−μ)²/(2s²)] − log s − ½log2π`; no-const: `mean_D[−(x'−μ)²]` (no 1/(2s²) factor).
    """
    squared = (next_latents.detach().to(torch.float32) - mean) ** 2
    if no_const:
        return -mean_over_non_batch(squared)
    std_b = batch_view(std, squared)
    return mean_over_non_batch(-squared / (2 * std_b**2)) - torch.log(std) - HALF_LOG_TWO_PI


def gaussian_log_prob_from_noise(noise: torch.Tensor, std: torch.Tensor, no_const: bool) -> torch.Tensor:
    """ℓ of x' = μ + s·ε computed from ε directly (the engine's form, §2); equals `gaussian_log_prob` of x'."""
    std_b = batch_view(std, noise)
    if no_const:
        return -mean_over_non_batch((std_b * noise) ** 2)
    return mean_over_non_batch(-(noise**2) / 2) - torch.log(std) - HALF_LOG_TWO_PI


def draw_step_noise(
    generators: list[torch.Generator], shape: torch.Size, device: torch.device | str
) -> torch.Tensor:
    """ε for a batch: sample b's noise comes from `generators[b]` with that sample's full latent shape (§2).

    Drawing per sample (not one batched draw) is what makes a sample's noise independent of which other samples
    share its forward batch.
    """
    if len(generators) != shape[0]:
        raise ValueError(f"need one generator per sample: got {len(generators)} for a batch of {shape[0]}")
    draws = [torch.randn(tuple(shape[1:]), generator=g, device=g.device, dtype=torch.float32) for g in generators]
    return torch.stack(draws).to(device)


def ode_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> torch.Tensor:
    """The Euler step `x' = x + (σ' − σ)·v` in fp32 (§1). Matches diffusers' FlowMatchEuler `step`."""
    x = latents.to(torch.float32)
    batch = x.shape[0]
    sigma_v = per_sample(sigma, batch, x.device)
    sigma_next_v = per_sample(sigma_next, batch, x.device)
    return x + batch_view(sigma_next_v - sigma_v, x) * velocity.to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# the backends


@dataclass
class StepOutput:
    """One step's result. `next_latents` is x' in SAMPLE mode and None in SCORE mode. `log_prob`, `std` (s) and
    `diffusion_coef` (g, the KL denominator of §5) are [B]; `mean` (μ) has the latent's shape. All fp32."""

    next_latents: torch.Tensor | None
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    diffusion_coef: torch.Tensor


class SdeStepBackend(ABC):
    """A Gaussian transition kernel x' ~ N(μ(x, v, σ, σ'), s²I) and its log-prob (§2).

    A subclass implements `mean_std` and sets `kind` (a short name used in logs and errors). `sample` and
    `log_prob` are built on `mean_std` and normally need no override. `std` and `diffusion_coef` must not depend
    on the model (they are constants of the step); `mean` must stay differentiable in `velocity`.
    See docs/sde-backends.md.
    """

    kind: str = "custom"

    def __init__(self, noise_level: float, log_prob_no_const: bool):
        self.noise_level = float(noise_level)
        self.log_prob_no_const = bool(log_prob_no_const)

    @abstractmethod
    def mean_std(
        self,
        latents: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        sigma_1: float | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(μ with the latent's shape, s [B], g [B]), all fp32."""

    def sample(
        self,
        latents: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        sigma_1: float | torch.Tensor,
        generators: list[torch.Generator],
    ) -> StepOutput:
        """SAMPLE mode (engine): x' = μ + s·ε with ε_b from `generators[b]`.

        ℓ is computed from (x' − μ) by the very function SCORE mode uses, not from ε (§2 allows either; they
        agree to ~1e-7): the trainer, replaying the same velocity, then reproduces the rollout's ℓ to the last
        bit, which is what makes the `--debug-skip-optimizer-step` alignment probe read exactly 0."""
        mean, std, diffusion_coef = self.mean_std(latents, velocity, sigma, sigma_next, sigma_1)
        noise = draw_step_noise(generators, mean.shape, mean.device)
        next_latents = mean + batch_view(std, mean) * noise
        log_prob = gaussian_log_prob(next_latents, mean, std, self.log_prob_no_const)
        return StepOutput(next_latents, log_prob, mean, std, diffusion_coef)

    def log_prob(
        self,
        latents: torch.Tensor,
        velocity: torch.Tensor,
        next_latents: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        sigma_1: float | torch.Tensor,
    ) -> StepOutput:
        """SCORE mode (trainer): ℓ of the recorded x' (a constant) under this velocity's μ (§2)."""
        mean, std, diffusion_coef = self.mean_std(latents, velocity, sigma, sigma_next, sigma_1)
        log_prob = gaussian_log_prob(next_latents, mean, std, self.log_prob_no_const)
        return StepOutput(None, log_prob, mean, std, diffusion_coef)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self.kind!r}, noise_level={self.noise_level}, "
            f"log_prob_no_const={self.log_prob_no_const})"
        )


def _step_vectors(latents, sigma, sigma_next):
    """fp32 x plus the [B] sigma vectors of one step."""
    x = latents.to(torch.float32)
    batch = x.shape[0]
    return x, per_sample(sigma, batch, x.device), per_sample(sigma_next, batch, x.device)


class DiffusersSdeStepBackend(SdeStepBackend):
    """The Flow-GRPO SDE (`kind="sde"`) or the deterministic Euler step (`kind="ode"`) over diffusers sigmas (§2).

    'sde': g = η·sqrt(σ/(1−σ̃)) with σ̃ = σ_1 when |σ−1| < 1e-6 (only the denominator changes), s = g·sqrt(h),
    μ = x + dt·[v + (g²/2σ)(x + (1−σ)v)] with dt = σ' − σ = −h.
    'ode': μ = x + dt·v, s = g = 0, x' = μ and ℓ ≡ 0; no noise is drawn.
    """

    def __init__(self, noise_level: float, log_prob_no_const: bool, kind: str = "sde"):
        if kind not in ("sde", "ode"):
            raise ValueError(f"DiffusersSdeStepBackend kind must be 'sde' or 'ode', got {kind!r}")
        super().__init__(noise_level, log_prob_no_const)
        self.kind = kind

    def mean_std(self, latents, velocity, sigma, sigma_next, sigma_1):
        x, sig, sig_next = _step_vectors(latents, sigma, sigma_next)
        v = velocity.to(torch.float32)
        dt = sig_next - sig
        if self.kind == "ode":
            zeros = torch.zeros_like(sig)
            return x + batch_view(dt, x) * v, zeros, zeros.clone()
        sig_1 = per_sample(sigma_1, x.shape[0], x.device)
        at_one = (sig - 1).abs() < SIGMA_ONE_TOLERANCE
        denominator_sigma = torch.where(at_one, sig_1, sig)
        g = self.noise_level * torch.sqrt(sig / (1 - denominator_sigma))
        std = g * torch.sqrt(-dt)
        half_g2_over_sigma = g**2 / (2 * sig)
        x_coef = 1 + half_g2_over_sigma * dt
        v_coef = (1 + half_g2_over_sigma * (1 - sig)) * dt
        mean = x * batch_view(x_coef, x) + v * batch_view(v_coef, x)
        return mean, std, g

    def sample(self, latents, velocity, sigma, sigma_next, sigma_1, generators):
        if self.kind != "ode":
            return super().sample(latents, velocity, sigma, sigma_next, sigma_1, generators)
        mean, std, g = self.mean_std(latents, velocity, sigma, sigma_next, sigma_1)
        return StepOutput(mean.clone(), torch.zeros_like(std), mean, std, g)

    def log_prob(self, latents, velocity, next_latents, sigma, sigma_next, sigma_1):
        if self.kind != "ode":
            return super().log_prob(latents, velocity, next_latents, sigma, sigma_next, sigma_1)
        mean, std, g = self.mean_std(latents, velocity, sigma, sigma_next, sigma_1)
        return StepOutput(None, torch.zeros_like(std), mean, std, g)


class CpsSdeStepBackend(SdeStepBackend):
    """Coefficients-Preserving Sampling (§2, arXiv 2509.05952): g = s = σ'·sin(ηπ/2),
    μ = (1−σ')·x̂0 + sqrt(max(σ'² − s², 0))·ε̂ with x̂0 = x − σv, ε̂ = x + (1−σ)v. At σ' = 0: x' = x̂0."""

    kind = "cps"

    def mean_std(self, latents, velocity, sigma, sigma_next, sigma_1):
        x, sig, sig_next = _step_vectors(latents, sigma, sigma_next)
        v = velocity.to(torch.float32)
        std = sig_next * math.sin(self.noise_level * math.pi / 2)
        noise_coef = torch.sqrt(torch.clamp(sig_next**2 - std**2, min=0.0))  # SPEC: clamp at 0, not 1e-12
        x0_hat = x - batch_view(sig, x) * v
        eps_hat = x + batch_view(1 - sig, x) * v
        mean = batch_view(1 - sig_next, x) * x0_hat + batch_view(noise_coef, x) * eps_hat
        return mean, std, std.clone()


def use_no_const_log_prob(sde_type: str, flag: bool) -> bool:
    """The one rule shared by engine and trainer (§2): no-const if the kind is cps or ode, or if the flag is set."""
    return bool(flag) or sde_type in ("cps", "ode")


def build_sde_backend(
    sde_type: str, noise_level: float, log_prob_no_const: bool, backend_path: str | None = None
) -> SdeStepBackend:
    """The backend for `--diffusion-sde-type`, or the user's `--sde-step-backend-path` subclass (§2).

    The log-prob form follows `use_no_const_log_prob(sde_type, log_prob_no_const)` for every backend.
    """
    if sde_type not in SDE_TYPES:
        raise MilesUserError(f"--diffusion-sde-type {sde_type!r}: expected one of {', '.join(SDE_TYPES)}")
    if noise_level < 0 or not math.isfinite(noise_level):
        raise MilesUserError(f"--diffusion-noise-level {noise_level}: must be a finite value >= 0")
    no_const = use_no_const_log_prob(sde_type, log_prob_no_const)
    if backend_path:
        from miles.utils.imports import load_object

        cls = load_object(backend_path, "--sde-step-backend-path")
        if not (isinstance(cls, type) and issubclass(cls, SdeStepBackend)):
            raise MilesUserError(
                f"--sde-step-backend-path {backend_path!r}: expected a subclass of "
                f"miles.diffusion.sde.SdeStepBackend, got {cls!r}"
            )
        try:
            return cls(noise_level, no_const)
        except TypeError as err:
            raise MilesUserError(
                f"--sde-step-backend-path {backend_path!r}: the class must accept "
                f"(noise_level, log_prob_no_const): {err}"
            ) from err
    if sde_type == "cps":
        return CpsSdeStepBackend(noise_level, no_const)
    return DiffusersSdeStepBackend(noise_level, no_const, kind=sde_type)
