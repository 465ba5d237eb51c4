"""One gather and one gradient reduction per optimizer window on a one-rank trainer (CPU, gloo): the same weights
bit for bit as gathering and reducing around every micro-batch, with fewer gathers and reductions."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from miles.backends.fsdp_utils.window_gather import WindowGather, applies
from miles.testing.tiny_rollout import trained_state
from tests.backends.test_actor import make_trainer, tiny, world  # noqa: F401 (module fixtures)


def test_it_applies_to_a_one_rank_full_fine_tune_without_a_swapped_reference():
    assert applies(world_size=1, ref_mode="none", cpu_offload=False, lora=False)
    assert not applies(world_size=2, ref_mode="none", cpu_offload=False, lora=False)  # gathers gather then
    assert not applies(world_size=1, ref_mode="ema", cpu_offload=False, lora=False)  # the EMA swap would go unseen
    assert not applies(world_size=1, ref_mode="none", cpu_offload=True, lora=False)
    assert not applies(world_size=1, ref_mode="none", cpu_offload=False, lora=True)


class Counted:
    """Counts FSDP2's gathers (a unit's unshard that has work to do) and reductions (one call per unit each)."""

    def __init__(self, monkeypatch):
        self.gathers = self.reductions = 0
        group = _fsdp_param_group.FSDPParamGroup
        unshard, reduce = group.unshard, _fsdp_param_group.foreach_reduce

        def counted_unshard(param_group, *args, **kwargs):
            self.gathers += param_group._all_gather_result is None and not param_group.is_unsharded
            return unshard(param_group, *args, **kwargs)

        def counted_reduce(*args, **kwargs):
            self.reductions += 1
            return reduce(*args, **kwargs)

        monkeypatch.setattr(group, "unshard", counted_unshard)
        monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counted_reduce)


@pytest.mark.parametrize("forward_dtype", ["fp32", "bf16"])
def test_a_window_gathers_and_reduces_once_and_trains_bitwise_the_same(tiny, monkeypatch, forward_dtype):
    settings = dict(use_lora=False, micro_batch_size=2, num_steps_per_rollout=2, num_rollout=2,
                    diffusion_forward_dtype=forward_dtype)
    runs = {}
    for once in (True, False):
        trainer = make_trainer(tiny, **settings)
        assert trainer.window_gather.enabled
        if not once:
            trainer.window_gather = WindowGather([], enabled=False)
        counts = Counted(monkeypatch)
        losses = [trainer.train(rollout_id, tiny[3])["train/loss"] for rollout_id in (0, 1)]
        monkeypatch.undo()
        units = len(trainer.window_gather.roots) + len(trainer.window_gather.blocks) if once else None
        runs[once] = losses, trained_state(trainer), counts, units
    (losses, state, counts, units), (plain_losses, plain_state, plain_counts, _) = runs[True], runs[False]
    assert losses == plain_losses
    assert all(torch.equal(state[name], plain_state[name]) for name in state)
    windows, micro_batches = 2 * 2, 2  # two rollouts of two windows, each of 4 pairs in micro-batches of 2
    assert units > 1 and counts.reductions == units * windows and counts.gathers == units * windows
    # around every micro-batch: a gather for its forward, another for its backward, a reduction after it
    assert plain_counts.gathers == 2 * micro_batches * units * windows
    assert plain_counts.reductions == micro_batches * units * windows


def test_a_window_without_a_backward_leaves_every_unit_sharded(tiny):
    """--debug-skip-optimizer-step runs the forwards without gradients: nothing reshards them but the window."""
    trainer = make_trainer(tiny, use_lora=False, micro_batch_size=2, debug_skip_optimizer_step=True)
    trainer.train(0, tiny[3])
    gather = trainer.window_gather
    for unit in gather.roots + gather.blocks:
        assert not unit._get_fsdp_state()._fsdp_param_group.is_unsharded
