"""A finished request's results on their way to the host (miles/engine/host_transfer.py)."""

import time

import pytest
import torch

from miles.engine.host_transfer import DeviceTimer, HostCopies, PendingResponse
from miles.engine.protocol import GenerateResponse


def _pending(device: torch.device, tensor: torch.Tensor, started_at: float) -> tuple[PendingResponse, torch.Tensor]:
    copies, decode = HostCopies(device), DeviceTimer(device)
    decode.start()
    doubled = tensor * 2  # the "decode": work queued on the device
    decode.stop()
    host = copies(doubled)
    copies.mark()

    def pack() -> GenerateResponse:
        assert host.device.type == "cpu"
        return GenerateResponse(request_id=str(float(host.sum())), weight_version=3, samples=[])

    return PendingResponse(pack, copies, decode, started_at, timings={"denoise": 1.5}), host


def test_on_the_cpu_the_copies_are_the_tensors_and_the_response_gets_every_timing():
    started = time.perf_counter()
    pending, host = _pending(torch.device("cpu"), torch.ones(4), started)
    response = pending.result()
    assert response.request_id == "8.0" and response.weight_version == 3
    assert response.timings["denoise"] == 1.5
    assert response.timings["decode"] >= 0 and response.timings["pack"] >= 0
    assert response.timings["total"] >= response.timings["pack"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: copies into pinned memory, waited for by an event")
def test_on_a_gpu_the_copies_land_in_pinned_memory_before_the_response_is_packed():
    device = torch.device("cuda")
    big = torch.randn(4096, 4096, device=device)
    for _ in range(8):  # queue work ahead of the copy so that it lands late
        big = big @ big / 4096 ** 0.5
    pending, host = _pending(device, big, time.perf_counter())
    assert host.is_pinned()
    response = pending.result()
    assert torch.equal(host, (big * 2).cpu())
    assert float(response.request_id) == pytest.approx(float((big * 2).sum().cpu()), rel=1e-4)
    assert response.timings["decode"] > 0  # the device seconds between the events
