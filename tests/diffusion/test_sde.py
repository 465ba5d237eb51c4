"""SDE step kinds and log-probs (docs/algorithms.md §2; invariants §11.2–6, 8)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from miles.diffusion.schedules import flow_match_sigmas
from miles.diffusion.sde import (
    CpsSdeStepBackend,
    DiffusersSdeStepBackend,
    SdeStepBackend,
    build_sde_backend,
    gaussian_log_prob,
    gaussian_log_prob_from_noise,
    ode_step,
    per_sample,
    use_no_const_log_prob,
)
from miles.utils.errors import MilesUserError

SD35 = flow_match_sigmas(10, shift=3.0)
SD35_STD_ETA07 = [0.7, 0.74296, 0.53615, 0.4459, 0.39179, 0.3528, 0.31907, 0.28201, 0.22536, 0.00628]
SHAPE = (3, 4, 6, 6)


def _pair(shape=SHAPE):
    return torch.randn(shape), torch.randn(shape)


def _step(k: int):
    return SD35[k].item(), SD35[k + 1].item(), SD35[1].item()


def _gens(batch: int, base: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + b) for b in range(batch)]


# -- invariant 2: ODE / Euler -----------------------------------------------------------------------------------


def test_ode_step_is_euler_bitwise():
    x, v = _pair()
    for k in range(10):
        sigma, sigma_next = SD35[k], SD35[k + 1]
        expected = x + (sigma_next - sigma) * v
        assert torch.equal(ode_step(x, v, sigma.item(), sigma_next.item()), expected)
        assert torch.equal(ode_step(x, v, sigma.expand(3), sigma_next.expand(3)), expected)


def test_ode_step_matches_diffusers_scheduler_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    x_ours, v_model = _pair((2, 4, 8, 8))
    x_diffusers = x_ours.clone()
    for k, t in enumerate(scheduler.timesteps):
        v = torch.tanh(x_diffusers) + 0.1 * v_model  # any deterministic "model"
        x_diffusers = scheduler.step(v, t, x_diffusers).prev_sample
        x_ours = ode_step(x_ours, torch.tanh(x_ours) + 0.1 * v_model, scheduler.sigmas[k], scheduler.sigmas[k + 1])
        assert (x_ours - x_diffusers).abs().max().item() <= 1e-6


@pytest.mark.parametrize("backend", [DiffusersSdeStepBackend(0.0, True, kind="sde"), CpsSdeStepBackend(0.0, True)])
def test_zero_noise_reduces_to_euler(backend):
    x, v = _pair()
    for k in range(10):
        mean, std, g = backend.mean_std(x, v, *_step(k))
        assert (mean - ode_step(x, v, *_step(k)[:2])).abs().max().item() <= 1e-6
        assert torch.equal(std, torch.zeros(3))


# -- invariant 3: 'sde' kind ------------------------------------------------------------------------------------


def test_sde_std_table_and_sigma_one_rule():
    eta = 0.7
    backend = DiffusersSdeStepBackend(eta, False)
    x, v = _pair()
    stds = []
    for k in range(10):
        _, std, g = backend.mean_std(x, v, *_step(k))
        assert bool(torch.isfinite(g).all())
        stds.append(std[0].item())
        if k == 0:
            sigma_1 = SD35[1].item()
            assert g[0].item() == pytest.approx(eta / math.sqrt(1 - sigma_1), rel=1e-6)
            assert std[0].item() == pytest.approx(eta, abs=1e-6)
    assert stds == pytest.approx(SD35_STD_ETA07, abs=1e-5)


def test_sigma_one_tolerance():
    backend = DiffusersSdeStepBackend(0.7, False)
    x, v = _pair((2, 1, 2, 2))
    sigma_1 = 0.9
    near = backend.mean_std(x, v, torch.tensor([1.0, 1.0 - 5e-7]), sigma_1, sigma_1)[2]
    assert torch.allclose(near, torch.full((2,), 0.7 / math.sqrt(0.1)), rtol=1e-5)
    far = backend.mean_std(x, v, 1.0 - 1e-4, sigma_1, sigma_1)[2]
    assert far[0].item() == pytest.approx(0.7 * math.sqrt((1 - 1e-4) / 1e-4), rel=1e-4)


def test_sde_mean_formula():
    eta = float(torch.empty(()).uniform_(0.2, 1.0))
    backend = DiffusersSdeStepBackend(eta, False)
    x, v = _pair()
    sigma, sigma_next, sigma_1 = _step(4)
    mean, std, g = backend.mean_std(x, v, sigma, sigma_next, sigma_1)
    h = sigma - sigma_next
    g_ref = eta * math.sqrt(sigma / (1 - sigma))
    expected = x - h * (v + g_ref**2 / (2 * sigma) * (x + (1 - sigma) * v))
    assert torch.allclose(mean, expected, atol=1e-5)
    assert std[0].item() == pytest.approx(g_ref * math.sqrt(h), rel=1e-5)


# -- invariant 4: CPS -------------------------------------------------------------------------------------------


def test_cps_preserves_coefficients():
    eta = float(torch.empty(()).uniform_(0.1, 0.9))
    backend = CpsSdeStepBackend(eta, True)
    x0, eps = _pair()
    for k in range(9):
        sigma, sigma_next, _ = _step(k)
        x = (1 - sigma) * x0 + sigma * eps
        v = eps - x0  # the exact velocity: x̂0 = x0, ε̂ = ε
        mean, std, g = backend.mean_std(x, v, sigma, sigma_next, 0.0)
        noise_coef = sigma_next * math.cos(eta * math.pi / 2)
        assert torch.allclose(mean, (1 - sigma_next) * x0 + noise_coef * eps, atol=1e-5)
        assert torch.equal(std, g)
        assert std[0].item() ** 2 + noise_coef**2 == pytest.approx(sigma_next**2, rel=1e-5)


def test_cps_last_step_returns_x0_hat():
    backend = CpsSdeStepBackend(0.7, True)
    x, v = _pair()
    sigma = SD35[9].item()
    out = backend.sample(x, v, sigma, 0.0, 0.0, _gens(3))
    assert torch.equal(out.std, torch.zeros(3))
    assert torch.allclose(out.next_latents, x - sigma * v, atol=1e-6)
    assert bool(torch.isfinite(out.log_prob).all())


# -- invariant 5: log-prob forms --------------------------------------------------------------------------------


def test_full_log_prob_is_normal_log_prob_mean():
    backend = DiffusersSdeStepBackend(0.7, False)
    x, v = _pair()
    for k in range(10):
        mean, std, _ = backend.mean_std(x, v, *_step(k))
        x_next = mean + std.view(-1, 1, 1, 1) * torch.randn(SHAPE)
        ours = backend.log_prob(x, v, x_next, *_step(k)).log_prob
        reference = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(x_next).mean(dim=(1, 2, 3))
        assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("no_const", [False, True])
def test_log_prob_maximised_at_mean(no_const):
    backend = DiffusersSdeStepBackend(0.7, no_const)
    x, v = _pair()
    mean, std, _ = backend.mean_std(x, v, *_step(3))
    at_mean = backend.log_prob(x, v, mean, *_step(3)).log_prob
    peak = torch.zeros(3) if no_const else -torch.log(std) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(at_mean, peak, atol=1e-6)
    for _ in range(5):
        off = mean + 1e-2 * torch.randn(SHAPE)
        assert bool((backend.log_prob(x, v, off, *_step(3)).log_prob < at_mean).all())


def test_no_const_form_relation_to_full_form():
    x, v = _pair()
    full = DiffusersSdeStepBackend(0.7, False)
    no_const = DiffusersSdeStepBackend(0.7, True)
    mean, std, _ = full.mean_std(x, v, *_step(5))
    x_next = mean + std.view(-1, 1, 1, 1) * torch.randn(SHAPE)
    l_full = full.log_prob(x, v, x_next, *_step(5)).log_prob.double()
    l_nc = no_const.log_prob(x, v, x_next, *_step(5)).log_prob.double()
    s = std.double()
    assert torch.allclose(l_nc, 2 * s**2 * (l_full + torch.log(s) + 0.5 * math.log(2 * math.pi)), rtol=1e-4)


# -- invariant 6: sampling statistics and engine/trainer agreement --------------------------------------------


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_sampled_transitions_have_stated_mean_and_std(kind):
    torch.manual_seed(1234)
    backend = build_sde_backend(kind, 0.7, False)
    draws = 100_000
    x, v = torch.randn(1, 2, 2, 2), torch.randn(1, 2, 2, 2)
    sigma, sigma_next, sigma_1 = _step(3)
    mean, std, _ = backend.mean_std(x, v, sigma, sigma_next, sigma_1)
    generator = torch.Generator().manual_seed(99)
    out = backend.sample(
        x.expand(draws, -1, -1, -1), v.expand(draws, -1, -1, -1), sigma, sigma_next, sigma_1, [generator] * draws
    )
    s = std.item()
    empirical_mean = out.next_latents.mean(0)
    empirical_std = out.next_latents.std(0)
    assert ((empirical_mean - mean[0]).abs() < 4 * s / math.sqrt(draws)).all()
    assert ((empirical_std - s).abs() < 4 * s / math.sqrt(2 * draws)).all()


@pytest.mark.parametrize("kind,flag", [("sde", False), ("sde", True), ("cps", True), ("ode", False)])
def test_engine_log_prob_equals_trainer_log_prob(kind, flag):
    backend = build_sde_backend(kind, 0.7, flag)
    x, v = _pair((4, 4, 16, 16))
    for k in range(10):
        engine = backend.sample(x, v, *_step(k), _gens(4, base=10 * k))
        trainer = backend.log_prob(x, v, engine.next_latents, *_step(k))
        assert trainer.next_latents is None
        # The engine scores its own x' with the trainer's function: same velocity => the same bits (§11.7) ...
        assert torch.equal(engine.log_prob, trainer.log_prob)
        assert torch.equal(engine.mean, trainer.mean)
        if (engine.std == 0).any():  # ode, and cps at its last step: no noise to compare with
            continue
        # ... and that equals the log-prob written from the drawn noise ε to fp32 rounding (§11.6).
        noise = (engine.next_latents - engine.mean) / engine.std.view(-1, 1, 1, 1)
        from_noise = gaussian_log_prob_from_noise(noise, engine.std, backend.log_prob_no_const)
        assert (engine.log_prob - from_noise).abs().max().item() <= 1e-6


def test_noise_comes_from_each_samples_generator():
    backend = DiffusersSdeStepBackend(0.7, False)
    x, v = _pair()
    together = backend.sample(x, v, *_step(2), _gens(3, base=5))
    for b in range(3):
        alone = backend.sample(x[b : b + 1], v[b : b + 1], *_step(2), [torch.Generator().manual_seed(5 + b)])
        assert torch.equal(alone.next_latents[0], together.next_latents[b])
        expected_noise = torch.randn(SHAPE[1:], generator=torch.Generator().manual_seed(5 + b))
        assert torch.allclose(together.next_latents[b], together.mean[b] + together.std[b] * expected_noise)
    with pytest.raises(ValueError):
        backend.sample(x, v, *_step(2), _gens(2))


def test_ode_kind_is_deterministic_and_draws_no_noise():
    backend = build_sde_backend("ode", 0.0, False)
    assert backend.log_prob_no_const
    x, v = _pair()
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    out = backend.sample(x, v, *_step(1), [generator] * 3)
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(out.next_latents, ode_step(x, v, *_step(1)[:2]))
    assert torch.equal(out.log_prob, torch.zeros(3)) and torch.equal(out.std, torch.zeros(3))


# -- invariant 8 and broadcasting --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,flag", [("sde", False), ("sde", True), ("cps", True)])
def test_mean_reduction_is_invariant_to_duplicated_content(kind, flag):
    backend = build_sde_backend(kind, 0.7, flag)
    x, v = _pair()
    mean, std, _ = backend.mean_std(x, v, *_step(6))
    x_next = mean + std.view(-1, 1, 1, 1) * torch.randn(SHAPE)
    single = backend.log_prob(x, v, x_next, *_step(6)).log_prob
    doubled = backend.log_prob(
        torch.cat([x, x], 1), torch.cat([v, v], 1), torch.cat([x_next, x_next], 1), *_step(6)
    ).log_prob
    assert torch.allclose(single, doubled, atol=1e-6, rtol=1e-6)


def test_per_sample_sigmas_match_separate_calls_and_video_latents():
    backend = DiffusersSdeStepBackend(0.7, False)
    x, v = _pair((3, 2, 3, 4, 4))  # video: C, F, H, W
    steps = [0, 4, 9]
    sigma = torch.stack([SD35[k] for k in steps])
    sigma_next = torch.stack([SD35[k + 1] for k in steps])
    batched = backend.mean_std(x, v, sigma, sigma_next, SD35[1])
    for b, k in enumerate(steps):
        alone = backend.mean_std(x[b : b + 1], v[b : b + 1], *_step(k))
        for got, want in zip(batched, alone):
            assert torch.equal(got[b : b + 1], want)
    with pytest.raises(ValueError):
        per_sample(torch.ones(2), 3, "cpu")


def test_fp32_arithmetic_and_gradient_path():
    backend = DiffusersSdeStepBackend(0.7, False)
    x, v = _pair()
    velocity = v.to(torch.bfloat16).requires_grad_(True)
    out = backend.sample(x.to(torch.bfloat16), velocity.detach(), *_step(2), _gens(3))
    assert out.next_latents.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    scored = backend.log_prob(x.to(torch.bfloat16), velocity, out.next_latents.requires_grad_(True), *_step(2))
    scored.log_prob.sum().backward()
    assert velocity.grad is not None and velocity.grad.abs().sum() > 0
    assert out.next_latents.grad is None, "x' is a constant of the score"
    assert not scored.std.requires_grad and not scored.diffusion_coef.requires_grad


def test_gaussian_log_prob_detaches_target():
    mean = torch.randn(2, 3, requires_grad=True)
    target = torch.randn(2, 3, requires_grad=True)
    gaussian_log_prob(target, mean, torch.ones(2), False).sum().backward()
    assert target.grad is None and mean.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,flag", [("sde", False), ("cps", True)])
def test_cuda_generators_bf16_inputs_and_alignment(kind, flag):
    backend = build_sde_backend(kind, 0.7, flag)
    x, v = (t.cuda().to(torch.bfloat16) for t in _pair((4, 16, 32, 32)))
    for k in range(10):
        generators = [torch.Generator("cuda").manual_seed(100 * k + b) for b in range(4)]
        engine = backend.sample(x, v, *_step(k), generators)
        assert engine.next_latents.device.type == "cuda" and engine.next_latents.dtype == torch.float32
        trainer = backend.log_prob(x, v, engine.next_latents, *_step(k))
        assert (engine.log_prob - trainer.log_prob).abs().max().item() <= 1e-6
        noise = torch.randn((16, 32, 32), generator=torch.Generator("cuda").manual_seed(100 * k + 2), device="cuda")
        assert torch.allclose(engine.next_latents[2], engine.mean[2] + engine.std[2] * noise)


# -- building backends --------------------------------------------------------------------------------------------


def test_no_const_rule():
    assert use_no_const_log_prob("cps", False) and use_no_const_log_prob("ode", False)
    assert not use_no_const_log_prob("sde", False) and use_no_const_log_prob("sde", True)
    assert build_sde_backend("cps", 0.7, False).log_prob_no_const
    assert not build_sde_backend("sde", 0.7, False).log_prob_no_const


def test_build_builtin_backends():
    assert isinstance(build_sde_backend("sde", 0.7, False), DiffusersSdeStepBackend)
    assert build_sde_backend("ode", 0.0, False).kind == "ode"
    assert build_sde_backend("cps", 0.5, True).kind == "cps"
    with pytest.raises(MilesUserError, match="--diffusion-sde-type"):
        build_sde_backend("dpm", 0.7, False)
    with pytest.raises(MilesUserError, match="--diffusion-noise-level"):
        build_sde_backend("sde", -0.1, False)
    with pytest.raises(ValueError):
        DiffusersSdeStepBackend(0.7, False, kind="cps")


def test_user_backend_from_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_sde_backends.py").write_text(
        textwrap.dedent(
            """
            import torch
            from miles.diffusion.sde import SdeStepBackend

            class ScaledEuler(SdeStepBackend):
                kind = "scaled_euler"

                def mean_std(self, latents, velocity, sigma, sigma_next, sigma_1):
                    x = latents.float()
                    std = torch.full((x.shape[0],), 0.1 * self.noise_level)
                    return x + (sigma_next - sigma) * velocity.float(), std, std

            class NotABackend:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = build_sde_backend("sde", 0.5, False, backend_path="my_sde_backends.ScaledEuler")
    assert isinstance(backend, SdeStepBackend) and backend.kind == "scaled_euler"
    x, v = _pair()
    out = backend.sample(x, v, 0.8, 0.6, 0.9, _gens(3))
    scored = backend.log_prob(x, v, out.next_latents, 0.8, 0.6, 0.9)
    assert torch.allclose(out.log_prob, scored.log_prob, atol=1e-5)
    with pytest.raises(MilesUserError, match="--sde-step-backend-path"):
        build_sde_backend("sde", 0.5, False, backend_path="my_sde_backends.NotABackend")
    with pytest.raises(MilesUserError, match="--sde-step-backend-path"):
        build_sde_backend("sde", 0.5, False, backend_path="my_sde_backends.Missing")
    with pytest.raises(MilesUserError, match="--sde-step-backend-path"):
        build_sde_backend("sde", 0.5, False, backend_path="no_such_module_xyz.Backend")
