"""The bench scripts are files, not a package: each test module loads the one it tests under its own name."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Iterator

import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@contextlib.contextmanager
def _load(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py as module `name`, registered in sys.modules while it is in use (dataclasses resolve their
    annotations through it), with bench/ on sys.path (a script imports its neighbours as a run from there would)."""
    sys.path.insert(0, BENCH_DIR)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(BENCH_DIR)


@pytest.fixture(scope="session")
def bench_script():
    """`with bench_script("plain_loop") as module:` (see `_load`)."""
    return _load
