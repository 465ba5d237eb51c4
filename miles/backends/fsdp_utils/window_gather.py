"""On a one-rank trainer, an optimizer step's micro-batches share one gather of the weights and one reduction of
the gradients.

FSDP2 gathers each unit's parameters (casting the fp32 master weights to the forward dtype) before every
micro-batch's forward and again before its backward, and reduce-scatters the unit's gradients after every
backward. On one rank a gather and a reduce-scatter are copies: the gathered weights do not change until the
optimizer step, and the reduction only adds each micro-batch's gradient to the sum so far. A 64-pair full
fine-tune step at SD3.5-Medium size trailed the plain loop's by 0.41 s on one H100, with thousands of small copies
and elementwise kernels in its profile that are likely these (bench/RESULTS.md, twenty-third session).

So, inside one optimizer step's window of micro-batches, the block units stay gathered from their first forward to
the window's last backward, and the gradients accumulate unreduced in the reduce dtype, as FSDP2 does under
`set_requires_gradient_sync(False)`: the same fp32 additions in the same order as reducing after each micro-batch
(one rank sums nothing), so the step's gradients are bitwise those of the default path. The last micro-batch
reduces them and reshards. The cost: the forward-dtype copy of the whole model held through the window (4.5 GB
at SD3.5-Medium), which the first training's measured peak counts, and the optimizer parking with it
(optimizer_parking.py); the plain loop holds the same copy through its forward and backward (autocast's cache).

A forward with other weights swapped into the shards (the EMA reference, `--ref-mode ema`) calls `reshard()`
before the swap and again before the swap back: it gathers the swapped weights, and the policy's backward and next
forward gather the policy's again (FSDP2 gathers a resharded unit before its backward into the same tensors).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

logger = logging.getLogger(__name__)


def applies(world_size: int, cpu_offload: bool, lora: bool) -> bool:
    """One rank holds every shard, on the device, and every weight trains (under LoRA on one rank the root is the
    only unit and the frozen base is held whole already: parallelize.py)."""
    return world_size == 1 and not cpu_offload and not lora


def _units(roots: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the FSDP roots, the units below them: the transformer blocks)."""
    from torch.distributed.fsdp import FSDPModule

    roots = [root for root in roots if isinstance(root, FSDPModule)]
    below = [unit for root in roots for unit in root.modules() if unit is not root and isinstance(unit, FSDPModule)]
    return roots, below


class WindowGather:
    """`with gather.window():` around a window's micro-batches; `gather.before(last)` before each one's forward."""

    def __init__(self, roots: list[nn.Module], enabled: bool):
        self.roots, self.blocks = _units(roots) if enabled else ([], [])
        if self.roots:
            logger.info("trainer: one rank, full fine-tune: each optimizer window gathers its %d blocks once and "
                        "reduces their gradients once", len(self.blocks))

    @property
    def enabled(self) -> bool:
        return bool(self.roots)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        # the blocks were sharded with reshard_after_forward=True (parallelize.py); a root keeps what FSDP2 makes
        # of it (its own small parameters; PyTorch versions differ on whether a root reshards after its forward)
        for block in self.blocks:
            block.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for block in self.blocks:
                block.set_reshard_after_forward(True, recurse=False)
            for root in self.roots:
                root.set_reshard_after_backward(True)
                root.set_requires_gradient_sync(True)
            self.reshard()  # a window that ended without its last backward (no gradients, an error)

    def reshard(self) -> None:
        """Every unit back to its shard now (before and after a forward with swapped weights)."""
        for unit in self.roots + self.blocks:
            unit.reshard()

    def before(self, last: bool) -> None:
        """Before a micro-batch's forward: the last one reduces the window's gradients and reshards after its
        backward; the others keep both for the next."""
        for root in self.roots:
            root.set_reshard_after_backward(last)
            root.set_requires_gradient_sync(last)
