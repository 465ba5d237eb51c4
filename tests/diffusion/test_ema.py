"""EMA (docs/algorithms.md §8; invariant §11.18)."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.ema import EMA
from miles.utils.errors import MilesUserError


def _model(dtype=torch.float32) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(dtype)
    return model


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_decay_schedule_defaults():
    ema = EMA(_model().named_parameters())
    deltas = [ema.decay(k) for k in range(1, 601)]
    assert deltas[:3] == pytest.approx([0.001, 0.002, 0.003])
    assert deltas[498] == pytest.approx(0.499) and deltas[499] == pytest.approx(0.5)
    assert all(d == 0.5 for d in deltas[499:]), "saturates at k = 500"


def test_decay_schedule_with_flat_period_restarts_the_ramp():
    ema = EMA(_model().named_parameters(), decay_init=0.01, decay_ramp=0.003, decay_max=0.9, flat_steps=2)
    assert [ema.decay(k) for k in (1, 2, 3, 4)] == pytest.approx([0.01, 0.01, 0.003, 0.006])


def test_update_rule_and_counter():
    model = _model()
    ema = EMA(model.named_parameters(), decay_init=0.3, decay_ramp=0.2, decay_max=0.5, flat_steps=1)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in range(1, 5):
        _perturb(model)
        delta = ema.update()
        assert delta == pytest.approx(ema.decay(k)) and ema.num_updates == k
        for name, p in model.named_parameters():
            expected[name] = delta * expected[name] + (1 - delta) * p.detach()
    for name, shadow in ema.shadow_tensors().items():
        assert shadow.dtype == torch.float32
        assert torch.allclose(shadow, expected[name], atol=1e-6)


def test_zero_decay_copies_the_live_weights():
    model = _model()
    ema = EMA(model.named_parameters(), decay_init=0.0, decay_ramp=0.0, decay_max=0.0)
    _perturb(model)
    ema.update()
    for name, p in model.named_parameters():
        assert torch.equal(ema.shadow_tensors()[name], p.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_is_bitwise(dtype):
    model = _model(dtype)
    ema = EMA(model.named_parameters())
    _perturb(model)
    ema.update()
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    shadow = {n: t.clone() for n, t in ema.shadow_tensors().items()}
    x = torch.randn(2, 5, dtype=dtype)
    with ema.swapped():
        assert ema.is_swapped
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), shadow[name].to(dtype))
        # shadow_tensors stays correct while swapped in
        for name, t in ema.shadow_tensors().items():
            assert torch.equal(t, shadow[name])
        with torch.no_grad():
            model(x)
        with pytest.raises(RuntimeError):
            ema.update()
        with pytest.raises(RuntimeError):
            ema.swap_in()
    assert not ema.is_swapped
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), live[name])
        assert torch.equal(ema.shadow_tensors()[name], shadow[name])
    with pytest.raises(RuntimeError):
        ema.swap_out()


def test_swap_back_happens_on_exceptions():
    model = _model()
    ema = EMA(model.named_parameters())
    _perturb(model)
    live = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with ema.swapped():
            raise KeyError("boom")
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), live))


def test_tracks_only_the_given_parameters_and_keeps_gradients_off():
    model = _model()
    model[0].weight.requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ema = EMA(trainable)
    assert set(ema.shadow_tensors()) == {n for n, _ in trainable}
    assert all(not t.requires_grad for t in ema.shadow_tensors().values())
    with pytest.raises(ValueError):
        EMA([])


def test_checkpoint_round_trip():
    model = _model()
    ema = EMA(model.named_parameters())
    for _ in range(3):
        _perturb(model)
        ema.update()
    state = ema.state_dict()
    restored = EMA(_model().named_parameters())
    restored.load_state_dict(state)
    assert restored.num_updates == 3
    for name, t in ema.shadow_tensors().items():
        assert torch.equal(restored.shadow_tensors()[name], t)
    # state_dict is a copy: later updates do not change it
    _perturb(model)
    ema.update()
    assert not torch.equal(state["shadow"]["0.weight"], ema.shadow_tensors()["0.weight"])
    other = EMA(torch.nn.Linear(5, 4).named_parameters())
    with pytest.raises(MilesUserError, match="EMA checkpoint"):
        other.load_state_dict(state)


def test_invalid_hyperparameters():
    with pytest.raises(MilesUserError, match="--ema-decay-max"):
        EMA(_model().named_parameters(), decay_max=1.5)
    with pytest.raises(MilesUserError, match="--ema-decay-flat-steps"):
        EMA(_model().named_parameters(), flat_steps=-1)


def test_shadow_can_move_devices():
    model = _model()
    ema = EMA(model.named_parameters(), decay_init=0.0, decay_ramp=0.0, decay_max=0.0)
    assert ema.to("cpu") is ema  # CPU-only CI: the move itself is exercised on the GPU machine
    assert all(t.device.type == "cpu" for t in ema.shadow_tensors().values())
    _perturb(model)
    ema.update()
    assert all(torch.equal(ema.shadow_tensors()[n], p.detach()) for n, p in model.named_parameters())
    with ema.swapped():
        with pytest.raises(RuntimeError):
            ema.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_swap_round_trip_and_offloaded_shadow(dtype):
    model = _model(dtype).cuda()
    ema = EMA(model.named_parameters())
    assert all(t.device.type == "cuda" and t.dtype == torch.float32 for t in ema.shadow_tensors().values())
    _perturb(model)
    ema.update()
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped():
        pass
    assert all(torch.equal(p.detach(), live[n]) for n, p in model.named_parameters())
    on_gpu = {n: t.clone() for n, t in ema.shadow_tensors().items()}
    ema.to("cpu")
    _perturb(model)
    ema.update()  # the live weights stay on the GPU, the shadow on the CPU
    delta = ema.decay(2)
    for name, p in model.named_parameters():
        expected = delta * on_gpu[name] + (1 - delta) * p.detach().float()
        assert torch.allclose(ema.shadow_tensors()[name], expected.cpu(), atol=1e-6)
