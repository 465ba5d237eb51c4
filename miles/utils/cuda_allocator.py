"""The trainer's CUDA caching allocator: growing segments for its own work, fixed ones for what it shares.

Growing ("expandable") segments stop a process from stranding freed blocks of one size beside requests for another:
the trainer's micro-batches, its optimizer step and its weight gathers all allocate different sizes, and with
fixed segments the full fine-tune at SD3.5-Medium size held 3.9 GiB reserved that no tensor used, enough to run
one H100 out of memory where the plain loop fits (bench/RESULTS.md, nineteenth session). But memory of a growing
segment can only be shared with another process through `pidfd_getfd`, which containers without ptrace rights
refuse, and the trainer shares its weight-sync and gradient buffers with the engines by CUDA IPC. The allocator
takes the setting per new segment, so the trainer runs with growing segments and allocates each shared buffer
inside `fixed_segments()`, which switches them off for that allocation only.

A run's Ray workers get the setting in their environment (miles/ray/placement.py), so it holds from their start;
`grow_segments_unless_set` covers a trainer started without it (the benches that build one in-process).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ALLOC_CONF_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
GROWING_SEGMENTS = "expandable_segments:True"  # the engines' launch default, the trainer's setting at start

_grows = False  # this process turned growing segments on (grow_segments_unless_set)


def conf_sets_growing(conf: str | None) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF value turns growing segments on ("expandable_segments:True")."""
    for option in (conf or "").split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def grow_segments_unless_set(environ: dict[str, str] | None = None) -> bool:
    """Turn growing segments on for this process unless the run's environment configures the allocator (a value
    the user set wins, as it does for the engines). Returns whether segments now grow. No-op without CUDA."""
    import torch

    global _grows
    environ = os.environ if environ is None else environ
    if not torch.cuda.is_available():
        return False
    if ALLOC_CONF_VARIABLE in environ:
        _grows = conf_sets_growing(environ[ALLOC_CONF_VARIABLE])
        return _grows
    torch.cuda.memory._set_allocator_settings(GROWING_SEGMENTS)
    _grows = True
    return True


@contextlib.contextmanager
def fixed_segments() -> Iterator[None]:
    """Allocations inside come from fixed segments, which CUDA IPC can share without ptrace rights."""
    if not _grows:
        yield
        return
    import torch

    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings(GROWING_SEGMENTS)
