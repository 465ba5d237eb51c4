"""Hostile inputs for the tests of what miles refuses to unpickle (checkpoints, saved rollouts, DCP indexes)."""

from __future__ import annotations

import os
import pickle

import pytest

from miles.utils.errors import MilesUserError


class RunsCode:
    """A pickle payload: unpickling it with an unrestricted loader creates the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def one_line_error(fn, *args) -> str:
    """The MilesUserError `fn(*args)` raises, checked to be one line."""
    with pytest.raises(MilesUserError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def swap_dcp_index_before_load(monkeypatch, directory: str, marker: str) -> None:
    """The check-then-load race: just before DCP loads, its index files in `directory` are replaced by a payload
    that would create `marker` if anything unpickled them."""
    import torch.distributed.checkpoint as dcp

    real_load = dcp.load

    def swap_then_load(*args, **kwargs):
        for name in (".metadata", "__0.metadata"):
            with open(os.path.join(directory, name), "wb") as handle:
                pickle.dump(RunsCode(marker), handle)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", swap_then_load)
