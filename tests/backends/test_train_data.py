"""Samples → train pairs → DP ranks → windows → micro-batches (train_data.py; docs/algorithms.md §3, §5–§7)."""

from __future__ import annotations

import logging

import pytest
import torch

from miles.testing.config import trainer_config
from miles.backends.fsdp_utils.train_data import (
    collate,
    convert_samples_to_train_data,
    deal_to_dp_rank,
    expand_sample_to_train_pairs,
    plan_rank_train_data,
    split_micro_batches,
    split_windows,
)
from miles.diffusion.schedules import flow_match_sigmas, sft_sigma_grid
from miles.models.sd3 import SD3TrainPipelineConfig
from miles.models.wan2_2 import Wan22TrainPipelineConfig
from miles.types import Sample, TrainPair
from miles.utils.errors import MilesUserError

NUM_STEPS = 10
SIGMAS = flow_match_sigmas(NUM_STEPS, shift=3.0)


def make_sample(index: int, steps=(2, 3, 4), advantage: float = 0.5, group_index: int = 0) -> Sample:
    latents = {k: torch.full((4, 8, 8), float(100 * index + k)) for k in set(steps) | {k + 1 for k in steps}}
    return Sample(
        prompt=f"p{index}",
        index=index,
        group_index=group_index,
        sde_step_indices=list(steps),
        latents=latents,
        sigmas=SIGMAS.clone(),
        timesteps=SIGMAS[:-1] * 1000,
        rollout_log_probs=torch.tensor([-1.0 * (j + 1) for j in range(len(steps))]),
        conditioning={"prompt_embeds": torch.full((5, 3), float(index)), "pooled_prompt_embeds": torch.ones(6)},
        clean_latents=torch.full((4, 8, 8), float(index)),
        advantage=advantage,
    )


@pytest.fixture(scope="module")
def sd3():
    return SD3TrainPipelineConfig()


def pair(sample_index: int, step: int, sigma: float = 0.5) -> TrainPair:
    return TrainPair(sample_index, step, torch.zeros(2), None, sigma, 0.0, 0.0, sigma * 1000)


# ---- expansion ------------------------------------------------------------------------------------------
def test_rl_pairs_carry_the_recorded_step(sd3):
    sample = make_sample(1, steps=(0, 5))
    pairs = expand_sample_to_train_pairs(trainer_config(), sample, sd3)
    assert [p.step_index for p in pairs] == [0, 5]
    first, second = pairs
    assert first.latents is sample.latents[0] and first.next_latents is sample.latents[1]
    assert second.sigma == pytest.approx(float(SIGMAS[5])) and second.sigma_next == pytest.approx(float(SIGMAS[6]))
    assert first.sigma_1 == pytest.approx(float(SIGMAS[1]))
    assert second.timestep == pytest.approx(1000 * float(SIGMAS[5]), rel=1e-6)
    assert [p.old_log_prob for p in pairs] == [-1.0, -2.0]
    assert all(p.advantage == 0.5 and p.conditioning is sample.conditioning for p in pairs)


def test_sigmas_fall_back_to_timesteps_over_n(sd3):
    sample = make_sample(0, steps=(9,))
    sample.sigmas = None
    (last,) = expand_sample_to_train_pairs(trainer_config(), sample, sd3)
    assert last.sigma == pytest.approx(float(SIGMAS[9]), rel=1e-6) and last.sigma_next == 0.0


def test_rl_expansion_errors(sd3):
    sample = make_sample(0, steps=(2, 3))
    del sample.latents[4]
    with pytest.raises(MilesUserError, match="x_4"):
        expand_sample_to_train_pairs(trainer_config(), sample, sd3)
    sample = make_sample(0, steps=(2, 3))
    sample.rollout_log_probs = torch.zeros(1)
    with pytest.raises(MilesUserError, match="2 SDE steps but 1 rollout log-probs"):
        expand_sample_to_train_pairs(trainer_config(), sample, sd3)
    with pytest.raises(MilesUserError, match="--loss-type must be one of"):  # refused once, by the declared choices
        trainer_config(loss_type="grpo")


def test_nft_pairs_use_the_rollout_grid_and_one_permutation_per_sample(sd3):
    args = trainer_config(loss_type="nft", use_ema=True)
    pairs = expand_sample_to_train_pairs(args, make_sample(3), sd3)
    assert len(pairs) == 9  # ⌊10 · 0.99⌋, the smallest σ dropped
    sigmas = sorted((p.sigma for p in pairs), reverse=True)
    assert sigmas == pytest.approx(SIGMAS[:9].tolist())
    assert all(p.latents is not None and p.next_latents is None for p in pairs)
    assert [p.sigma for p in expand_sample_to_train_pairs(args, make_sample(3), sd3)] == [p.sigma for p in pairs]
    other = [p.sigma for p in expand_sample_to_train_pairs(args, make_sample(4), sd3)]
    assert other != [p.sigma for p in pairs]  # independent orders per sample
    ordered = expand_sample_to_train_pairs(trainer_config(loss_type="nft", use_ema=True, no_diffusion_nft_shuffle_timesteps=True), make_sample(3), sd3)
    assert [p.sigma for p in ordered] == pytest.approx(SIGMAS[:9].tolist())
    missing = make_sample(3)
    missing.clean_latents = None
    with pytest.raises(MilesUserError, match="no clean_latents"):
        expand_sample_to_train_pairs(args, missing, sd3)


def test_sft_pair_sigma_lies_on_the_shifted_grid(sd3):
    args = trainer_config(loss_type="sft_loss", fsdp_flow_shift=3.0)
    grid = sft_sigma_grid(3.0, 1000)
    for index in range(5):
        (sft_pair,) = expand_sample_to_train_pairs(args, make_sample(index), sd3)
        assert torch.isclose(grid, torch.tensor(sft_pair.sigma)).any()
        assert sft_pair.timestep == pytest.approx(1000 * sft_pair.sigma, rel=1e-6)


def test_removed_samples_give_no_pairs(sd3):
    samples = [make_sample(i) for i in range(3)]
    samples[1].remove_sample = True
    pairs = convert_samples_to_train_data(trainer_config(), samples, sd3)
    assert sorted({p.sample_index for p in pairs}) == [0, 2] and len(pairs) == 6


def only_last_step(args, sample):
    return [TrainPair(sample.index, 99, sample.clean_latents, None, 0.25, 0.0, 0.0, 250.0, advantage=sample.advantage)]


def reversed_pairs(args, samples):
    return [TrainPair(s.index, 0, s.clean_latents, None, 0.5, 0.0, 0.0, 500.0) for s in reversed(samples)]


def test_custom_expand_and_convert_hooks(sd3):
    args = trainer_config(custom_expand_samples_to_train_pairs_path=f"{__name__}.only_last_step")
    pairs = convert_samples_to_train_data(args, [make_sample(0), make_sample(1)], sd3)
    assert [(p.sample_index, p.step_index) for p in pairs] == [(0, 99), (1, 99)]
    args = trainer_config(custom_convert_samples_to_train_data_path=f"{__name__}.reversed_pairs")
    assert [p.sample_index for p in convert_samples_to_train_data(args, [make_sample(0), make_sample(1)], sd3)] == [1, 0]
    with pytest.raises(MilesUserError, match="--custom-expand-samples-to-train-pairs-path"):
        convert_samples_to_train_data(
            trainer_config(custom_expand_samples_to_train_pairs_path=f"{__name__}.no_such_hook"), [make_sample(0)], sd3
        )


# ---- dealing and windows --------------------------------------------------------------------------------
def test_deal_contiguous_and_stride_with_equal_counts(caplog):
    pairs = [pair(i, 0) for i in range(7)]
    with caplog.at_level(logging.WARNING):
        contiguous = [deal_to_dp_rank(pairs, r, 2, "contiguous") for r in range(2)]
    assert "dropping the last 1" in caplog.text
    assert [[p.sample_index for p in share] for share in contiguous] == [[0, 1, 2], [3, 4, 5]]
    stride = [deal_to_dp_rank(pairs, r, 2, "stride") for r in range(2)]
    assert [[p.sample_index for p in share] for share in stride] == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(MilesUserError, match="--train-dp-split-mode 'random'"):
        deal_to_dp_rank(pairs, 0, 2, "random")
    with pytest.raises(MilesUserError, match="cannot be dealt"):
        deal_to_dp_rank(pairs[:1], 0, 2)


def test_windows_must_divide():
    pairs = [pair(i // 2, i % 2) for i in range(6)]
    assert [len(w) for w in split_windows(pairs, 3)] == [2, 2, 2]
    with pytest.raises(MilesUserError, match="not divisible by --num-steps-per-rollout 4"):
        split_windows(pairs, 4)
    with pytest.raises(MilesUserError, match="must be >= 1"):
        split_windows(pairs, 0)


def test_nft_keeps_a_sample_in_one_window():
    pairs = [pair(i // 3, i % 3) for i in range(6)]  # 2 samples × K = 3
    split_windows(pairs, 2, require_whole_samples=True)
    with pytest.raises(MilesUserError, match="sample 0 fall into optimizer windows 0 and 1"):
        split_windows(pairs, 3, require_whole_samples=True)
    with pytest.raises(MilesUserError, match="contiguous"):
        plan_rank_train_data(trainer_config(loss_type="nft", use_ema=True, train_dp_split_mode="stride"), pairs, 0, 2)


# ---- micro-batches --------------------------------------------------------------------------------------
def ids(micro_batches):
    return [[(p.sample_index, p.step_index) for p in mb] for mb in micro_batches]


def test_flat_micro_batches():
    window = [pair(s, t) for s in range(2) for t in range(2)]
    assert ids(split_micro_batches(trainer_config(micro_batch_size=2), window)) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    with pytest.raises(MilesUserError, match="--micro-batch-size 3 must divide the 4"):
        split_micro_batches(trainer_config(micro_batch_size=3), window)


def test_tile_orders_and_errors():
    window = [pair(s, t) for s in range(4) for t in range(2)]
    args = trainer_config(micro_batch_size_sample=2, micro_batch_size_tstep=1)
    assert ids(split_micro_batches(args, window)) == [
        [(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (3, 0)], [(2, 1), (3, 1)],
    ]
    args = trainer_config(micro_batch_size_sample=2, micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major")
    assert ids(split_micro_batches(args, window)) == [
        [(0, 0), (1, 0)], [(2, 0), (3, 0)], [(0, 1), (1, 1)], [(2, 1), (3, 1)],
    ]
    with pytest.raises(MilesUserError, match="--diffusion-train-iter-order must be one of"):  # the declared choices
        trainer_config(diffusion_train_iter_order="random")
    with pytest.raises(MilesUserError, match="does not divide"):
        split_micro_batches(trainer_config(micro_batch_size_sample=3, micro_batch_size_tstep=1), window)
    with pytest.raises(MilesUserError, match="set together"):
        split_micro_batches(trainer_config(micro_batch_size_sample=2), window)
    with pytest.raises(MilesUserError, match="same number of train pairs per sample"):
        split_micro_batches(trainer_config(micro_batch_size_sample=1, micro_batch_size_tstep=1), window[:-1])


def test_micro_batch_mixing_wan_experts_is_refused():
    wan = Wan22TrainPipelineConfig()
    wan.configure(boundary_ratio=0.875, expand_timesteps=False, has_transformer_2=True)
    high, low = pair(0, 0, sigma=0.95), pair(0, 1, sigma=0.5)
    split_micro_batches(trainer_config(micro_batch_size=1), [high, low], wan)
    with pytest.raises(MilesUserError, match=r"mixes denoising phases .*transformer.*transformer_2"):
        split_micro_batches(trainer_config(micro_batch_size=2), [high, low], wan)


def test_plan_and_collate(sd3):
    samples = [make_sample(i, steps=(2, 3)) for i in range(4)]
    pairs = convert_samples_to_train_data(trainer_config(), samples, sd3)
    args = trainer_config(num_steps_per_rollout=2, micro_batch_size=2)
    plan = plan_rank_train_data(args, pairs, dp_rank=1, dp_size=2, family=sd3)
    assert plan.pairs_per_window == 2 and len(plan.windows) == 2
    assert ids(plan.windows[0]) == [[(2, 2), (2, 3)]] and ids(plan.windows[1]) == [[(3, 2), (3, 3)]]
    batch = collate(plan.windows[1][0], "cpu")
    assert batch.latents.shape == (2, 4, 8, 8) and batch.next_latents[1, 0, 0, 0] == 304.0
    assert batch.conditioning["prompt_embeds"].shape == (2, 5, 3)
    assert batch.old_log_probs.tolist() == [-1.0, -2.0] and batch.loss_mask.tolist() == [1.0, 1.0]
    odd = make_sample(9, steps=(2,))
    odd.conditioning = {"prompt_embeds": torch.zeros(7, 3), "pooled_prompt_embeds": torch.ones(6)}
    mixed = convert_samples_to_train_data(trainer_config(), [samples[0], odd], sd3)
    with pytest.raises(MilesUserError, match="different shapes"):
        collate(mixed, "cpu")
