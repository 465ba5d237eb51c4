"""miles/backends/fsdp_utils/rollout_gradient_step.py: the trainer steps on the engines' gradient as it came, and
a non-finite one skips the step (no loss is computed there: the gradient norm says it)."""

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.gradient_fetch import FetchedGradient
from miles.backends.fsdp_utils.rollout_gradient_step import (
    adapter_params_by_pushed_name,
    engine_may_step,
    train_on_rollout_gradient,
)
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import build_tiny_family, tiny_trainer_config
from miles.types import Sample


@pytest.fixture
def trainer(tiny_checkpoint):
    from miles.backends.fsdp_utils.actor import DiffusionTrainer

    init_distributed(0, 1, "gloo", free_port())
    config = tiny_trainer_config(tiny_checkpoint("sd3"), use_lora=True, diffusion_rollout_gradient=True,
                                 rollout_batch_size=1, n_samples_per_prompt=2, global_batch_size=2, lr=1e-2,
                                 clip_grad=0.0)  # the gradient kept as it came
    trainer = DiffusionTrainer(config, build_tiny_family(config))
    trainer.init()
    yield trainer
    dist.destroy_process_group()


def _samples() -> list[Sample]:
    samples = [Sample(prompt="a red cube"), Sample(prompt="a red cube")]
    for sample, advantage in zip(samples, (1.0, -1.0)):
        sample.advantage, sample.sde_step_indices = advantage, [0, 1]
    return samples


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in adapter_params_by_pushed_name(trainer).items()}


def test_the_engines_gradient_is_each_factors_gradient_and_a_non_finite_one_skips_the_step(trainer):
    params = adapter_params_by_pushed_name(trainer)
    flat = torch.randn(sum(p.numel() for p in params.values()), generator=torch.Generator().manual_seed(0))
    before = _adapters(trainer)
    metrics = train_on_rollout_gradient(trainer, 0, _samples(), FetchedGradient(flat=flat.clone(), held=2, expected=2))
    assert metrics["train/skipped_steps"] == 0.0
    offset = 0
    for name, param in params.items():  # each factor's gradient is its piece of the flat vector, in order
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        assert torch.equal(grad, flat[offset : offset + param.numel()].view(param.shape)), name
        offset += param.numel()
    stepped = _adapters(trainer)
    assert any(not torch.equal(before[name], stepped[name]) for name in before)

    flat[len(flat) // 2] = float("nan")
    metrics = train_on_rollout_gradient(trainer, 1, _samples(), FetchedGradient(flat=flat, held=2, expected=2))
    assert metrics["train/skipped_steps"] == 1.0 and "train/grad_norm" not in metrics
    assert all(torch.equal(value, stepped[name]) for name, value in _adapters(trainer).items())


def test_the_engine_steps_only_for_a_host_trainer_and_an_engine_that_passed_its_check(tiny_checkpoint):
    """`--rollout-gradient-engine-step auto`: an engine whose device failed the start-up AdamW check, a trainer on
    the device, `off`, `--check-weight-sync` or a rollout spread over engines leave the step to the trainer."""
    path = tiny_checkpoint("sd3")
    flags = dict(use_lora=True, diffusion_rollout_gradient=True, rollout_gradient_trainer="host", colocate=True)
    host, checked = tiny_trainer_config(path, **flags), {"adamw_matches_host": True}
    assert engine_may_step(host, True, checked)
    assert not engine_may_step(host, True, {"adamw_matches_host": False})
    assert not engine_may_step(host, True, {})  # an engine too old to say
    assert not engine_may_step(host, False, checked)  # several engines, or one reached over HTTP
    assert not engine_may_step(host.replace(rollout_gradient_engine_step="off"), True, checked)
    assert not engine_may_step(host.replace(check_weight_sync=True), True, checked)
    assert not engine_may_step(host.replace(rollout_gradient_trainer="device"), True, checked)
