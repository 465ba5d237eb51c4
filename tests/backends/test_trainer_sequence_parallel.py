"""Sequence parallelism (Ulysses, `--sequence-parallel-size 2`) on the CPU: two gloo ranks that split every
sequence give the gradients of one rank that sees it whole, for a family with a diffusers context-parallel plan;
a family without one is a one-line error naming it."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.spawn import spawn_ranks
from miles.testing.tiny_rollout import load_tiny_family, make_rollout_samples, tiny_trainer_config
from miles.utils.safe_load import save_plain

pytestmark = pytest.mark.timeout(300)

SDE_STEPS = [1, 2]


def gradient_rank_worker(rank: int, args, samples_path: str) -> dict:
    """One rollout with lr = 0 and no clipping; returns the full gradient of every trainable parameter."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer
    from miles.testing.tiny_rollout import build_tiny_family
    from miles.types import Sample
    from miles.utils.safe_load import load_plain

    family = build_tiny_family(args)
    samples = [Sample.from_record(record, f"sample {i}") for i, record in enumerate(load_plain(samples_path, "samples"))]
    trainer = DiffusionTrainer(args, family)
    trainer.init()
    metrics = trainer.train(0, samples)
    grads = {name: param.grad.full_tensor().clone() for name, param in trainer.trainable}
    return {"metrics": metrics, "grads": grads}


@pytest.fixture(scope="module")
def flux_rollout(tiny_checkpoint, tmp_path_factory):
    args = tiny_trainer_config(tiny_checkpoint("flux"), lr=0.0, clip_grad=0.0, micro_batch_size=2,
                             diffusion_guidance_scale=1.0)
    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(family, pipe, args, ["a red cube", "two cats"], 2, SDE_STEPS, seed=5)
    path = str(tmp_path_factory.mktemp("sp") / "samples.pt")
    save_plain([sample.to_record() for sample in samples], path, "samples")
    return args, path


def test_ulysses_sp2_gradients_equal_one_rank(flux_rollout):
    args, samples_path = flux_rollout
    (single,) = spawn_ranks(1, gradient_rank_worker, (args, samples_path))
    sp_args = tiny_trainer_config(args.model.hf_checkpoint, lr=0.0, clip_grad=0.0, micro_batch_size=2,
                                diffusion_guidance_scale=1.0, sequence_parallel_size=2)
    ranks = spawn_ranks(2, gradient_rank_worker, (sp_args, samples_path))
    assert single["grads"] and set(ranks[0]["grads"]) == set(single["grads"])
    for result in ranks:
        assert result["metrics"]["train/loss"] == pytest.approx(single["metrics"]["train/loss"], rel=1e-5, abs=1e-9)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_family_without_a_plan_is_a_one_line_error_naming_it(tiny_checkpoint):
    from miles.backends.fsdp_utils.parallel_dims import ParallelDims
    from miles.backends.fsdp_utils.parallelize import apply_sequence_parallel
    from miles.utils.errors import MilesUserError

    args = tiny_trainer_config(tiny_checkpoint("sd3"), sequence_parallel_size=2)
    family, pipe = load_tiny_family(args)
    with pytest.raises(MilesUserError) as failure:
        apply_sequence_parallel(pipe.transformer, family, ParallelDims(world_size=2, sp=2, ulysses=2), None,
                                "transformer")
    message = str(failure.value)
    assert "\n" not in message and "'sd3'" in message and "--sequence-parallel-size 2" in message
