"""Loading files without running code from them: `torch.load(weights_only=True)`.

A pickle can name any callable and run it while loading (`__reduce__`), so a checkpoint or a saved rollout
that someone edited could run code in every trainer rank. miles therefore writes only tensors and plain
values (dicts, lists, tuples, str, int, float, bool, None) into its `.pt` files and reads them back with
`weights_only=True`, which refuses anything else (`save_plain` checks a value before writing it, so what miles
writes it can read back). The one pickle miles cannot avoid, the `.metadata` index that
torch.distributed.checkpoint writes next to the shards, has its own restricted reader
(miles.backends.fsdp_utils.checkpoint_files).

A file that is refused, truncated or unreadable becomes one `MilesUserError` naming what (a flag, or "checkpoint
meta") and the file.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
from typing import Any

import torch

from miles.utils.errors import MilesUserError

def load_plain(path: str, what: str, map_location: str | torch.device = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain values only; every failure is one line.

    `what` names where the path came from (a flag such as "--load-debug-rollout-data", or "--load checkpoint
    meta"), so the message says which setting to fix.
    """
    if not os.path.isfile(path):
        raise MilesUserError(f"{what}: {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = refused_global(str(err))
        if refused:
            raise MilesUserError(f"{what}: refusing to load {path} with weights_only=True: it holds {refused}, not "
                                 "only tensors and plain values (miles writes only those there: the file was "
                                 "edited, or written by other code)") from None
        raise MilesUserError(f"{what}: {path} is truncated or corrupt ({_weights_only_reason(str(err))})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, KeyError, IndexError) as err:
        raise MilesUserError(f"{what}: {path} is truncated or corrupt ({_one_line(err)})") from None


def _one_line(err: BaseException) -> str:
    return (" ".join(str(err).split()) or type(err).__name__)[:200]


def refused_global(message: str) -> str | None:
    """The global a weights_only load refused, from torch's many-line message ("... GLOBAL io.open was not ...")."""
    for line in message.splitlines():
        if "GLOBAL " in line:
            return line.split("GLOBAL ", 1)[1].split()[0].rstrip(".,")
    return None


def _weights_only_reason(message: str) -> str:
    """The informative line of torch's weights_only error (e.g. "Unsupported operand 110"); the rest is advice."""
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    for line in message.splitlines():
        line = line.strip()
        if line and not line.startswith(advice):
            return " ".join(line.split())[:200]
    return "not a torch.save file"


def plain_value_problem(value: Any, where: str = "") -> str | None:
    """Where a value holds something `weights_only=True` cannot load back (e.g. ".extra_state.x: a Foo"), or None.

    Checked before saving, so a data source whose `state_dict()` returns its own objects fails at the first save
    with the key named, instead of making every later resume fail.
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.device)):
        return None
    if type(value) in (list, tuple):  # a namedtuple or a list subclass is a class weights_only refuses
        for index, item in enumerate(value):
            problem = plain_value_problem(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)):
                return f"{where}: a key of type {type(key).__name__}"
            problem = plain_value_problem(item, f"{where}.{key}")
            if problem:
                return problem
        return None
    return f"{where}: an object of type {type(value).__module__}.{type(value).__qualname__}"


def save_plain(value: Any, path: str, what: str) -> None:
    """`torch.save` after checking the value loads back under `weights_only=True` (see `plain_value_problem`)."""
    problem = plain_value_problem(value)
    if problem:
        raise MilesUserError(f"{what}: cannot write {path}: it would hold {problem.lstrip('.')}; only tensors and "
                             "plain values (dict, list, tuple, str, int, float, bool, None) are stored")
    torch.save(value, path)
