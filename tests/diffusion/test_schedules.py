"""Sigma schedules (docs/algorithms.md §1, §7; invariant §11.1) and parity with diffusers' scheduler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from miles.diffusion.schedules import (
    dynamic_shift_mu,
    flow_match_sigmas,
    sft_sigma_grid,
    shift_sigmas,
    sigmas_from_timesteps,
    timesteps_from_sigmas,
)

SD35_SIGMAS_10 = [1.0, 0.960129, 0.913349, 0.857692, 0.790368, 0.707278, 0.602151, 0.464876, 0.278049, 0.008929, 0.0]


def test_sd35_reference_table():
    sigmas = flow_match_sigmas(10, shift=3.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    assert torch.allclose(sigmas, torch.tensor(SD35_SIGMAS_10), atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_steps", [1, 2, 7, 10, 28, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_grid_invariants(num_steps, shift):
    sigmas = flow_match_sigmas(num_steps, shift=shift)
    assert sigmas.shape == (num_steps + 1,)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all()), "strictly decreasing"
    timesteps = timesteps_from_sigmas(sigmas)
    assert torch.equal(timesteps, sigmas[:-1] * 1000)


@pytest.mark.parametrize("num_steps", [1, 3, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0, 7.5])
def test_static_shift_bitwise_equals_diffusers(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    ours = flow_match_sigmas(num_steps, shift=shift)
    assert torch.equal(ours, scheduler.sigmas)
    assert torch.equal(timesteps_from_sigmas(ours), scheduler.timesteps)


@pytest.mark.parametrize("image_seq_len", [256, 1024, 4096])
@pytest.mark.parametrize("num_steps", [4, 20])
def test_dynamic_shift_bitwise_equals_diffusers(image_seq_len, num_steps):
    mu = dynamic_shift_mu(image_seq_len)
    assert mu == pytest.approx(calculate_shift(image_seq_len))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    scheduler.set_timesteps(num_steps, mu=mu)
    assert torch.equal(flow_match_sigmas(num_steps, mu=mu), scheduler.sigmas)
    # Flux / Qwen-Image pass their own unshifted grid
    base = np.linspace(1.0, 1 / num_steps, num_steps)
    scheduler.set_timesteps(sigmas=base, mu=mu)
    assert torch.equal(flow_match_sigmas(num_steps, mu=mu, sigmas=base), scheduler.sigmas)


def test_dynamic_shift_formula():
    mu = float(torch.empty(()).uniform_(0.3, 1.5))
    sigmas = flow_match_sigmas(6, mu=mu, sigmas=np.linspace(1.0, 1 / 6, 6))[:-1].double()
    u = torch.from_numpy(np.linspace(1.0, 1 / 6, 6).astype(np.float32)).double()
    expected = np.exp(mu) / (np.exp(mu) + 1 / u - 1)
    assert torch.allclose(sigmas, expected, atol=1e-6)


def test_mu_is_linear_in_token_count():
    assert dynamic_shift_mu(256) == pytest.approx(0.5)
    assert dynamic_shift_mu(4096) == pytest.approx(1.15)
    assert dynamic_shift_mu(2176) == pytest.approx((0.5 + 1.15) / 2)
    assert dynamic_shift_mu(1000, 100, 1100, 0.0, 1.0) == pytest.approx(0.9)


def test_shift_function_properties():
    shift = float(torch.empty(()).uniform_(1.5, 6.0))
    u = torch.rand(1000, dtype=torch.float64).sort().values
    shifted = shift_sigmas(u, shift)
    assert bool((shifted[1:] >= shifted[:-1]).all()), "monotone"
    assert bool((shifted >= u).all()), "s > 1 spends more steps at high noise"
    assert shift_sigmas(torch.tensor([0.0, 1.0]), shift).tolist() == [0.0, 1.0]
    assert torch.equal(shift_sigmas(u, 1.0), u)
    with pytest.raises(ValueError):
        shift_sigmas(u, 0.0)


def test_sft_grid_is_the_scheduler_training_table():
    for shift in (1.0, 3.0):
        grid = sft_sigma_grid(shift)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        assert grid.shape == (1000,)
        assert torch.equal(grid, scheduler.sigmas)
        u = torch.linspace(1, 1 / 1000, 1000, dtype=torch.float64)
        assert torch.allclose(grid.double(), shift * u / (1 + (shift - 1) * u), atol=1e-6)
    assert sft_sigma_grid(3.0, num_train_timesteps=10).shape == (10,)


def test_sigmas_from_timesteps_appends_terminal_zero():
    sigmas = flow_match_sigmas(8, shift=3.0)
    back = sigmas_from_timesteps(timesteps_from_sigmas(sigmas))
    assert back[-1].item() == 0.0
    assert torch.allclose(back, sigmas, atol=1e-7)


def test_bad_arguments():
    with pytest.raises(ValueError):
        flow_match_sigmas(0)
    with pytest.raises(ValueError):
        flow_match_sigmas(3, sigmas=[1.0, 0.5])
    with pytest.raises(ValueError):
        flow_match_sigmas(3, shift=-1.0)
    with pytest.raises(ValueError):
        sft_sigma_grid(3.0, num_train_timesteps=0)
