"""Per-pair losses: Flow-GRPO policy loss (docs/algorithms.md §5), DiffusionNFT (§6), SFT flow matching (§7), and the
custom-loss interface (docs/losses.md).

Every loss returns `(per_pair_loss [B], metrics)` where each metric is a detached per-pair [B] tensor: the trainer
sums both over micro-batches and ranks and divides the metric sums by pair counts (§5 "Σtotal/Σcount"), and
backpropagates `window_reduce(per_pair_loss, Q)` = Σ over the micro-batch / Q so gradients do not depend on the
micro-batch shape. All arithmetic is fp32 (the NFT adaptive weight: fp64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from miles.diffusion.advantages import clip_advantages
from miles.diffusion.sde import batch_view, mean_over_non_batch, per_sample
from miles.utils.errors import MilesUserError

__all__ = [
    "POLICY_LOSS_METRICS",
    "NFT_METRICS",
    "policy_loss",
    "rollout_gradient_coefficients",
    "kl_to_reference",
    "nft_loss",
    "nft_r_from_advantages",
    "nft_train_sigmas",
    "sft_loss",
    "sample_sft_sigmas",
    "forward_noise",
    "window_reduce",
    "LossInputs",
    "load_custom_loss",
    "call_custom_loss",
]

POLICY_LOSS_METRICS = (
    "loss",
    "policy_loss",
    "kl_loss",
    "approx_kl",
    "clipfrac",
    "clipfrac_gt_one",
    "clipfrac_lt_one",
    "ratio_abs_minus_1",
    "adv_abs_mean",
    "loss_abs_mean",
    "log_prob_mean_abs_diff",
)
NFT_METRICS = ("loss", "nft_loss", "nft_pos_loss", "nft_neg_loss", "nft_r_mean", "nft_t_mean", "adv_abs_mean")
NFT_WEIGHT_FLOOR = 1e-5


def window_reduce(per_pair_loss: torch.Tensor, pairs_in_window: int) -> torch.Tensor:
    """The §5 reduction of one micro-batch: `Σ_{j∈mb} loss_j / Q`, Q = pairs in the optimizer window (per rank).

    Summing these over the window's micro-batches gives the window mean whatever the micro-batch size.
    """
    if pairs_in_window < 1:
        raise ValueError(f"pairs_in_window must be >= 1, got {pairs_in_window}")
    return per_pair_loss.sum() / pairs_in_window


# ---------------------------------------------------------------------------------------------------------------
# Flow-GRPO (§5)


def policy_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio loss per pair: `L_j = max(−A_c·ρ, −A_c·clamp(ρ, 1−ε, 1+ε)) + β·KL_j` (§5).

    ρ = exp(ℓ_new − ℓ_old); A_c = clamp(A, −M, M). `torch.maximum` keeps the full `−A_c∇ρ` at a tie (ρ = 1).
    With `--diffusion-recompute-old-log-prob`, window 0 passes `old_log_prob = new_log_prob.detach()`.
    Metrics are the per-pair values of every §5 metric (the trainer averages them over pairs).
    """
    if clip_range <= 0:
        raise MilesUserError(f"--diffusion-clip-range {clip_range}: must be > 0")
    new_log_prob = new_log_prob.to(torch.float32)
    old_log_prob = old_log_prob.detach().to(torch.float32)
    adv = clip_advantages(advantages.detach().to(device=new_log_prob.device, dtype=torch.float32), adv_clip_max)
    log_ratio = new_log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    pg_loss = torch.maximum(unclipped, clipped)
    if kl is not None:
        kl = kl.to(torch.float32)
        loss = pg_loss + kl_beta * kl
        kl_metric = kl.detach()
    else:
        if kl_beta != 0:
            raise ValueError("kl_beta != 0 needs the per-pair kl values")
        loss = pg_loss
        kl_metric = torch.zeros_like(pg_loss).detach()

    with torch.no_grad():
        ratio_d, log_ratio_d = ratio.detach(), log_ratio.detach()
        metrics = {
            "loss": loss.detach(),
            "policy_loss": pg_loss.detach(),
            "kl_loss": kl_metric,
            "approx_kl": 0.5 * log_ratio_d**2,
            "clipfrac": ((ratio_d - 1).abs() > clip_range).to(torch.float32),
            "clipfrac_gt_one": (ratio_d - 1 > clip_range).to(torch.float32),
            "clipfrac_lt_one": (1 - ratio_d > clip_range).to(torch.float32),
            "ratio_abs_minus_1": (ratio_d - 1).abs(),
            "adv_abs_mean": adv.abs(),
            "loss_abs_mean": loss.detach().abs(),
            "log_prob_mean_abs_diff": log_ratio_d.abs(),
        }
    return loss, metrics


def rollout_gradient_coefficients(advantages: torch.Tensor, pairs_per_sample: torch.Tensor,
                                  adv_clip_max: float) -> torch.Tensor:
    """c_b = −clip(A_b) / P, P = Σ pairs_per_sample: with one window and ρ = 1 on every pair, the gradient of the
    mean clipped loss is Σ_b c_b·Σ_k ∇ℓ_{b,k}, and the loss itself Σ_b c_b·(pairs of b)
    (`--diffusion-rollout-gradient`, docs/algorithms.md §5)."""
    total = float(pairs_per_sample.sum())
    return -clip_advantages(advantages.to(torch.float32), adv_clip_max) / max(total, 1.0)


def kl_to_reference(
    mean: torch.Tensor, ref_mean: torch.Tensor, diffusion_coef: torch.Tensor | float
) -> torch.Tensor:
    """`KL_j = mean_D[(μ_θ − μ_ref)²] / (2g²)` per pair (§5; g² as in flow_grpo, i.e. true KL × h for 'sde').

    `ref_mean` is a fixed target (detached). A pair with g = 0 (cps at σ' = 0, where the KL is undefined)
    contributes 0 with zero gradient: §2 excludes that step from the KL.
    """
    mean = mean.to(torch.float32)
    g = per_sample(diffusion_coef, mean.shape[0], mean.device)
    squared = mean_over_non_batch((mean - ref_mean.detach().to(torch.float32)) ** 2)
    defined = g > 0
    safe_g = torch.where(defined, g, torch.ones_like(g))
    return torch.where(defined, squared / (2 * safe_g**2), torch.zeros_like(squared))


# ---------------------------------------------------------------------------------------------------------------
# forward noising shared by NFT and SFT (§1)


def forward_noise(clean_latents: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """`x_σ = (1 − σ)·x0 + σ·ε` in fp32 (§1), σ a float or [B]."""
    x0 = clean_latents.to(torch.float32)
    sig = batch_view(per_sample(sigma, x0.shape[0], x0.device), x0)
    return (1 - sig) * x0 + sig * noise.to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# DiffusionNFT (§6)


def nft_r_from_advantages(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """`r = clamp(½ + ½·clamp(A, −M, M)/M, 0, 1)`: A = 0 ↦ ½, A ≥ M ↦ 1, A ≤ −M ↦ 0 (§6)."""
    adv = clip_advantages(advantages.to(torch.float32), adv_clip_max)
    return torch.clamp(0.5 + 0.5 * adv / adv_clip_max, 0.0, 1.0)


def _nft_branch_loss(x0_error: torch.Tensor, adaptive_weight: bool) -> torch.Tensor:
    """`L = mean_D[e²] / w` with `w = max(mean_D|e|, 1e-5)` in fp64 without gradient (or w = 1)."""
    squared = mean_over_non_batch(x0_error**2)
    if not adaptive_weight:
        return squared
    with torch.no_grad():
        weight = mean_over_non_batch(x0_error.detach().to(torch.float64).abs()).clamp(min=NFT_WEIGHT_FLOOR)
    return squared / weight.to(torch.float32)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    noised_latents: torch.Tensor,
    clean_latents: torch.Tensor,
    sigma: float | torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    adv_clip_max: float,
    adaptive_weight: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT per pair: `ℓ = (M/β)·[r·L⁺ + (1−r)·L⁻]` (§6).

    v⁺ = β·v_θ + (1−β)·v_old, v⁻ = (1+β)·v_old − β·v_θ; e^± = (x_t − σ·v^±) − x0; L^± per `_nft_branch_loss`.
    `v_old` is the no-grad reference (EMA) forward and is detached here.
    """
    if not beta > 0:
        raise MilesUserError(f"--diffusion-nft-beta {beta}: must be > 0")
    v_theta = v_theta.to(torch.float32)
    v_old = v_old.detach().to(torch.float32)
    x_t = noised_latents.detach().to(torch.float32)
    x0 = clean_latents.detach().to(torch.float32)
    sig_vec = per_sample(sigma, x0.shape[0], x0.device)
    sig = batch_view(sig_vec, x0)

    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    pos_loss = _nft_branch_loss(x_t - sig * v_pos - x0, adaptive_weight)
    neg_loss = _nft_branch_loss(x_t - sig * v_neg - x0, adaptive_weight)
    adv = advantages.detach().to(device=x0.device, dtype=torch.float32)
    r = nft_r_from_advantages(adv, adv_clip_max)
    loss = (adv_clip_max / beta) * (r * pos_loss + (1 - r) * neg_loss)

    metrics = {
        "loss": loss.detach(),
        "nft_loss": loss.detach(),
        "nft_pos_loss": pos_loss.detach(),
        "nft_neg_loss": neg_loss.detach(),
        "nft_r_mean": r,
        "nft_t_mean": sig_vec,
        "adv_abs_mean": adv.abs(),
    }
    return loss, metrics


def nft_train_sigmas(
    rollout_sigmas: torch.Tensor, fraction: float, shuffle: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """One sample's NFT training sigmas (§6, SPEC): the rollout grid without its terminal 0 (σ_0..σ_{n−1}), the
    first `K = max(1, ⌊n·f⌋)` of them (descending, so the smallest σ are dropped), then — with `shuffle` — a
    permutation drawn from `generator` (call once per sample for independent orders)."""
    if not 0 < fraction <= 1:
        raise MilesUserError(f"--diffusion-nft-timestep-fraction {fraction}: must be in (0, 1]")
    sigmas = rollout_sigmas.detach().reshape(-1)
    if sigmas.numel() < 2 or sigmas[-1].item() != 0:
        raise ValueError("rollout_sigmas must be the n + 1 rollout sigmas ending with the terminal 0")
    num_steps = sigmas.numel() - 1
    keep = max(1, math.floor(num_steps * fraction + 1e-9))  # 1e-9: 100 × 0.29 must give 29, not 28
    selected = sigmas[:keep]
    if shuffle:
        order = torch.randperm(keep, generator=generator)
        selected = selected[order.to(selected.device)]
    return selected.clone()


# ---------------------------------------------------------------------------------------------------------------
# SFT (§7)


def sample_sft_sigmas(
    sigma_grid: torch.Tensor, num_pairs: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `index ~ UniformInt[0, N)` per pair; returns (indices [num_pairs], sigmas [num_pairs]) on the grid (§7)."""
    indices = torch.randint(0, sigma_grid.numel(), (num_pairs,), generator=generator)
    return indices, sigma_grid.reshape(-1)[indices.to(sigma_grid.device)]


def sft_loss(
    v_theta: torch.Tensor, clean_latents: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow matching per pair: `ℓ = mean_D[(v_θ − (ε − x0))²]` in fp32 (§7). `v_theta` is the forward at
    `forward_noise(x0, ε, σ)`."""
    target = noise.detach().to(torch.float32) - clean_latents.detach().to(torch.float32)
    loss = mean_over_non_batch((v_theta.to(torch.float32) - target) ** 2)
    return loss, {"loss": loss.detach(), "sft_loss": loss.detach()}


# ---------------------------------------------------------------------------------------------------------------
# custom losses (`--custom-loss-function-path`, docs/losses.md)


@dataclass
class LossInputs:
    """Everything the trainer knows about one micro-batch of B train pairs, for a custom loss.

    Tensors with a leading B axis; latent-shaped ones are fp32. Fields the trainer did not compute are None.
    RL pairs (policy-style forward): `latents` = x_k, `next_latents` = x_{k+1}, `sigma`/`sigma_next`,
    `new_log_prob` (with gradient), `old_log_prob`, `rollout_log_prob`, `mean` (μ_θ, with gradient),
    `std`, `diffusion_coef`, `velocity` (v_θ, with gradient), `ref_mean` / `ref_velocity` when a reference
    forward ran (`--ref-mode`). `advantages` are raw (unclipped).
    """

    advantages: torch.Tensor
    new_log_prob: torch.Tensor | None = None
    old_log_prob: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    ref_mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    diffusion_coef: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    next_latents: torch.Tensor | None = None
    clean_latents: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    sigma: torch.Tensor | None = None
    sigma_next: torch.Tensor | None = None
    sample_indices: torch.Tensor | None = None
    step_indices: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.advantages.shape[0])


CUSTOM_LOSS_FLAG = "--custom-loss-function-path"


def load_custom_loss(path: str) -> Callable[[Any, LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Load and signature-check `fn(args, inputs: LossInputs) -> (per-pair loss [B], metrics)`."""
    from miles.utils.imports import load_function

    return load_function(path, CUSTOM_LOSS_FLAG, required_params=2)


def call_custom_loss(
    fn: Callable, args: Any, inputs: LossInputs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call a custom loss and check its result: a [B] loss tensor and a dict of [B] (or scalar) metrics."""
    result = fn(args, inputs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise MilesUserError(f"{CUSTOM_LOSS_FLAG}: the loss must return (per_pair_loss, metrics), got {type(result)}")
    loss, metrics = result
    batch = inputs.batch_size
    if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != (batch,):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise MilesUserError(f"{CUSTOM_LOSS_FLAG}: per_pair_loss must be a tensor of shape [{batch}], got {shape}")
    if not isinstance(metrics, dict):
        raise MilesUserError(f"{CUSTOM_LOSS_FLAG}: metrics must be a dict, got {type(metrics).__name__}")
    checked: dict[str, torch.Tensor] = {}
    for name, value in metrics.items():
        value = torch.as_tensor(value, dtype=torch.float32).detach()
        if value.ndim == 0:
            value = value.expand(batch).to(loss.device)
        if tuple(value.shape) != (batch,):
            raise MilesUserError(f"{CUSTOM_LOSS_FLAG}: metric {name!r} must be a scalar or have shape [{batch}]")
        checked[str(name)] = value
    checked.setdefault("loss", loss.detach())
    return loss, checked
