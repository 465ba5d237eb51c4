"""OptimizerParking: when the moments wait on the host, and that parking changes no step (GPU)."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.optimizer_parking import (
    GIB,
    OptimizerParking,
    RoomAtStart,
    next_peak_leaves,
    optimizer_state_bytes,
)


def test_the_next_peak_carries_the_moments_the_first_step_created():
    # the H100 full fine-tune: 77.5 GiB usable at the first training's start, a 61.5 GiB first peak, 16.7 of moments
    room = RoomAtStart(free=int(69.1 * GIB), reserved=int(8.4 * GIB))
    assert next_peak_leaves(room, int(61.5 * GIB), int(16.7 * GIB)) < 0
    assert next_peak_leaves(room, int(61.5 * GIB), 0) == pytest.approx(16.0 * GIB, rel=1e-6)


def test_parking_is_decided_once_from_the_first_step_and_only_where_the_peak_runs_short():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    room = RoomAtStart(free=100 * GIB, reserved=10 * GIB)
    short = OptimizerParking(optimizer, torch.device("cpu"), margin_bytes=8 * GIB)
    short.decide(room, first_peak=70 * GIB, state_bytes=0)  # no step yet: nothing decided
    assert not short.decided and not short.enabled
    short.decide(room, first_peak=70 * GIB, state_bytes=35 * GIB)  # 110 - 105 leaves 5 < 8
    assert short.decided and short.enabled
    assert short.next_peak_extra == 0  # parked: the next peak is the first one
    roomy = OptimizerParking(optimizer, torch.device("cpu"), margin_bytes=8 * GIB)
    roomy.decide(room, first_peak=70 * GIB, state_bytes=20 * GIB)  # leaves 20
    assert roomy.decided and not roomy.enabled
    assert roomy.next_peak_extra == 20 * GIB  # what the colocation policy adds to the trainer's measured peak
    assert roomy.park() == 0  # off: nothing moves
    # a resumed run loaded its moments before the first training: its peak already carried them
    resumed = OptimizerParking(optimizer, torch.device("cpu"), margin_bytes=8 * GIB)
    resumed.decide(RoomAtStart(free=65 * GIB, reserved=45 * GIB, state=35 * GIB), first_peak=100 * GIB,
                   state_bytes=35 * GIB)  # leaves 10
    assert resumed.decided and not resumed.enabled and resumed.next_peak_extra == 0


def _steps(parked: bool) -> tuple[torch.Tensor, int]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, device="cuda")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    parking = OptimizerParking(optimizer, torch.device("cuda"), margin_bytes=0)
    parking.enabled = parked  # as a run whose next peak would not fit decides
    on_host = 0
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        parking.park()
        on_host = max(on_host, optimizer_state_bytes(optimizer, "cpu"))
        layer(torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))).square().sum().backward()
        parking.unpark()
        optimizer.step()
    return layer.weight.detach().cpu(), on_host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parked_moments_give_the_same_steps():
    weights, on_host = _steps(parked=True)
    reference, none_on_host = _steps(parked=False)
    assert on_host == 2 * (64 * 64 + 64) * 4 and none_on_host == 0  # both moments of weight and bias, fp32
    assert torch.equal(weights, reference)
