"""Losses (docs/algorithms.md §5–§7; invariants §11.7, 9–12, 15–17) and the custom-loss interface."""

from __future__ import annotations

import math
import textwrap
from argparse import Namespace

import pytest
import torch

from miles.diffusion.losses import (
    NFT_METRICS,
    POLICY_LOSS_METRICS,
    LossInputs,
    call_custom_loss,
    forward_noise,
    kl_to_reference,
    load_custom_loss,
    nft_loss,
    nft_r_from_advantages,
    nft_train_sigmas,
    policy_loss,
    sample_sft_sigmas,
    sft_loss,
    window_reduce,
)
from miles.diffusion.schedules import flow_match_sigmas, sft_sigma_grid
from miles.diffusion.sde import DiffusersSdeStepBackend, build_sde_backend
from miles.utils.errors import MilesUserError

SIGMAS = flow_match_sigmas(10, shift=3.0)
SHAPE = (2, 4, 4)  # one latent (C, H, W)
EPS = 1e-4
CLIP_MAX = 5.0


class ToyVelocity(torch.nn.Module):
    """v_θ(x, σ) = a ⊙ x + b + σ·c: enough parameters for per-pair gradients to differ."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(0.3 * torch.randn(SHAPE))
        self.b = torch.nn.Parameter(torch.randn(SHAPE))
        self.c = torch.nn.Parameter(torch.randn(SHAPE))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.a * x + self.b + sigma.view(-1, 1, 1, 1) * self.c


def _grads(model: torch.nn.Module) -> torch.Tensor:
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads


def _rollout_pairs(model, backend, num_pairs: int):
    """Pairs (x_k, x_{k+1}, σ_k, σ_{k+1}) sampled with the model, with the engine's log-probs."""
    steps = torch.randint(0, 10, (num_pairs,))
    sigma, sigma_next = SIGMAS[steps], SIGMAS[steps + 1]
    x = torch.randn((num_pairs,) + SHAPE)
    generators = [torch.Generator().manual_seed(int(s)) for s in torch.randint(0, 2**31, (num_pairs,))]
    with torch.no_grad():
        out = backend.sample(x, model(x, sigma), sigma, sigma_next, SIGMAS[1], generators)
    return x, out.next_latents, sigma, sigma_next, out.log_prob


def _score(model, backend, x, x_next, sigma, sigma_next):
    return backend.log_prob(x, model(x, sigma), x_next, sigma, sigma_next, SIGMAS[1])


# -- §5 policy loss -----------------------------------------------------------------------------------------------


def test_train_rollout_alignment_metrics():
    model, backend = ToyVelocity(), DiffusersSdeStepBackend(0.7, False)
    x, x_next, sigma, sigma_next, rollout_log_prob = _rollout_pairs(model, backend, 6)
    new = _score(model, backend, x, x_next, sigma, sigma_next).log_prob
    assert (new - rollout_log_prob).abs().max().item() <= 1e-5
    _, metrics = policy_loss(new, rollout_log_prob, torch.randn(6), EPS, CLIP_MAX)
    assert set(metrics) == set(POLICY_LOSS_METRICS)
    assert metrics["clipfrac"].sum().item() == 0
    assert metrics["approx_kl"].max().item() <= 1e-10
    assert metrics["ratio_abs_minus_1"].max().item() <= 1e-5
    assert metrics["log_prob_mean_abs_diff"].max().item() <= 1e-5


@pytest.mark.parametrize("recompute", [False, True])
def test_first_step_gradient_is_advantage_weighted_log_prob_gradient(recompute):
    torch.manual_seed(0)
    model, backend = ToyVelocity(), DiffusersSdeStepBackend(0.7, False)
    x, x_next, sigma, sigma_next, _ = _rollout_pairs(model, backend, 5)
    advantages = torch.tensor([7.0, -0.5, 0.0, 2.0, -9.0])  # two beyond the clip
    new = _score(model, backend, x, x_next, sigma, sigma_next).log_prob
    # old == new in value: recompute mode detaches new; otherwise it is the same number computed separately
    old = new.detach() if recompute else new.detach().clone()
    loss, metrics = policy_loss(new, old, advantages, EPS, CLIP_MAX)
    assert torch.equal(metrics["ratio_abs_minus_1"], torch.zeros(5)), "ρ is exactly 1: a tie in torch.maximum"
    window_reduce(loss, 5).backward()
    autograd = _grads(model)
    new = _score(model, backend, x, x_next, sigma, sigma_next).log_prob
    (-(advantages.clamp(-CLIP_MAX, CLIP_MAX) * new).mean()).backward()
    closed_form = _grads(model)
    assert torch.allclose(autograd, closed_form, rtol=1e-5, atol=1e-7)
    assert closed_form.abs().sum() > 0


@pytest.mark.parametrize(
    "advantage,log_ratio,clipped",
    [
        (1.5, 3 * EPS, True),  # A > 0, ρ > 1 + ε: no gradient
        (-1.5, -3 * EPS, True),  # A < 0, ρ < 1 − ε: no gradient
        (1.5, -3 * EPS, False),  # A > 0, ρ < 1 − ε: still pushed up
        (-1.5, 3 * EPS, False),  # A < 0, ρ > 1 + ε: still pushed down
        (1.5, 0.3 * EPS, False),  # inside the trust region
        (-1.5, -0.3 * EPS, False),
    ],
)
def test_clipping_gradient(advantage, log_ratio, clipped):
    old = torch.randn(1, dtype=torch.float64).float()
    new = (old + log_ratio).clone().requires_grad_(True)
    adv = torch.tensor([advantage])
    loss, metrics = policy_loss(new, old, adv, EPS, CLIP_MAX)
    loss.sum().backward()
    ratio = torch.exp(new.detach() - old)
    expected = torch.zeros(1) if clipped else -adv * ratio
    assert torch.allclose(new.grad, expected, atol=1e-7)
    outside = abs(ratio.item() - 1) > EPS
    assert metrics["clipfrac"].item() == float(outside)
    assert metrics["clipfrac_gt_one"].item() == float(ratio.item() - 1 > EPS)
    assert metrics["clipfrac_lt_one"].item() == float(1 - ratio.item() > EPS)


def test_policy_loss_values_and_metrics_by_hand():
    new = torch.randn(8) * 1e-3
    old = torch.randn(8) * 1e-3
    adv = torch.randn(8) * 4
    kl = torch.rand(8)
    loss, m = policy_loss(new, old, adv, 1e-3, 3.0, kl=kl, kl_beta=0.04)
    a = adv.clamp(-3, 3)
    ratio = torch.exp(new - old)
    pg = torch.max(-a * ratio, -a * ratio.clamp(1 - 1e-3, 1 + 1e-3))
    assert torch.allclose(m["policy_loss"], pg) and torch.allclose(loss, pg + 0.04 * kl)
    assert torch.allclose(m["approx_kl"], 0.5 * (new - old) ** 2)
    assert torch.allclose(m["adv_abs_mean"], a.abs()) and torch.equal(m["kl_loss"], kl)
    assert torch.allclose(m["loss_abs_mean"], (pg + 0.04 * kl).abs())
    assert torch.allclose(m["log_prob_mean_abs_diff"], (new - old).abs())
    assert all(v.shape == (8,) and not v.requires_grad for v in m.values())
    with pytest.raises(MilesUserError, match="--diffusion-clip-range"):
        policy_loss(new, old, adv, 0.0, 3.0)
    with pytest.raises(ValueError):
        policy_loss(new, old, adv, 1e-3, 3.0, kl_beta=0.1)


# -- §5 KL ---------------------------------------------------------------------------------------------------------


def test_kl_zero_with_zero_gradient_when_policy_is_reference():
    model, backend = ToyVelocity(), DiffusersSdeStepBackend(0.7, False)
    x, x_next, sigma, sigma_next, _ = _rollout_pairs(model, backend, 4)
    out = _score(model, backend, x, x_next, sigma, sigma_next)
    with torch.no_grad():
        reference = _score(model, backend, x, x_next, sigma, sigma_next)
    kl = kl_to_reference(out.mean, reference.mean, out.diffusion_coef)
    assert torch.equal(kl, torch.zeros(4))
    kl.sum().backward()
    assert _grads(model).abs().max().item() == 0.0


def test_kl_closed_forms():
    eta = float(torch.empty(()).uniform_(0.3, 1.0))
    backend = DiffusersSdeStepBackend(eta, False)
    x, v, v_ref = torch.randn((3,) + SHAPE), torch.randn((3,) + SHAPE), torch.randn((3,) + SHAPE)
    sigma, sigma_next = SIGMAS[torch.tensor([1, 4, 8])], SIGMAS[torch.tensor([2, 5, 9])]
    mean, std, g = backend.mean_std(x, v, sigma, sigma_next, SIGMAS[1])
    ref_mean, _, _ = backend.mean_std(x, v_ref, sigma, sigma_next, SIGMAS[1])
    kl = kl_to_reference(mean, ref_mean, g)
    assert bool((kl >= 0).all())
    by_hand = ((mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * g**2)
    assert torch.allclose(kl, by_hand, rtol=1e-6)
    # 'sde': s² = g²h, so KL / h is the exact Gaussian KL, mean over elements
    h = sigma - sigma_next
    scale = std.view(-1, 1, 1, 1)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, scale), torch.distributions.Normal(ref_mean, scale)
    ).mean(dim=(1, 2, 3))
    assert torch.allclose(kl / h, exact, rtol=1e-4)
    # velocity form: μ_θ − μ_ref = −h(1 + g²(1−σ)/(2σ))(v_θ − v_ref)
    coef = (-h * (1 + g**2 * (1 - sigma) / (2 * sigma))).view(-1, 1, 1, 1)
    assert torch.allclose(mean - ref_mean, coef * (v - v_ref), atol=1e-5)


def test_kl_with_zero_diffusion_coefficient_is_excluded():
    mean = torch.randn((2,) + SHAPE, requires_grad=True)
    kl = kl_to_reference(mean, torch.randn((2,) + SHAPE), torch.tensor([0.0, 0.5]))
    assert kl[0].item() == 0.0 and kl[1].item() > 0
    kl.sum().backward()
    assert bool(torch.isfinite(mean.grad).all()) and mean.grad[0].abs().max().item() == 0.0


# -- §5 reduction --------------------------------------------------------------------------------------------------


def _policy_window_gradient(model, backend, batch, micro_batches, pairs_in_window: int, kl_beta=0.04):
    """Accumulate the window's gradient over `micro_batches` (lists of pair indices, any grouping)."""
    x, x_next, sigma, sigma_next, old, adv = batch
    for index in micro_batches:
        sl = torch.tensor(index)
        out = _score(model, backend, x[sl], x_next[sl], sigma[sl], sigma_next[sl])
        with torch.no_grad():
            ref_mean = backend.mean_std(x[sl], 0.9 * model(x[sl], sigma[sl]), sigma[sl], sigma_next[sl], SIGMAS[1])[0]
        kl = kl_to_reference(out.mean, ref_mean, out.diffusion_coef)
        loss, _ = policy_loss(out.log_prob, old[sl], adv[sl], 0.05, CLIP_MAX, kl=kl, kl_beta=kl_beta)
        window_reduce(loss, pairs_in_window).backward()
    return _grads(model)


def _flat(num_pairs: int, m: int) -> list[list[int]]:
    return [list(range(start, min(start + m, num_pairs))) for start in range(0, num_pairs, m)]


def test_micro_batch_and_data_parallel_invariance():
    model, backend = ToyVelocity(), DiffusersSdeStepBackend(0.7, False)
    num_pairs = 8
    x, x_next, sigma, sigma_next, old = _rollout_pairs(model, backend, num_pairs)
    with torch.no_grad():  # move the policy so ratios differ from 1 and some pairs clip
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = (x, x_next, sigma, sigma_next, old, torch.randn(num_pairs) * 3)
    grads = [_policy_window_gradient(model, backend, batch, _flat(num_pairs, m), num_pairs) for m in (1, 2, 4, 8)]
    # a 2-D tile (2 samples × 2 steps, pairs sample-major with 4 steps per sample) groups non-contiguous pairs
    tiles = [[0, 1, 4, 5], [2, 3, 6, 7]]
    grads.append(_policy_window_gradient(model, backend, batch, tiles, num_pairs))
    for g in grads[1:]:
        assert torch.allclose(g, grads[0], rtol=1e-5, atol=1e-7)
    # DP = 2, contiguous halves, each rank reduces over its own Q = 4 pairs; FSDP averages the two gradients
    halves = [tuple(t[r * 4 : (r + 1) * 4] for t in batch) for r in range(2)]
    dp = sum(_policy_window_gradient(model, backend, h, _flat(4, 2), 4) for h in halves) / 2
    assert torch.allclose(dp, grads[0], rtol=1e-5, atol=1e-7)


def test_window_reduce_sums_over_micro_batches():
    per_pair = torch.randn(12)
    whole = window_reduce(per_pair, 12)
    for m in (1, 3, 4, 6):
        parts = sum(window_reduce(chunk, 12) for chunk in per_pair.split(m))
        assert torch.allclose(parts, whole, atol=1e-6)
    assert torch.allclose(whole, per_pair.mean(), atol=1e-6)
    with pytest.raises(ValueError):
        window_reduce(per_pair, 0)


# -- §6 NFT --------------------------------------------------------------------------------------------------------


def test_nft_r_map():
    adv = torch.tensor([0.0, CLIP_MAX, 12.0, -CLIP_MAX, -30.0, 2.5])
    r = nft_r_from_advantages(adv, CLIP_MAX)
    assert r.tolist() == pytest.approx([0.5, 1.0, 1.0, 0.0, 0.0, 0.75])


def _nft_batch(num_pairs=4):
    x0, eps = torch.randn((num_pairs,) + SHAPE), torch.randn((num_pairs,) + SHAPE)
    sigma = SIGMAS[torch.randint(0, 9, (num_pairs,))]
    return x0, eps, sigma, forward_noise(x0, eps, sigma)


@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_branch_losses_by_hand(adaptive):
    x0, _, sigma, x_t = _nft_batch()
    v_theta, v_old = torch.randn((4,) + SHAPE), torch.randn((4,) + SHAPE)
    beta = float(torch.empty(()).uniform_(0.2, 2.0))
    adv = torch.randn(4) * 3
    loss, m = nft_loss(v_theta, v_old, x_t, x0, sigma, adv, beta, CLIP_MAX, adaptive_weight=adaptive)
    assert set(m) == set(NFT_METRICS)
    s = sigma.view(-1, 1, 1, 1)
    v_pos, v_neg = beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta
    assert torch.allclose(v_pos + v_neg, 2 * v_old, atol=1e-5)
    assert torch.allclose(v_pos - v_neg, 2 * beta * (v_theta - v_old), atol=1e-5)
    e_pos, e_neg = x_t - s * v_pos - x0, x_t - s * v_neg - x0
    w_pos = e_pos.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5) if adaptive else 1.0
    w_neg = e_neg.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5) if adaptive else 1.0
    l_pos = (e_pos**2).mean(dim=(1, 2, 3)) / w_pos
    l_neg = (e_neg**2).mean(dim=(1, 2, 3)) / w_neg
    r = (0.5 + 0.5 * adv.clamp(-CLIP_MAX, CLIP_MAX) / CLIP_MAX).clamp(0, 1)
    assert torch.allclose(m["nft_pos_loss"], l_pos, rtol=1e-5)
    assert torch.allclose(m["nft_neg_loss"], l_neg, rtol=1e-5)
    assert torch.allclose(loss, CLIP_MAX / beta * (r * l_pos + (1 - r) * l_neg), rtol=1e-5)
    assert torch.equal(m["nft_t_mean"], sigma) and torch.allclose(m["nft_r_mean"], r)


def test_nft_beta_one_positive_branch_is_the_policy():
    x0, _, sigma, x_t = _nft_batch()
    v_theta, v_old = torch.randn((4,) + SHAPE), torch.randn((4,) + SHAPE)
    _, m = nft_loss(v_theta, v_old, x_t, x0, sigma, torch.zeros(4), 1.0, CLIP_MAX, adaptive_weight=False)
    expected = ((x_t - sigma.view(-1, 1, 1, 1) * v_theta - x0) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(m["nft_pos_loss"], expected, rtol=1e-6)


def test_nft_adaptive_weights_carry_no_gradient():
    x0, _, sigma, x_t = _nft_batch()
    v_old = torch.randn((4,) + SHAPE)
    v_theta = torch.randn((4,) + SHAPE, requires_grad=True)
    adv = torch.randn(4)
    loss, _ = nft_loss(v_theta, v_old, x_t, x0, sigma, adv, 1.0, CLIP_MAX)
    loss.sum().backward()
    # closed form with w held constant: ∂/∂v_θ of (M/β)[r·mean(e⁺²)/w⁺ + (1−r)·mean(e⁻²)/w⁻], β = 1
    s = sigma.view(-1, 1, 1, 1)
    e_pos, e_neg = x_t - s * v_theta.detach() - x0, x_t - s * (2 * v_old - v_theta.detach()) - x0
    w_pos, w_neg = (e.abs().mean(dim=(1, 2, 3)).view(-1, 1, 1, 1) for e in (e_pos, e_neg))
    r = nft_r_from_advantages(adv, CLIP_MAX).view(-1, 1, 1, 1)
    numel = e_pos[0].numel()
    expected = CLIP_MAX * (r * (-2 * s * e_pos) / w_pos + (1 - r) * (2 * s * e_neg) / w_neg) / numel
    assert torch.allclose(v_theta.grad, expected, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("beta", [0.3, 1.0, 2.5])
def test_nft_gradient_at_old_policy_is_reward_signed_flow_matching(beta):
    model = ToyVelocity()
    x0, _, sigma, x_t = _nft_batch()
    adv = torch.tensor([0.0, 2.0, -4.0, 9.0])
    with torch.no_grad():
        v_old = model(x_t, sigma)
    loss, _ = nft_loss(model(x_t, sigma), v_old, x_t, x0, sigma, adv, beta, CLIP_MAX)
    loss[0].backward(retain_graph=True)
    neutral = _grads(model)
    loss[1:].sum().backward()
    autograd = _grads(model)
    # r = ½ at θ = θ_old: no gradient (up to the rounding of v^± = v_old for β ≠ 1)
    assert neutral.abs().max().item() <= 1e-5 * autograd.abs().max().item()
    v = model(x_t[1:], sigma[1:])
    error = x_t[1:] - sigma[1:].view(-1, 1, 1, 1) * v - x0[1:]
    weight = error.detach().abs().mean(dim=(1, 2, 3))
    r = nft_r_from_advantages(adv[1:], CLIP_MAX)
    (CLIP_MAX * (2 * r - 1) * (error**2).mean(dim=(1, 2, 3)) / weight).sum().backward()
    assert torch.allclose(autograd, _grads(model), rtol=1e-4, atol=1e-7)


def test_nft_micro_batch_invariance():
    model = ToyVelocity()
    x0, _, sigma, x_t = _nft_batch(6)
    adv = torch.randn(6) * 3
    with torch.no_grad():
        v_old = model(x_t, sigma) + 0.1 * torch.randn((6,) + SHAPE)
    results = []
    for m in (1, 2, 3, 6):
        for start in range(0, 6, m):
            sl = slice(start, start + m)
            loss, _ = nft_loss(model(x_t[sl], sigma[sl]), v_old[sl], x_t[sl], x0[sl], sigma[sl], adv[sl], 1.0, CLIP_MAX)
            window_reduce(loss, 6).backward()
        results.append(_grads(model))
    for g in results[1:]:
        assert torch.allclose(g, results[0], rtol=1e-5, atol=1e-7)


def test_nft_rejects_non_positive_beta():
    x0, _, sigma, x_t = _nft_batch()
    with pytest.raises(MilesUserError, match="--diffusion-nft-beta"):
        nft_loss(x0, x0, x_t, x0, sigma, torch.zeros(4), 0.0, CLIP_MAX)


def test_nft_train_sigmas():
    sigmas = flow_match_sigmas(10, shift=3.0)
    ordered = nft_train_sigmas(sigmas, 0.99, False, None)
    assert torch.equal(ordered, sigmas[:9]), "K = ⌊9.9⌋ = 9, descending, terminal 0 and smallest σ dropped"
    generator = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    shuffled = [nft_train_sigmas(sigmas, 0.99, True, generator) for _ in range(20)]
    for s in shuffled:
        assert torch.equal(s.sort(descending=True).values, sigmas[:9]), "a permutation of the K values"
        assert bool((s > 0).all())
    assert any(not torch.equal(s, ordered) for s in shuffled)
    assert nft_train_sigmas(sigmas, 0.5, False, None).shape == (5,)
    assert nft_train_sigmas(sigmas, 0.01, False, None).shape == (1,), "K = max(1, ⌊n·f⌋)"
    assert nft_train_sigmas(sigmas, 1.0, False, None).shape == (10,)
    assert nft_train_sigmas(flow_match_sigmas(100, 3.0), 0.29, False, None).shape == (29,)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(MilesUserError, match="--diffusion-nft-timestep-fraction"):
            nft_train_sigmas(sigmas, bad, False, None)
    with pytest.raises(ValueError):
        nft_train_sigmas(sigmas[:-1], 0.99, False, None)


# -- §7 SFT --------------------------------------------------------------------------------------------------------


def test_forward_noise_endpoints_and_interpolation():
    x0, eps = torch.randn((3,) + SHAPE), torch.randn((3,) + SHAPE)
    assert torch.equal(forward_noise(x0, eps, 0.0), x0)
    assert torch.equal(forward_noise(x0, eps, 1.0), eps)
    sigma = torch.rand(3)
    expected = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    assert torch.allclose(forward_noise(x0, eps, sigma), expected)


def test_sft_loss():
    x0, eps = torch.randn((3,) + SHAPE), torch.randn((3,) + SHAPE)
    loss, metrics = sft_loss(eps - x0, x0, eps)
    assert torch.equal(loss, torch.zeros(3))
    v = torch.randn((3,) + SHAPE, requires_grad=True)
    loss, metrics = sft_loss(v, x0, eps)
    assert torch.allclose(loss, ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3)))
    assert torch.equal(metrics["sft_loss"], loss.detach())
    loss.sum().backward()
    assert torch.allclose(v.grad, 2 * (v.detach() - (eps - x0)) / v[0].numel(), atol=1e-7)


def test_sft_sigmas_are_on_the_grid():
    grid = sft_sigma_grid(3.0)
    indices, sigmas = sample_sft_sigmas(grid, 500, torch.Generator().manual_seed(int(torch.randint(0, 99, ()))))
    assert bool(((indices >= 0) & (indices < 1000)).all())
    assert torch.equal(sigmas, grid[indices])
    assert bool(torch.isin(sigmas, grid).all())
    assert indices.unique().numel() > 300, "uniform over the indices"


# -- custom loss ---------------------------------------------------------------------------------------------------


def test_custom_loss_hook(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        textwrap.dedent(
            """
            def reinforce(args, inputs):
                loss = -inputs.advantages * inputs.new_log_prob * args.scale
                return loss, {"my_metric": loss.detach().abs(), "batch": 1.0}

            def wrong_shape(args, inputs):
                return inputs.new_log_prob.sum(), {}

            def not_a_tuple(args, inputs):
                return inputs.new_log_prob

            def one_arg(inputs):
                return None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_custom_loss("my_losses.reinforce")
    new_log_prob = torch.randn(4, requires_grad=True)
    inputs = LossInputs(advantages=torch.randn(4), new_log_prob=new_log_prob)
    loss, metrics = call_custom_loss(fn, Namespace(scale=2.0), inputs)
    assert torch.allclose(loss, -2.0 * inputs.advantages * new_log_prob)
    assert metrics["batch"].shape == (4,) and "loss" in metrics and "my_metric" in metrics
    window_reduce(loss, 4).backward()
    assert torch.allclose(new_log_prob.grad, -2.0 * inputs.advantages / 4)
    for name in ("wrong_shape", "not_a_tuple"):
        with pytest.raises(MilesUserError, match="--custom-loss-function-path"):
            call_custom_loss(load_custom_loss(f"my_losses.{name}"), Namespace(), inputs)
    with pytest.raises(MilesUserError, match="--custom-loss-function-path"):
        load_custom_loss("my_losses.one_arg")
    with pytest.raises(MilesUserError, match="--custom-loss-function-path"):
        load_custom_loss("my_losses.missing")


def test_cps_policy_loss_end_to_end_alignment():
    model, backend = ToyVelocity(), build_sde_backend("cps", 0.7, True)
    x, x_next, sigma, sigma_next, rollout_log_prob = _rollout_pairs(model, backend, 5)
    new = _score(model, backend, x, x_next, sigma, sigma_next).log_prob
    _, metrics = policy_loss(new, rollout_log_prob, torch.randn(5), EPS, CLIP_MAX)
    assert metrics["log_prob_mean_abs_diff"].max().item() <= 1e-5
    assert math.isfinite(new.sum().item())


def test_rollout_gradient_coefficients_give_the_clipped_loss_and_its_gradient_at_ratio_one():
    """With ρ = 1 on every pair (one window), Σ_b c_b·(pairs of b) is the mean clipped loss and Σ_b c_b·Σ_k ∇ℓ its
    gradient: compared with `policy_loss` on per-pair log-probs that carry a gradient."""
    from miles.diffusion.losses import rollout_gradient_coefficients

    advantages, pairs = torch.tensor([-7.0, 0.5, 2.0]), torch.tensor([2, 3, 1])
    coefficients = rollout_gradient_coefficients(advantages, pairs, adv_clip_max=5.0)
    torch.testing.assert_close(coefficients, torch.tensor([5.0, -0.5, -2.0]) / 6)
    log_prob = torch.randn(6, requires_grad=True)  # one per pair, sample-major
    per_pair_advantage = advantages.repeat_interleave(pairs)
    loss, _ = policy_loss(log_prob, log_prob.detach(), per_pair_advantage, 1e-4, 5.0)
    reduced = window_reduce(loss, 6)
    reduced.backward()
    torch.testing.assert_close(reduced.detach(), (coefficients * pairs).sum())
    torch.testing.assert_close(log_prob.grad, coefficients.repeat_interleave(pairs))
