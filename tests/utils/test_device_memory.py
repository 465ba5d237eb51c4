"""The caching allocator's counts a train step reports, and the peak-memory metrics (miles/utils/device_memory.py)."""

import pytest
import torch

from miles.utils.device_memory import DeviceMemory, allocator_counts, peak_memory_metrics


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


def test_peak_memory_metrics_take_the_largest_process_peak_in_gib():
    gib = 2**30
    readings = [DeviceMemory(free=0, total=80 * gib, reserved=gib, peak_reserved=12 * gib, peak_allocated=9 * gib),
                DeviceMemory(free=0, total=80 * gib, reserved=gib, peak_reserved=10 * gib, peak_allocated=10 * gib)]
    assert peak_memory_metrics("perf/engine", readings) == {"perf/engine_peak_reserved_gib": 12.0,
                                                            "perf/engine_peak_allocated_gib": 10.0}
    assert peak_memory_metrics("perf/train", []) == {}  # off CUDA there is nothing to read
