"""The restricted DCP index reader and DCP loading through it (miles.backends.fsdp_utils.checkpoint_files), on real
indexes `dcp.save` writes; the crafted checkpoints of a resume and an export are in test_checkpoint.py and
test_model_export.py."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from miles.backends.fsdp_utils.checkpoint_files import (
    MAX_INDEX_BYTES,
    VettedIndexReader,
    load_dcp,
    read_dcp_index,
)
from miles.testing.payloads import RunsCode, one_line_error


@pytest.fixture
def saved(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    directory = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": dict(model.named_parameters()), "optimizer": optimizer.state_dict()},
                 checkpoint_id=directory, no_dist=True)
    return directory, model


def test_a_real_index_reads_and_loads(saved):
    directory, model = saved
    index = read_dcp_index(os.path.join(directory, ".metadata"))
    assert index.storage_data and "model.weight" in index.state_dict_metadata
    state = {"model": {name: torch.zeros_like(p) for name, p in model.named_parameters()}}
    load_dcp(state, directory, index, no_dist=True)
    assert torch.equal(state["model"]["weight"], model.weight.detach())


def test_payloads_none_links_and_huge_files_are_refused(saved, tmp_path):
    directory, _ = saved
    index_path = os.path.join(directory, ".metadata")
    marker = tmp_path / "ran"
    cases = [
        (pickle.dumps({"x": RunsCode(str(marker))}), "it refers to io.open"),
        (pickle.dumps(None), "holds a NoneType, not a checkpoint index"),
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict, not a checkpoint index"),
        (b"\x80\x04", "is truncated or corrupt"),
    ]
    for data, message in cases:
        with open(index_path, "wb") as handle:
            handle.write(data)
        assert message in one_line_error(read_dcp_index, index_path)
    os.remove(index_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, index_path)
    assert "is a symbolic link" in one_line_error(read_dcp_index, index_path)
    os.remove(index_path)
    with open(index_path, "wb") as handle:
        handle.truncate(MAX_INDEX_BYTES + 1)  # sparse: no disk used
    assert "more than the" in one_line_error(read_dcp_index, index_path)
    assert not marker.exists()


def test_a_rank_local_index_goes_through_the_same_reader(saved, tmp_path):
    directory, _ = saved
    index = read_dcp_index(os.path.join(directory, ".metadata"))
    marker = tmp_path / "ran"
    with open(os.path.join(directory, "__0.metadata"), "wb") as handle:
        pickle.dump(RunsCode(str(marker)), handle)
    reader = VettedIndexReader(directory, index)
    assert reader.read_metadata() is index
    assert "it refers to io.open" in one_line_error(lambda: reader.read_metadata(rank=0))
    assert not marker.exists()


def test_edited_index_fields_are_refused_by_type(saved):
    directory, _ = saved
    index_path = os.path.join(directory, ".metadata")
    with open(index_path, "rb") as handle:
        original = handle.read()

    def first_storage(index):
        return next(iter(index.storage_data.values()))

    edits = [
        (lambda index: setattr(first_storage(index), "relative_path", "/etc/passwd"), "not a shard file name"),
        (lambda index: setattr(first_storage(index), "offset", "0"), "is malformed"),
        (lambda index: setattr(first_storage(index), "transform_descriptors", ["zstd"]), "asks for transforms"),
        (lambda index: setattr(index, "storage_data", None), "names no shards"),
        (lambda index: setattr(index, "planner_data", {"a": [1]}), "malformed planner data"),
        (lambda index: index.state_dict_metadata.__setitem__("x", 3), "is not a tensor or bytes entry"),
    ]
    for edit, message in edits:
        index = pickle.loads(original)  # the file dcp.save just wrote
        edit(index)
        with open(index_path, "wb") as handle:
            pickle.dump(index, handle)
        assert message in one_line_error(read_dcp_index, index_path)


def test_a_non_tensor_item_with_a_reduce_payload_does_not_run(tmp_path):
    """DCP stores non-tensor values (optimizer hyper-parameters) as pickled bytes inside the shards."""
    marker, directory = tmp_path / "payload-ran", str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "hyper": {"lr": RunsCode(str(marker))}}, checkpoint_id=directory, no_dist=True)
    state = {"w": torch.zeros(2), "hyper": {"lr": 0.1}}
    index = read_dcp_index(os.path.join(directory, ".metadata"))
    assert "the item 'hyper.lr' holds io.open" in one_line_error(load_dcp, state, directory, index, True)
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "hyper": {"lr": 0.5}}, checkpoint_id=directory, no_dist=True)
    load_dcp(state, directory, read_dcp_index(os.path.join(directory, ".metadata")), True)
    assert state["hyper"]["lr"] == 0.5 and torch.equal(state["w"], torch.ones(2))
