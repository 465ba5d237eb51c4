"""PinnedBuffers and replace_module_tensors (miles/utils/pinned.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.utils.pinned import PinnedBuffers, replace_module_tensors


def test_a_key_keeps_its_buffer_while_its_tensor_keeps_its_shape():
    buffers = PinnedBuffers(pin=False)
    first = buffers.to_host("w", torch.arange(4.0))
    again = buffers.to_host("w", torch.arange(4.0) + 1)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.arange(4.0) + 1)
    reshaped = buffers.to_host("w", torch.zeros(2, 3))
    assert reshaped.shape == (2, 3) and buffers.nbytes == 6 * 4
    buffers.to_host("b", torch.zeros(5, dtype=torch.bfloat16))
    assert buffers.nbytes == 6 * 4 + 5 * 2


def test_a_background_reservation_serves_later_copies_and_its_failure_is_raised():
    buffers = PinnedBuffers(pin=False)
    buffers.reserve_in_background({"w": (torch.Size([4]), torch.float32)}, torch.device("cpu"))
    assert buffers.nbytes == 4 * 4  # waits for the thread, which allocated the buffer
    reserved = buffers.reserve("w", torch.Size([4]), torch.float32)
    assert buffers.to_host("w", torch.arange(4.0)).data_ptr() == reserved.data_ptr()
    buffers.reserve_in_background({"bad": (torch.Size([-1]), torch.float32)}, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="pinning host buffers in the background failed"):
        buffers.wait()
    buffers.wait()  # raised once: the buffers stay usable
    assert buffers.nbytes == 4 * 4


def test_every_tensor_is_replaced_once_in_place():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)  # one module registered twice: its tensors are seen once
    model.register_buffer("table", torch.ones(2))
    model[1].register_buffer("table", model.table)  # one buffer registered by two modules
    model[0].weight.grad = torch.full((3, 3), 2.0)
    weight = model[0].weight
    calls = []

    def replace(name, tensor):
        calls.append(name)
        return None if name.endswith("bias") else tensor + 10  # None leaves the bias as it is

    replace_module_tensors(model, replace)
    assert sorted(calls) == ["0.bias", "0.weight", "0.weight.grad", "table"]
    assert model[0].weight is weight  # a parameter keeps its identity, as Module.to keeps it
    assert torch.equal(model[0].weight.grad, torch.full((3, 3), 12.0))
    assert model.table is model[1].table and torch.equal(model.table, torch.full((2,), 11.0))
    assert torch.equal(model[2].bias, shared.bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_buffers_are_pinned_and_reused():
    buffers = PinnedBuffers(pin=True)
    tensor = torch.randn(1024, device="cuda")
    host = buffers.to_host("x", tensor)
    assert host.is_pinned() and buffers.to_host("x", tensor * 2).data_ptr() == host.data_ptr()
    torch.cuda.synchronize()
    assert torch.equal(host, (tensor * 2).cpu())
    # a device without an index (as the trainer's `cuda`): the thread pins on the caller's device, not on a guess
    buffers.reserve_in_background({"y": (torch.Size([8]), torch.float32)}, torch.device("cuda"))
    buffers.wait()
    assert buffers.to_host("y", torch.ones(8, device="cuda")).is_pinned()
