"""OptimizerParking: which moments wait on the host, and that parking changes no step (GPU)."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.optimizer_parking import (
    GIB,
    OptimizerParking,
    RoomAtStart,
    choose_parked,
    next_peak_leaves,
    optimizer_state_bytes,
)


def test_the_next_peak_carries_the_moments_the_first_step_created():
    # the H100 full fine-tune: 77.5 GiB usable at the first training's start, a 61.5 GiB first peak, 16.7 of moments
    room = RoomAtStart(free=int(69.1 * GIB), reserved=int(8.4 * GIB))
    assert next_peak_leaves(room, int(61.5 * GIB), int(16.7 * GIB)) < 0
    assert next_peak_leaves(room, int(61.5 * GIB), 0) == pytest.approx(16.0 * GIB, rel=1e-6)


def test_the_largest_moments_are_parked_until_the_shortfall_is_met():
    sizes = {(0, "exp_avg"): 10, (0, "exp_avg_sq"): 10, (1, "exp_avg"): 40, (2, "exp_avg"): 25}
    assert choose_parked(sizes, 0) == []
    assert choose_parked(sizes, 40) == [(1, "exp_avg")]
    assert choose_parked(sizes, 41) == [(1, "exp_avg"), (2, "exp_avg")]
    assert choose_parked(sizes, 1000) == [(1, "exp_avg"), (2, "exp_avg"), (0, "exp_avg"), (0, "exp_avg_sq")]


def _stepped_linear(device: str = "cpu") -> torch.optim.Optimizer:
    """AdamW over a 64 x 64 layer after one step: two 16 KiB moments for the weight, two 256 B for the bias."""
    layer = torch.nn.Linear(64, 64, device=device)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.ones(2, 64, device=device)).sum().backward()
    optimizer.step()
    return optimizer


def test_parking_is_decided_once_from_the_first_step_and_parks_only_the_shortfall():
    optimizer = _stepped_linear()
    held = optimizer_state_bytes(optimizer, "cpu")
    assert held == 2 * (64 * 64 + 64) * 4
    margin = 1 << 20
    room = RoomAtStart(free=10 << 20, reserved=0)
    nothing_yet = OptimizerParking(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]), torch.device("cpu"), margin)
    nothing_yet.decide(room, first_peak=9 << 20, state_bytes=0)  # no step yet: nothing decided
    assert not nothing_yet.decided and not nothing_yet.enabled
    # the next peak (first peak + the moments) would leave 20000 bytes less than the margin: one weight moment
    # (16 KiB) falls short of that, both reach it; the bias moments stay
    short = OptimizerParking(optimizer, torch.device("cpu"), margin)
    short.decide(room, first_peak=room.free - held - margin + 20000, state_bytes=held)
    assert short.decided and short.enabled
    assert short.chosen == {(0, "exp_avg"), (0, "exp_avg_sq")} and short.chosen_bytes == 2 * 64 * 64 * 4
    assert short.next_peak_extra == held - short.chosen_bytes  # what the colocation policy adds to the first peak
    assert short.parkable == held - short.chosen_bytes
    short.park_more(1)  # the colocation policy's ask: the next largest moment, a bias's
    assert len(short.chosen) == 3 and short.chosen_bytes == 2 * 64 * 64 * 4 + 64 * 4
    roomy = OptimizerParking(optimizer, torch.device("cpu"), margin)
    roomy.decide(room, first_peak=room.free - held - margin, state_bytes=held)  # leaves exactly the margin
    assert roomy.decided and not roomy.enabled
    assert roomy.next_peak_extra == held
    assert roomy.park() == 0  # off: nothing moves
    # a resumed run loaded its moments before the first training: its peak already carried them
    resumed = OptimizerParking(optimizer, torch.device("cpu"), margin)
    resumed.decide(RoomAtStart(free=room.free, reserved=0, state=held), first_peak=room.free - margin,
                   state_bytes=held)
    assert resumed.decided and not resumed.enabled and resumed.next_peak_extra == 0


def test_the_chosen_moments_buffers_are_allocated_ahead_and_the_parking_uses_them():
    """The buffers come from a background thread when the moments are chosen (pinning is slow on a GPU); the
    parking waits for it and copies into those very buffers."""
    optimizer = _stepped_linear()
    held = optimizer_state_bytes(optimizer, "cpu")
    parking = OptimizerParking(optimizer, torch.device("cpu"), margin_bytes=1 << 20)
    parking.decide(RoomAtStart(free=10 << 20, reserved=0), first_peak=(10 << 20) - held - (1 << 20) + 20000,
                   state_bytes=held)
    parking._host.wait()
    ahead = dict(parking._host._buffers)
    assert set(ahead) == parking.chosen == {(0, "exp_avg"), (0, "exp_avg_sq")}
    assert all(ahead[key].shape == (64, 64) for key in ahead)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    for name in ("exp_avg", "exp_avg_sq"):  # what `park` does on a GPU (a CPU run's moments stay where they are)
        assert parking._host.to_host((0, name), state[name]) is ahead[(0, name)]
        assert torch.equal(ahead[(0, name)], state[name])


def _steps(shortfall: int | None) -> tuple[torch.Tensor, int]:
    """Four fused AdamW steps of a linear layer, parking `shortfall` bytes of moments from the second (None:
    none), with an offload and onload of the state (a colocation turn) between the third and the fourth."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, device="cuda")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    parking = OptimizerParking(optimizer, torch.device("cuda"), margin_bytes=shortfall or 0)
    on_host = 0
    for step in range(4):
        if step == 3:
            parking.state_to("cpu")
            assert optimizer_state_bytes(optimizer, "cuda") == 0
            parking.state_to("cuda")
            assert optimizer_state_bytes(optimizer, "cpu") == parking.chosen_bytes  # they return for the step
        optimizer.zero_grad(set_to_none=True)
        parking.park()
        on_host = max(on_host, optimizer_state_bytes(optimizer, "cpu"))
        x = torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        layer(x).square().sum().backward()
        parking.unpark()
        assert optimizer_state_bytes(optimizer, "cpu") == 0
        optimizer.step()
        if step == 0 and shortfall is not None:  # as the trainer decides after its first training
            held = optimizer_state_bytes(optimizer, "cuda")
            parking.decide(RoomAtStart(free=held, reserved=0), first_peak=0, state_bytes=held)
    return layer.weight.detach().cpu(), on_host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parked_moments_give_the_same_steps():
    reference, none_on_host = _steps(shortfall=None)
    assert none_on_host == 0
    for shortfall, parked in ((1, 64 * 64 * 4), (GIB, 2 * (64 * 64 + 64) * 4)):  # one weight moment; all of them
        weights, on_host = _steps(shortfall)
        assert on_host == parked
        assert torch.equal(weights, reference)
