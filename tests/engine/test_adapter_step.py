"""miles/engine/adapter_step.py: the engine's own AdamW step on its adapter is the trainer's step bit for bit, its
new factors are merged as a push would merge them, and a step it cannot take (no moments, a non-finite gradient)
changes nothing it should not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.diffusion.mirrored_adamw import AdamWStep, adamw_step, bits_checksum, clip_scale
from miles.engine.adapter_step import AdapterStepper
from miles.engine.protocol import ProtocolError
from miles.engine.rollout_gradients import RolloutGradients
from miles.engine.weight_sync import WeightReceiver, merge_lora_weight

ON_A_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="an engine on a GPU")])
LAYERS = {"proj": (5, 3), "out": (3, 4)}  # in, out
RANK = 2


def _modules(device: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"transformer": nn.ModuleDict({name: nn.Linear(i, o, bias=False) for name, (i, o) in LAYERS.items()}
                                         ).to(device)}


def _engine(device: str):
    modules = _modules(device)
    gradients = RolloutGradients(modules)
    receiver = WeightReceiver(modules, on_lora_pair=gradients.set_factors)
    bases = {name: layer.weight.detach().clone() for name, layer in modules["transformer"].items()}
    trainer = {}  # the trainer's copy: name -> fp32 factor on the CPU, in the engine's layout order
    for name, (i, o) in LAYERS.items():
        a, b = torch.randn(RANK, i), torch.randn(o, RANK) * 0.1
        receiver.merge_adapter("transformer", name, a, b)  # as the first push of the pair would
        trainer[f"transformer.{name}.lora_A.weight"], trainer[f"transformer.{name}.lora_B.weight"] = a, b
    return modules, gradients, AdapterStepper(gradients, receiver.merge_adapter), bases, trainer


def _trainer_step(trainer, moments, flat_gradient, step, grad_norm):
    """What the trainer does on the host with the engine's gradient norm (rollout_gradient_step.py)."""
    scale, offset = clip_scale(grad_norm, step.clip), 0
    for name, param in trainer.items():
        grad = flat_gradient[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
        exp_avg, exp_avg_sq = moments.setdefault(name, (torch.zeros_like(param), torch.zeros_like(param)))
        adamw_step(param, grad, exp_avg, exp_avg_sq, step, scale)


def _step(count: int) -> AdamWStep:
    return AdamWStep(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, clip=1.0, count=count)


def _held(gradients: RolloutGradients) -> list[torch.Tensor]:
    return [t.cpu() for f in gradients.factors.values() for t in (f.a, f.b)]


@pytest.mark.parametrize("engine_device", ["cpu", ON_A_GPU])
def test_the_engine_steps_as_the_trainer_does_and_merges_as_a_push(engine_device):
    modules, gradients, stepper, bases, trainer = _engine(engine_device)
    moments: dict = {}
    numel = sum(p.numel() for p in trainer.values())
    for count in (1, 2):
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(count)) * 3
        answer = stepper.step(gradient.to(engine_device), _step(count))
        _trainer_step(trainer, moments, gradient, _step(count), answer.grad_norm)
        assert answer.outcome == "stepped" and stepper.count == count
        assert answer.grad_norm == pytest.approx(float(gradient.norm()), rel=1e-6)
        assert all(torch.equal(held, ours) for held, ours in zip(_held(gradients), trainer.values(), strict=True))
        assert answer.checksum == bits_checksum(trainer.values())
        for name, layer in modules["transformer"].items():  # W = W_base + B·A, exactly as a pushed pair merges
            merged = merge_lora_weight(bases[name], trainer[f"transformer.{name}.lora_A.weight"].to(engine_device),
                                       trainer[f"transformer.{name}.lora_B.weight"].to(engine_device), 1.0)
            assert torch.equal(layer.weight.detach(), merged), name


def test_without_the_trainers_moments_it_answers_no_state_and_steps_once_given_them():
    modules, gradients, stepper, _, trainer = _engine("cpu")
    numel = sum(p.numel() for p in trainer.values())
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    before = _held(gradients)
    assert stepper.step(gradient, _step(3)).outcome == "no_state"  # a resumed trainer's third step
    assert all(torch.equal(a, b) for a, b in zip(before, _held(gradients)))
    moments = {name: (torch.rand_like(p), torch.rand_like(p)) for name, p in trainer.items()}
    flat = torch.cat([m[which].reshape(-1) for which in range(2) for m in moments.values()])
    with pytest.raises(ProtocolError, match="moments"):
        stepper.load_moments(2, flat[:-1])
    stepper.load_moments(2, flat)
    answer = stepper.step(gradient, _step(3))
    _trainer_step(trainer, moments, gradient, _step(3), answer.grad_norm)
    assert answer.outcome == "stepped" and answer.checksum == bits_checksum(trainer.values())


def test_a_non_finite_gradient_is_skipped_and_changes_nothing():
    _, gradients, stepper, _, trainer = _engine("cpu")
    numel = sum(p.numel() for p in trainer.values())
    assert stepper.step(torch.ones(numel), _step(1)).outcome == "stepped"
    before = _held(gradients)
    gradient = torch.ones(numel)
    gradient[3] = float("nan")
    answer = stepper.step(gradient, _step(2))
    assert answer.outcome == "skipped" and stepper.count == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _held(gradients)))


@pytest.mark.parametrize("engine_device", ["cpu", ON_A_GPU])
def test_bases_staged_after_the_last_wave_merge_to_the_same_weights_and_are_then_freed(engine_device):
    """The server stages the LoRA bases on the device after a rollout's last gradient wave (the scheduler's
    `after_last_gradient_wave`); the engine's step then merges from those copies, to the bits of a merge that reads
    them from where they are kept."""
    staged_modules, plain_modules = _modules(engine_device), _modules(engine_device)
    gradients = RolloutGradients(staged_modules)
    staged = WeightReceiver(staged_modules, on_lora_pair=gradients.set_factors)
    plain = WeightReceiver(plain_modules)
    for name, (i, o) in LAYERS.items():
        a, b = torch.randn(RANK, i), torch.randn(o, RANK) * 0.1
        staged.merge_adapter("transformer", name, a, b)
        plain.merge_adapter("transformer", name, a, b)
    staged.stage_lora_bases()
    numel = sum(f.a.numel() + f.b.numel() for f in gradients.factors.values())
    gradient = torch.randn(numel, generator=torch.Generator().manual_seed(9)).to(engine_device)
    assert AdapterStepper(gradients, staged.merge_adapter).step(gradient, _step(1)).outcome == "stepped"
    assert not staged._staged_base  # each merge took its copy
    for name, layer in staged_modules["transformer"].items():
        factors = gradients.factors[f"transformer.{name}"]
        plain.merge_adapter("transformer", name, factors.a, factors.b)
        assert torch.equal(layer.weight.detach(), plain_modules["transformer"][name].weight.detach()), name
    staged.stage_lora_bases()
    assert len(staged._staged_base) == len(LAYERS)
    staged.drop_staged_lora_bases()
    assert not staged._staged_base
