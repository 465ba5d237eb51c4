"""The files of a checkpoint and how to read them without running code from them (docs/security.md).

Shared by the trainer's resume (miles.backends.fsdp_utils.checkpoint) and `python -m miles.export`
(miles.backends.fsdp_utils.model_export); it imports neither, so neither imports the other for these pieces.

torch.distributed.checkpoint (DCP) keeps its shard index as a pickle, in `.metadata` (and, for a checkpoint saved
without collectives, a rank-local `__<rank>.metadata` it falls back to when the global one is unusable). A pickle
can run any callable while it loads, so DCP's own reader (plain `pickle.load`) never sees a miles checkpoint:
- `read_dcp_index` reads an index file's bytes once (no symlink, a size limit), unpickles them with an
  allow-list of DCP's metadata classes, and then checks the value's every field by type: the result is a
  `Metadata` or a one-line `MilesUserError`, never `None` or another object that DCP would reject only later;
- every shard the index names is a plain file name inside the checkpoint folder, a regular file, not a link;
- `load_dcp` hands DCP that already-checked `Metadata` through `VettedIndexReader`, which never opens an index
  file again: there is no window between the check and the use, and no fallback to an unchecked rank-local file
  (a rank-local index it is asked for goes through the same `read_dcp_index`);
- DCP's non-tensor items (optimizer hyper-parameters) load with `weights_only=True` (`WeightsOnlyLoadPlanner`);
- `meta.pt` loads with `weights_only=True` and each of its values must have the type miles writes.
"""

from __future__ import annotations

import collections
import errno
import io
import os
import pickle
import re
import stat
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from miles.config.sections import ModelConfig
from miles.utils.errors import MilesUserError
from miles.utils.safe_load import load_plain, refused_global

POINTER_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.pt"
DCP_INDEX_FILE = ".metadata"
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
# A shard DCP's file-system writer names (`__<rank>_<n>.distcp`); anything else in an index is refused.
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
MAX_INDEX_BYTES = 256 << 20  # a real index is kilobytes to a few MB; a bigger one is not worth unpickling
MAX_POINTER_BYTES = 64

# meta.pt: every key and the types its value may have (None where older checkpoints lack it or a run has none).
_INT, _OPT_INT, _OPT_STR, _DICT = (int,), (int, type(None)), (str, type(None)), (dict, collections.OrderedDict)
META_TYPES: dict[str, tuple[type, ...]] = {
    "rollout_id": _INT, "global_step": _INT, "has_optimizer": (bool,), "lr_scheduler": _DICT,
    "grad_scaler": _DICT, "ema_num_updates": _OPT_INT, "use_lora": (bool,), "world_size": _INT,
    "extra_state": _DICT,
}
OPTIONAL_META_TYPES: dict[str, tuple[type, ...]] = {
    "family": _OPT_STR, "hf_checkpoint": _OPT_STR, "modules": (list, type(None)), "lora": (dict, type(None)),
}
META_KEYS = tuple(META_TYPES)


def iteration_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def saved_iterations(root: str) -> list[int]:
    """Rollout ids of the complete-looking `iter_*` folders under `root` (temp folders excluded), ascending."""
    if not os.path.isdir(root):
        return []
    found = (ITERATION_DIR.match(name) for name in os.listdir(root))
    return sorted(int(match.group(1)) for match in found if match and os.path.isdir(os.path.join(root, match.group(0))))


def read_latest_iteration(root: str) -> int | None:
    pointer = os.path.join(root, POINTER_FILE)
    if not os.path.lexists(pointer):
        return None
    if not os.path.isfile(pointer):
        raise MilesUserError(f"--load {root!r}: {pointer} is not a file (it should hold an iteration number)")
    with open(pointer, "rb") as handle:
        raw = handle.read(MAX_POINTER_BYTES + 1)
    text = raw.decode("utf-8", "replace").strip()
    if len(raw) > MAX_POINTER_BYTES or not re.fullmatch(r"\d{1,12}", text):
        raise MilesUserError(f"--load {root!r}: {pointer} holds {text[:40]!r}, not an iteration number")
    return int(text)


def run_family_label(model: ModelConfig) -> str:
    """The model a checkpoint of this run holds: the family key, or the --train-pipeline-config-path class."""
    custom = model.train_pipeline_config_path
    if custom:
        return custom
    resolved = model.diffusion_model_family_resolved
    if resolved:
        return resolved
    from miles.models import resolve_family_name

    return resolve_family_name(model.hf_checkpoint, model.diffusion_model_family)


def describe_failure(err: BaseException) -> str:
    """One line for a failure of DCP or the file system (DCP gathers every rank's exception: the first is named)."""
    if isinstance(err, CheckpointException):
        rank, (cause, _) = next(iter(sorted(err.failures.items(), key=lambda item: item[0])))
        return f"rank {rank}: {describe_failure(cause)}"
    if isinstance(err, MilesUserError):
        return str(err)
    if isinstance(err, OSError) and err.errno is not None:
        where = f" ({err.filename})" if err.filename else ""
        return f"{os.strerror(err.errno)} [{errno.errorcode.get(err.errno, err.errno)}]{where}"
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


# ---- the DCP index ------------------------------------------------------------------------------------------
# The globals a DCP `.metadata` pickle refers to (torch 2.4 - 2.13): its dataclasses, torch.Size, the layout
# decoder, and the path the checkpoint was saved under. Calling any of them only builds a value.
_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise _RefusedGlobal(f"it refers to {module}.{name}, which a checkpoint index never holds")


def read_file_once(path: str, limit: int, what: str) -> bytes:
    """The bytes of a regular file (not a symlink), read through one descriptor; larger than `limit` is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        reason = "is a symbolic link" if err.errno == errno.ELOOP else f"cannot be opened ({describe_failure(err)})"
        raise MilesUserError(f"{what}: {path} {reason}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise MilesUserError(f"{what}: {path} is not a regular file")
        if info.st_size > limit:
            raise MilesUserError(f"{what}: {path} has {info.st_size} bytes, more than the {limit} allowed")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise MilesUserError(f"{what}: {path} grew past the {limit} bytes allowed while it was read")
    return data


def parse_dcp_index(data: bytes, path: str, what: str):
    """A DCP `Metadata` from an index's bytes: allow-list unpickling, then every field checked by type."""
    try:
        index = _IndexUnpickler(io.BytesIO(data)).load()
    except _RefusedGlobal as err:
        raise MilesUserError(f"{what}: refusing to load {path}: {err} (the file was edited or not written by "
                             "torch.distributed.checkpoint)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError,
            MemoryError, RecursionError) as err:
        raise MilesUserError(f"{what}: {path} is truncated or corrupt ({_one_line(err)})") from None
    problem = _index_problem(index)
    if problem:
        raise MilesUserError(f"{what}: refusing to use {path}: {problem} (the file was edited or not written by "
                             "torch.distributed.checkpoint's file-system writer)")
    return index


def read_dcp_index(path: str, what: str = "--load checkpoint index"):
    """`parse_dcp_index` of the file's bytes, read once (`read_file_once`)."""
    return parse_dcp_index(read_file_once(path, MAX_INDEX_BYTES, what), path, what)


def _one_line(err: BaseException) -> str:
    return (" ".join(str(err).split()) or type(err).__name__)[:200]


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(d) is int and d >= 0 for d in value)


def _index_problem(index: Any) -> str | None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if type(index) is not Metadata:
        return f"it holds a {type(index).__name__}, not a checkpoint index"
    if not isinstance(index.state_dict_metadata, dict) or not index.state_dict_metadata:
        return "it names no state"
    for fqn, item in index.state_dict_metadata.items():
        if type(fqn) is not str:
            return "a state key that is not a string"
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata or type(item.properties) is not TensorProperties \
                or not isinstance(item.properties.dtype, torch.dtype) or not _is_size(item.size) \
                or type(item.chunks) is not list:
            return f"the entry {fqn[:80]!r} is not a tensor or bytes entry"
        for chunk in item.chunks:
            if type(chunk) is not ChunkStorageMetadata or not _is_size(chunk.offsets) or not _is_size(chunk.sizes):
                return f"the entry {fqn[:80]!r} has a malformed chunk"
    if not isinstance(index.storage_data, dict) or not index.storage_data:
        return "it names no shards (not a file-system checkpoint index)"
    for key, info in index.storage_data.items():
        if type(key) is not MetadataIndex or type(key.fqn) is not str:
            return "a shard entry with a malformed key"
        if type(info) is not _StorageInfo or type(info.relative_path) is not str \
                or type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            return f"the shard entry of {key.fqn[:80]!r} is malformed"
        if not SHARD_FILE.match(info.relative_path):
            return (f"the shard {info.relative_path[:80]!r} of {key.fqn[:80]!r} is not a shard file name inside the "
                    "checkpoint folder")
        if info.transform_descriptors:  # miles saves no compressed or transformed shards
            return f"the shard entry of {key.fqn[:80]!r} asks for transforms {list(info.transform_descriptors)[:3]}"
    planner_data = index.planner_data
    if planner_data is not None and not (isinstance(planner_data, dict) and all(
            type(k) is str and type(v) is tuple and all(type(p) in (str, int) for p in v)
            for k, v in planner_data.items())):
        return "malformed planner data"
    if index.storage_meta is not None and type(index.storage_meta) is not StorageMeta:
        return "malformed storage meta"
    return None


class VettedIndexReader(FileSystemReader):
    """DCP's file-system reader given an index `read_dcp_index` already checked: it never opens the global index
    again; a rank-local index DCP asks for goes through `read_dcp_index` too."""

    def __init__(self, directory: str, index) -> None:
        super().__init__(directory)
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        index = self._index if rank is None else read_dcp_index(str(self._get_metadata_path(rank)))
        if index.storage_meta is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor item (optimizer hyper-parameters, ...) loads with weights_only=True
    (DefaultLoadPlanner unpickles those with weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            refused = refused_global(str(err)) or "a type weights_only=True refuses"
            raise MilesUserError(f"the item {read_item.dest_index.fqn!r} holds {refused}, not only tensors and plain "
                                 "values (the shard was edited, or not written by miles)") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_dcp(state: dict, directory: str, index, no_dist: bool = False) -> None:
    """`dcp.load` of `state` from a checkpoint whose `index` `read_checkpoint` checked; failures are one line."""
    import warnings

    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=VettedIndexReader(directory, index), planner=WeightsOnlyLoadPlanner(),
                     no_dist=no_dist)
    except (CheckpointException, OSError, RuntimeError) as err:
        raise MilesUserError(f"--load {directory!r}: cannot read the checkpoint's shards: "
                             f"{describe_failure(err)}") from None


# ---- one checkpoint folder -----------------------------------------------------------------------------------
@dataclass
class CheckpointFiles:
    """A checkpoint folder whose meta and index were checked; `index` is the only copy DCP gets to see."""

    directory: str
    meta: dict[str, Any]
    index: Any  # torch.distributed.checkpoint.metadata.Metadata


def meta_problem(meta: Any) -> str | None:
    if type(meta) not in (dict, collections.OrderedDict):
        return f"it holds a {type(meta).__name__}, not a dict"
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        return f"missing {missing}"
    for key, types in {**META_TYPES, **OPTIONAL_META_TYPES}.items():
        value = meta.get(key)
        if key in meta and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"{key} is a {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}"
    if meta.get("modules") is not None and not all(type(m) is str for m in meta["modules"]):
        return "modules is not a list of names"
    lora = meta.get("lora")
    if lora is not None and not (type(lora.get("r")) is int and type(lora.get("lora_alpha")) is int
                                 and isinstance(lora.get("target_modules"), (str, list))):
        return "lora is not the LoRA settings miles records"
    return None


def read_checkpoint(directory: str, what: str | None = None) -> CheckpointFiles:
    """Check one checkpoint folder without loading its weights. Every problem is one line.

    meta.pt loads (weights_only) with every key of its type; the DCP index loads through `read_dcp_index`;
    every shard it names is a regular file in `directory` at least as long as the index says (a truncated copy
    fails here, not halfway through loading).
    """
    what = what or f"--load checkpoint {directory}"
    if not os.path.isdir(directory):
        raise MilesUserError(f"{what}: no such folder (--ckpt-step or {POINTER_FILE} names a missing checkpoint)")
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        raise MilesUserError(f"{what}: incomplete checkpoint: {META_FILE} is missing")
    meta = load_plain(meta_path, "--load checkpoint meta")
    problem = meta_problem(meta)
    if problem:
        raise MilesUserError(f"--load checkpoint meta {meta_path}: not a miles checkpoint meta ({problem})")
    index_path = os.path.join(directory, DCP_INDEX_FILE)
    if not os.path.lexists(index_path):
        raise MilesUserError(f"{what}: incomplete checkpoint: the shard index {DCP_INDEX_FILE} is missing")
    index = read_dcp_index(index_path)
    needed: dict[str, int] = {}  # shard file -> bytes the index says it holds at least
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        shard = os.path.join(directory, relative)
        try:
            info = os.lstat(shard)
        except FileNotFoundError:
            raise MilesUserError(f"{what}: incomplete checkpoint: shard {shard} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise MilesUserError(f"{what}: shard {shard} is not a regular file (a link or folder is refused)")
        if info.st_size < size:
            raise MilesUserError(f"{what}: shard {shard} is truncated ({info.st_size} bytes, the index expects "
                                 f"{size})")
    return CheckpointFiles(directory, meta, index)
