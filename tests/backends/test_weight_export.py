"""Weight export for sync: engine names, merged LoRA, LoRA pairs with their scale, EMA weights, buckets."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.actor import DiffusionTrainer
from miles.backends.fsdp_utils.spawn import free_port, init_distributed
from miles.testing.tiny_rollout import load_tiny_family, make_rollout_samples, tiny_trainer_config, trained_state
from miles.backends.fsdp_utils.weight_export import (
    iter_buckets,
    iter_named_tensors,
    iter_sync_tensors,
    lora_scaling,
    strip_peft_name,
)
from miles.engine.weight_sync import merge_lora_weight
from miles.utils.errors import MilesUserError


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    torch.set_num_threads(1)
    init_distributed(0, 1, "gloo", free_port())
    args = tiny_trainer_config(tiny_checkpoint("sd3"))
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, [1, 2], seed=5)
    yield args.model.hf_checkpoint, family, pipe, samples
    dist.destroy_process_group()


def make_trainer(tiny, **overrides) -> DiffusionTrainer:
    trainer = DiffusionTrainer(tiny_trainer_config(tiny[0], micro_batch_size=4, **overrides), tiny[1])
    trainer.init()
    return trainer


def test_full_export_uses_the_engines_names_and_the_trained_values(tiny):
    trainer = make_trainer(tiny)
    trainer.train(0, tiny[3])
    exported = dict(iter_named_tensors(trainer))
    engine_names = {f"transformer.{name}" for name, _ in tiny[2].transformer.named_parameters()}
    assert set(exported) == engine_names
    for name, tensor in trained_state(trainer).items():
        assert torch.equal(exported[name], tensor)


def test_lora_full_export_is_the_engines_merge_and_pairs_carry_the_scale(tiny):
    trainer = make_trainer(tiny, use_lora=True, lora_rank=4, lora_alpha=16)
    trainer.train(0, tiny[3])
    trainer.train(1, tiny[3])
    assert lora_scaling(trainer) == 4.0
    merged = dict(iter_named_tensors(trainer))
    pairs = dict(iter_named_tensors(trainer, lora_only=True))
    base = {f"transformer.{n}": p.detach() for n, p in tiny[2].transformer.named_parameters()}
    assert set(merged) == set(base)
    assert pairs and all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in pairs)
    live = {strip_peft_name(n): t for n, t in trained_state(trainer).items()}
    assert all(torch.equal(pairs[n], live[n]) for n in pairs)  # unscaled: the engine applies lora_scaling
    layers = {name.rsplit(".lora_", 1)[0] for name in pairs}
    assert "transformer.transformer_blocks.0.attn.to_q" in layers
    changed = 0
    for name in merged:
        layer = name.rsplit(".", 1)[0]
        if layer in layers and name.endswith(".weight"):
            want = merge_lora_weight(base[name], pairs[f"{layer}.lora_A.weight"], pairs[f"{layer}.lora_B.weight"], 4.0)
            assert torch.equal(merged[name], want), name
            changed += not torch.equal(merged[name], base[name])
        else:
            assert torch.equal(merged[name], base[name]), name
    assert changed >= len(layers) // 2  # the trained adapters moved the merged weights


def test_ema_policy_pushes_the_shadow_and_leaves_the_live_weights(tiny):
    trainer = make_trainer(
        tiny, use_lora=True, use_ema=True, ema_rollout_policy="ema", lora_ipc_weight_sync=True, ema_decay_init=0.5,
        ema_decay_ramp=0.5, num_rollout=2,
    )
    before_training = trained_state(trainer)
    trainer.train(0, tiny[3])
    live_before = trained_state(trainer)
    pushed = dict(iter_sync_tensors(trainer))
    shadow = {strip_peft_name(n): t.full_tensor() for n, t in trainer.ema.shadow_tensors().items()}
    assert set(pushed) == set(shadow)
    for name, tensor in pushed.items():
        assert torch.equal(tensor, shadow[name])
    # δ_1 = 0.5: θ̄ = ½θ_init + ½θ after one update, and the push swapped the live weights back exactly
    some = next(n for n in live_before if "lora_B" in n)
    expected = 0.5 * before_training[some] + 0.5 * live_before[some]
    torch.testing.assert_close(shadow[strip_peft_name(some)], expected)
    assert all(torch.equal(live_before[n], t) for n, t in trained_state(trainer).items())


def test_export_errors(tiny):
    full_trainer = make_trainer(tiny)
    with pytest.raises(MilesUserError, match="--lora-ipc-weight-sync requires --use-lora"):
        list(iter_named_tensors(full_trainer, lora_only=True))
    with pytest.raises(MilesUserError, match="requires --use-ema"):
        list(iter_named_tensors(full_trainer, use_ema=True))


def test_buckets_respect_the_byte_limit_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(tensors, bucket_bytes=25 * 4))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in tensors]
