"""One gather and one gradient reduction per optimizer window on a one-rank trainer (CPU, gloo): the same weights
bit for bit as gathering and reducing around every micro-batch, with fewer gathers and reductions."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.window_gather import WindowGather, applies
from miles.testing.tiny_rollout import tiny_trainer_config, trained_state
from tests.backends.test_actor import make_trainer, tiny, world  # noqa: F401 (module fixtures)


def test_it_applies_to_a_one_rank_full_fine_tune_on_the_device():
    assert applies(world_size=1, cpu_offload=False, lora=False)
    assert not applies(world_size=2, cpu_offload=False, lora=False)  # gathers gather then
    assert not applies(world_size=1, cpu_offload=True, lora=False)
    assert not applies(world_size=1, cpu_offload=False, lora=True)


class Counted:
    """FSDP2's gathers (an unshard with work to do) and reductions, per unit (keyed by its parameter group)."""

    def __init__(self, monkeypatch):
        self.gathers, self.reductions = Counter(), Counter()
        group = _fsdp_param_group.FSDPParamGroup
        unshard, post_backward = group.unshard, group.post_backward

        def counted_unshard(param_group, *args, **kwargs):
            if param_group._all_gather_result is None and not param_group.is_unsharded:
                self.gathers[id(param_group)] += 1
            return unshard(param_group, *args, **kwargs)

        def counted_post_backward(param_group, *args, **kwargs):
            if param_group.reduce_grads and param_group._training_state != TrainingState.POST_BACKWARD:
                self.reductions[id(param_group)] += 1
            return post_backward(param_group, *args, **kwargs)

        monkeypatch.setattr(group, "unshard", counted_unshard)
        monkeypatch.setattr(group, "post_backward", counted_post_backward)

    @staticmethod
    def key(unit) -> int:
        return id(unit._get_fsdp_state()._fsdp_param_group)


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
        runs[once] = losses, trained_state(trainer), counts, trainer
    (losses, state, counts, trainer), (plain_losses, plain_state, plain_counts, plain) = runs[True], runs[False]
    assert losses == plain_losses
    assert all(torch.equal(state[name], plain_state[name]) for name in state)
    windows, micro_batches = 2 * 2, 2  # two rollouts of two windows, each of 4 pairs in micro-batches of 2
    blocks = [Counted.key(unit) for unit in trainer.window_gather.blocks]
    plain_blocks = [Counted.key(unit) for unit in WindowGather(list(plain.model.values()), enabled=True).blocks]
    assert len(blocks) == 2
    for unit in blocks:
        assert counts.gathers[unit] == windows and counts.reductions[unit] == windows
    for unit in plain_blocks:  # around every micro-batch: a gather for its forward, another for its backward
        assert plain_counts.gathers[unit] == 2 * micro_batches * windows
        assert plain_counts.reductions[unit] == micro_batches * windows
    assert sum(counts.reductions.values()) == 3 * windows  # the root's too, once per window


@pytest.mark.parametrize("losses", [dict(loss_type="nft"), dict(diffusion_kl_beta=0.1, ref_mode="ema")],
                         ids=["nft", "flow_grpo_kl"])
def test_a_forward_with_the_ema_swapped_in_sees_the_ema(tiny, losses):
    """The EMA reference (NFT's v_old, the KL's reference) runs with the EMA's weights, not the gathered policy's:
    the same weights bit for bit as without the window gather, over two rollouts (the EMA moves after the first)."""
    settings = dict(use_lora=False, use_ema=True, micro_batch_size=2, num_rollout=2, diffusion_forward_dtype="bf16",
                    **losses)
    runs = []
    for once in (True, False):
        trainer = make_trainer(tiny, **settings)
        assert trainer.ref_mode == "ema" and trainer.window_gather.enabled
        if not once:
            trainer.window_gather = WindowGather([], enabled=False)
        metrics = [trainer.train(rollout_id, tiny[3]) for rollout_id in (0, 1)]
        runs.append(([m["train/loss"] for m in metrics], trained_state(trainer)))
    (losses_once, state), (plain_losses, plain_state) = runs
    assert losses_once == plain_losses
    assert all(torch.equal(state[name], plain_state[name]) for name in state)


def test_a_window_without_a_backward_leaves_every_unit_sharded(tiny):
    """--debug-skip-optimizer-step runs the forwards without gradients: nothing reshards them but the window."""
    trainer = make_trainer(tiny, use_lora=False, micro_batch_size=2, debug_skip_optimizer_step=True)
    trainer.train(0, tiny[3])
    gather = trainer.window_gather
    for unit in gather.roots + gather.blocks:
        assert not unit._get_fsdp_state()._fsdp_param_group.is_unsharded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_with_compiled_blocks_in_bf16_the_weights_are_bitwise_the_same(tiny):
    args, family, _, samples = tiny
    config = tiny_trainer_config(args.model.hf_checkpoint, use_lora=False, micro_batch_size=2, num_steps_per_rollout=2,
                                 num_rollout=2, diffusion_forward_dtype="bf16", fsdp_torch_compile=True)
    runs = []
    for once in (True, False):
        trainer = DiffusionTrainer(config, family, device="cuda")
        trainer.init()
        assert trainer.window_gather.enabled
        if not once:
            trainer.window_gather = WindowGather([], enabled=False)
        losses = [trainer.train(rollout_id, samples)["train/loss"] for rollout_id in (0, 1)]
        runs.append((losses, trained_state(trainer)))
    (losses, state), (plain_losses, plain_state) = runs
    assert losses == plain_losses
    assert all(torch.equal(state[name], plain_state[name]) for name in state)
