"""The caching allocator's counts a train step reports (miles/utils/device_memory.py)."""

import pytest
import torch

from miles.utils.device_memory import allocator_counts


def test_allocator_counts_are_cuda_only():
    assert allocator_counts(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_counts_see_a_new_device_allocation():
    device = torch.device("cuda")
    before = allocator_counts(device)
    block = torch.empty(3 << 30, dtype=torch.uint8, device=device)  # larger than anything cached
    after = allocator_counts(device)
    assert after["cuda_mallocs"] > before["cuda_mallocs"]
    del block
