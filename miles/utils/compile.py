"""Regional compilation: `torch.compile` each transformer block in place, shared by the engine and the trainer.

Identical blocks share one compiled graph, so start-up compiles a few block graphs instead of a whole model
(inductor caches them on disk, so a second launch mostly reads them back), and the parameters stay the
modules' own: weight updates and FSDP's sharding reach the compiled code.
"""

from __future__ import annotations

from torch import nn

# One graph per (block variant, batch shape, grad mode): SD3 alone has three block variants, and a run sees a few
# shapes (training, eval, a last micro-batch). Dynamo gives up and runs eagerly past its limit (8 by default).
RECOMPILE_LIMIT = 64


def raise_recompile_limits() -> None:
    """Dynamo's recompile limits raised to `RECOMPILE_LIMIT`, in the calling thread: torch keeps a setting made
    in code per thread (a context variable, torch ≥ 2.13), so a thread that runs compiled blocks calls this itself
    (the engine's worker thread: `ModelRunner.prepare_thread`)."""
    import torch._dynamo

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, RECOMPILE_LIMIT)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 8 * RECOMPILE_LIMIT)


def compile_blocks(block_lists: list[nn.ModuleList], mode: str | None = None) -> None:
    raise_recompile_limits()
    for block_list in block_lists:
        for block in block_list:
            block.compile(mode=mode, dynamic=False)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's tracing plus the backend's code generation or
    cache reads), 0 where torch does not say: the delta over a step is what that step spent compiling."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()  # the backward graph compiles at the first backward: its own key
        return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))
    except Exception:  # noqa: BLE001 - a private API: no number rather than no step
        return 0.0


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each block variant, grad mode and batch shape is one;
    0 where torch does not say)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private API: no number rather than no step
        return 0
