import multiprocessing

import pytest
import torch

from miles.utils import cuda_allocator
from miles.utils.cuda_allocator import conf_sets_growing, fixed_segments, grow_segments_unless_set


def test_the_conf_parser_reads_the_expandable_option_among_others():
    assert conf_sets_growing("expandable_segments:True")
    assert conf_sets_growing("max_split_size_mb:512, expandable_segments:true")
    assert not conf_sets_growing("expandable_segments:False")
    assert not conf_sets_growing("max_split_size_mb:512")
    assert not conf_sets_growing("")
    assert not conf_sets_growing(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_without_cuda_nothing_changes_and_fixed_segments_is_a_plain_block():
    assert not grow_segments_unless_set({})
    assert not cuda_allocator._grows
    with fixed_segments():
        buffer = torch.empty(16, dtype=torch.uint8)
    assert buffer.numel() == 16


def _sum_in_child(queue, result):
    shared = queue.get()
    result.put(float(shared.float().sum()))


def _segment_grows(tensor: torch.Tensor) -> bool:
    address = tensor.untyped_storage().data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return bool(segment["is_expandable"])
    raise AssertionError("no segment holds the tensor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_shared_buffer_comes_from_a_fixed_segment_and_opens_in_another_process(monkeypatch):
    monkeypatch.setattr(cuda_allocator, "_grows", False)
    try:
        assert grow_segments_unless_set({})
        working = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        with fixed_segments():
            shared = torch.ones(32 << 20, dtype=torch.uint8, device="cuda")
        after = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        assert _segment_grows(working) and _segment_grows(after)
        assert not _segment_grows(shared)
        context = multiprocessing.get_context("spawn")
        queue, result = context.Queue(), context.Queue()
        child = context.Process(target=_sum_in_child, args=(queue, result))
        child.start()
        queue.put(shared)
        assert result.get(timeout=120) == float(32 << 20)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_setting_the_run_gives_wins(monkeypatch):
    monkeypatch.setattr(cuda_allocator, "_grows", False)
    assert not grow_segments_unless_set({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert grow_segments_unless_set({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
