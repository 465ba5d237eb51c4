"""Samples → train pairs → DP ranks → optimizer windows → micro-batches (docs/design.md §5, docs/algorithms.md §5–§7).

- `expand_sample_to_train_pairs`: one pair per trained step of a sample. policy_loss / custom_loss: the
  sample's SDE steps (x_k, x_{k+1}, σ_k, σ_{k+1}, ℓ_old, A). nft: K = ⌊n·f⌋ noise levels from the rollout grid
  (`nft_train_sigmas`), pairs hold the clean x0. sft_loss: one noise level drawn from the SFT grid.
- `convert_samples_to_train_data`: every sample (removed samples give no pairs), sample-major.
- `deal_to_dp_rank`: contiguous or stride, equal counts (a remainder is dropped with a warning).
- `split_windows` / `split_micro_batches`: `--num-steps-per-rollout` windows of Q pairs, then flat
  `--micro-batch-size` cuts or the 2-D sample × timestep tile.
- `collate`: a micro-batch as batched tensors (`TrainBatch`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from miles.config.sections import RunConfig
from miles.types import Sample, TrainPair
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function

logger = logging.getLogger(__name__)

RL_LOSSES = ("policy_loss", "custom_loss")


# ---------------------------------------------------------------------------------------------------------
# sample -> pairs
# ---------------------------------------------------------------------------------------------------------
def _sample_generator(config: RunConfig, sample: Sample, salt: int) -> torch.Generator:
    """Per-sample generator for expansion-time draws (NFT shuffle, SFT σ index): same pairs on every rank."""
    generator = torch.Generator()
    seed = config.trainer.seed * 7919 + sample.group_index * 104_729 + sample.index * 31 + salt
    generator.manual_seed(seed % (2**62))
    return generator


def _rollout_sigmas(sample: Sample, num_train_timesteps: int) -> torch.Tensor:
    """The sample's recorded σ grid (n + 1 values); σ = t/N when only timesteps were shipped (§1)."""
    if sample.sigmas is not None:
        return sample.sigmas.detach().to(torch.float32).cpu()
    if sample.timesteps is None:
        raise MilesUserError(f"sample {sample.index} (prompt {sample.prompt!r}) has neither sigmas nor timesteps")
    sigmas = sample.timesteps.detach().to(torch.float32).cpu() / float(num_train_timesteps)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def _rl_pairs(sample: Sample, family) -> list[TrainPair]:
    sigmas = _rollout_sigmas(sample, family.num_train_timesteps)
    timesteps = family.timesteps_from_sigmas(sigmas)
    steps = list(sample.sde_step_indices)
    if sample.rollout_log_probs is None or len(sample.rollout_log_probs) != len(steps):
        got = None if sample.rollout_log_probs is None else len(sample.rollout_log_probs)
        raise MilesUserError(
            f"sample {sample.index}: {len(steps)} SDE steps but {got} rollout log-probs; the engine must return one "
            "log-prob per selected step"
        )
    pairs = []
    for j, k in enumerate(steps):
        if k not in sample.latents or k + 1 not in sample.latents:
            raise MilesUserError(
                f"sample {sample.index}: SDE step {k} needs latents x_{k} and x_{k + 1}, the rollout returned "
                f"{sorted(sample.latents)}"
            )
        debug = None if sample.debug_model_outputs is None else sample.debug_model_outputs.get(k)
        pairs.append(
            TrainPair(
                sample_index=sample.index,
                step_index=k,
                latents=sample.latents[k],
                next_latents=sample.latents[k + 1],
                sigma=float(sigmas[k]),
                sigma_next=float(sigmas[k + 1]),
                sigma_1=float(sigmas[1]) if len(sigmas) > 1 else 0.0,
                timestep=float(timesteps[k]),
                advantage=float(sample.advantage),
                old_log_prob=float(sample.rollout_log_probs[j]),
                conditioning=sample.conditioning,
                debug_model_output=debug,
            )
        )
    return pairs


def _clean_pairs(config: RunConfig, sample: Sample, family, sigmas: torch.Tensor) -> list[TrainPair]:
    """NFT / SFT pairs: the clean x0 and the noise level to train at (the noise itself is drawn at train time)."""
    if sample.clean_latents is None:
        raise MilesUserError(
            f"--loss-type {config.trainer.loss_type}: sample {sample.index} has no clean_latents (x0); NFT needs a rollout "
            "that returns the final latent, SFT the encoded training image"
        )
    timesteps = family.timesteps_from_sigmas(sigmas)
    return [
        TrainPair(
            sample_index=sample.index,
            step_index=position,
            latents=sample.clean_latents,
            next_latents=None,
            sigma=float(sigma),
            sigma_next=0.0,
            sigma_1=0.0,
            timestep=float(timestep),
            advantage=float(sample.advantage),
            conditioning=sample.conditioning,
        )
        for position, (sigma, timestep) in enumerate(zip(sigmas.tolist(), timesteps.tolist()))
    ]


def sft_flow_shift(config: RunConfig) -> float:
    """`--fsdp-flow-shift`, else the checkpoint's scheduler config `shift`, else 1.0 (§7)."""
    if config.trainer.fsdp_flow_shift is not None:
        return config.trainer.fsdp_flow_shift
    config_path = os.path.join(str(config.model.hf_checkpoint or ""), "scheduler", "scheduler_config.json")
    if os.path.exists(config_path):
        with open(config_path) as handle:
            return float(json.load(handle).get("shift", 1.0))
    return 1.0


def expand_sample_to_train_pairs(config: RunConfig, sample: Sample, family) -> list[TrainPair]:
    """The train pairs of one sample (docs/algorithms.md §3, §6, §7), in step order."""
    loss_type = config.trainer.loss_type
    if loss_type in RL_LOSSES:
        return _rl_pairs(sample, family)
    if loss_type == "nft":
        from miles.diffusion.losses import nft_train_sigmas

        rollout_sigmas = _rollout_sigmas(sample, family.num_train_timesteps)
        sigmas = nft_train_sigmas(
            rollout_sigmas,
            config.trainer.diffusion_nft_timestep_fraction,
            not config.trainer.no_diffusion_nft_shuffle_timesteps,
            _sample_generator(config, sample, salt=1),
        )
        return _clean_pairs(config, sample, family, sigmas.to(torch.float32))
    from miles.diffusion.schedules import sft_sigma_grid  # sft_loss, the last of the flag's choices

    grid = sft_sigma_grid(sft_flow_shift(config), family.num_train_timesteps)
    index = torch.randint(0, len(grid), (1,), generator=_sample_generator(config, sample, salt=2))
    return _clean_pairs(config, sample, family, grid[index].to(torch.float32))


def convert_samples_to_train_data(config: RunConfig, samples: list[Sample], family=None) -> list[TrainPair]:
    """All pairs of a rollout, sample-major; `remove_sample` samples give none (`--rollout-sample-filter-path`)."""
    if config.trainer.custom_convert_samples_to_train_data_path:
        convert = load_function(config.trainer.custom_convert_samples_to_train_data_path, "--custom-convert-samples-to-train-data-path", 2)
        return list(convert(config.hook_args, samples))
    expand_path = config.trainer.custom_expand_samples_to_train_pairs_path
    expand = load_function(expand_path, "--custom-expand-samples-to-train-pairs-path", 2) if expand_path else None
    pairs: list[TrainPair] = []
    for sample in samples:
        if sample.remove_sample:
            continue
        pairs.extend(expand(config.hook_args, sample) if expand else expand_sample_to_train_pairs(config, sample, family))
    return pairs


# ---------------------------------------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------------------------------------
def deal_to_dp_rank(pairs: list[TrainPair], dp_rank: int, dp_size: int, mode: str = "contiguous") -> list[TrainPair]:
    """This rank's share: equal counts on every rank, the remainder dropped with a warning (§5)."""
    per_rank = len(pairs) // dp_size
    if per_rank == 0:
        raise MilesUserError(f"{len(pairs)} train pairs cannot be dealt to {dp_size} data-parallel ranks")
    if len(pairs) % dp_size:
        logger.warning(
            "%d train pairs do not divide over %d DP ranks: dropping the last %d", len(pairs), dp_size, len(pairs) % dp_size
        )
    kept = pairs[: per_rank * dp_size]
    if mode == "contiguous":
        return kept[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    if mode == "stride":
        return kept[dp_rank::dp_size]
    raise MilesUserError(f"--train-dp-split-mode {mode!r}: expected contiguous or stride")


def split_windows(pairs: list[TrainPair], num_windows: int, require_whole_samples: bool = False) -> list[list[TrainPair]]:
    """`--num-steps-per-rollout` optimizer windows of Q = len(pairs) / num_windows pairs each."""
    if num_windows < 1:
        raise MilesUserError(f"--num-steps-per-rollout must be >= 1, got {num_windows}")
    if len(pairs) % num_windows:
        raise MilesUserError(
            f"this rank's {len(pairs)} train pairs are not divisible by --num-steps-per-rollout {num_windows}; "
            "choose --global-batch-size / --num-steps-per-rollout so that every optimizer step gets the same "
            "number of pairs (rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout)"
        )
    size = len(pairs) // num_windows
    windows = [pairs[i * size : (i + 1) * size] for i in range(num_windows)]
    if require_whole_samples:
        owner: dict[int, int] = {}
        for w, window in enumerate(windows):
            for pair in window:
                if owner.setdefault(pair.sample_index, w) != w:
                    raise MilesUserError(
                        f"--loss-type nft: the pairs of sample {pair.sample_index} fall into optimizer windows "
                        f"{owner[pair.sample_index]} and {w}; all K pairs of a sample must share one window "
                        "(use --train-dp-split-mode contiguous and a window size that is a multiple of K)"
                    )
    return windows


def _tile_index(window: list[TrainPair]) -> tuple[list[int], dict[int, list[TrainPair]]]:
    order: list[int] = []
    by_sample: dict[int, list[TrainPair]] = {}
    for pair in window:
        if pair.sample_index not in by_sample:
            order.append(pair.sample_index)
            by_sample[pair.sample_index] = []
        by_sample[pair.sample_index].append(pair)
    return order, by_sample


def split_micro_batches(config: RunConfig, window: list[TrainPair], family=None) -> list[list[TrainPair]]:
    """Flat `--micro-batch-size` cuts, or the 2-D `--micro-batch-size-sample` × `-tstep` tile (§5)."""
    per_sample = config.data.micro_batch_size_sample
    per_tstep = config.data.micro_batch_size_tstep
    if (per_sample is None) != (per_tstep is None):
        raise MilesUserError("--micro-batch-size-sample and --micro-batch-size-tstep must be set together")
    if per_sample is None:
        size = config.data.micro_batch_size
        if size < 1 or len(window) % size:
            raise MilesUserError(
                f"--micro-batch-size {size} must divide the {len(window)} train pairs of an optimizer window"
            )
        micro_batches = [window[i : i + size] for i in range(0, len(window), size)]
    else:
        micro_batches = _tile_micro_batches(config, window, int(per_sample), int(per_tstep))
    if family is not None:
        for index, micro_batch in enumerate(micro_batches):
            experts = {family.expert_for(pair.sigma) for pair in micro_batch}
            if len(experts) > 1:
                raise MilesUserError(
                    f"micro-batch {index} mixes denoising phases served by different experts {sorted(experts)} "
                    f"(sigmas {[round(p.sigma, 4) for p in micro_batch]}); every DiT forward runs one expert: use "
                    "--micro-batch-size 1 or a step strategy whose window stays on one side of the boundary"
                )
    return micro_batches


def _tile_micro_batches(config: RunConfig, window: list[TrainPair], per_sample: int, per_tstep: int) -> list[list[TrainPair]]:
    if per_sample < 1 or per_tstep < 1:
        raise MilesUserError("--micro-batch-size-sample and --micro-batch-size-tstep must be >= 1")
    order, by_sample = _tile_index(window)
    counts = {len(pairs) for pairs in by_sample.values()}
    if len(counts) != 1:
        raise MilesUserError(
            f"the 2-D micro-batch tile needs the same number of train pairs per sample in a window, got {sorted(counts)}"
        )
    steps_per_sample = counts.pop()
    if len(order) % per_sample or steps_per_sample % per_tstep:
        raise MilesUserError(
            f"an optimizer window holds {len(order)} samples x {steps_per_sample} timesteps, which the tile "
            f"--micro-batch-size-sample {per_sample} x --micro-batch-size-tstep {per_tstep} does not divide"
        )
    sample_chunks = [order[i : i + per_sample] for i in range(0, len(order), per_sample)]
    tstep_chunks = [range(i, i + per_tstep) for i in range(0, steps_per_sample, per_tstep)]
    if config.data.diffusion_train_iter_order == "sample_major":
        tiles = [(s, t) for s in sample_chunks for t in tstep_chunks]
    else:  # timestep_major, the flag's other choice
        tiles = [(s, t) for t in tstep_chunks for s in sample_chunks]
    return [[by_sample[s][t] for s in samples for t in tsteps] for samples, tsteps in tiles]


@dataclass
class RankTrainPlan:
    """This rank's windows of micro-batches, with Q (pairs per window on this rank) for the Σ/Q reduction."""

    windows: list[list[list[TrainPair]]]
    pairs_per_window: int
    num_pairs_total: int  # before dealing, for throughput metrics
    num_pairs_dropped: int = 0


def plan_rank_train_data(config: RunConfig, pairs: list[TrainPair], dp_rank: int, dp_size: int, family=None) -> RankTrainPlan:
    """Deal, window and cut the rollout's pairs for one DP rank."""
    mode = config.data.train_dp_split_mode
    is_nft = config.trainer.loss_type == "nft"
    if is_nft and mode != "contiguous" and dp_size > 1:
        raise MilesUserError("--loss-type nft keeps a sample's pairs in one window: use --train-dp-split-mode contiguous")
    rank_pairs = deal_to_dp_rank(pairs, dp_rank, dp_size, mode)
    num_windows = config.data.num_steps_per_rollout
    windows = split_windows(rank_pairs, num_windows, require_whole_samples=is_nft)
    micro = [split_micro_batches(config, window, family) for window in windows]
    return RankTrainPlan(
        windows=micro,
        pairs_per_window=len(windows[0]),
        num_pairs_total=len(pairs),
        num_pairs_dropped=len(pairs) % dp_size,
    )


# ---------------------------------------------------------------------------------------------------------
# collation
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainBatch:
    """A micro-batch as batched tensors; `--custom-prepare-train-batch-path` may rewrite any field."""

    pairs: list[TrainPair]
    latents: torch.Tensor  # x_k (RL) or x0 (NFT/SFT), fp32
    next_latents: torch.Tensor | None
    sigmas: torch.Tensor  # [B] fp32
    sigmas_next: torch.Tensor
    sigmas_1: torch.Tensor
    timesteps: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    loss_mask: torch.Tensor
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    debug_model_outputs: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pairs)


def _stack(tensors: list[torch.Tensor], what: str, device) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise MilesUserError(f"cannot batch {what} of different shapes {sorted(shapes)} in one micro-batch")
    return torch.stack([t.to(device=device, dtype=torch.float32) if t.is_floating_point() else t.to(device) for t in tensors])


def _scalar_rows(rows: list[list[float]], device) -> list[torch.Tensor]:
    """One row per quantity, one column per pair: the micro-batch's scalars on `device` in one copy. On CUDA it
    goes through pinned memory without waiting: a plain host-to-device copy synchronises the stream, and a sync
    before every micro-batch stops the host from queueing the next forward while the GPU still runs the last
    backward."""
    table = torch.tensor(rows, dtype=torch.float32)
    if torch.device(device).type == "cuda":
        return list(table.pin_memory().to(device, non_blocking=True).unbind(0))
    return list(table.to(device).unbind(0))


def collate(pairs: list[TrainPair], device) -> TrainBatch:
    keys = list(pairs[0].conditioning)
    key_sets = sorted({tuple(sorted(p.conditioning)) for p in pairs})
    if len(key_sets) != 1:
        raise MilesUserError(f"cannot batch samples whose conditioning holds different tensors {key_sets} in one "
                             "micro-batch (prompt rows with and without an input image?)")
    conditioning = {key: _stack([p.conditioning[key] for p in pairs], f"conditioning[{key!r}]", device) for key in keys}
    sigmas, sigmas_next, sigmas_1, timesteps, advantages, old_log_probs, loss_mask = _scalar_rows(
        [[getattr(p, name) for p in pairs] for name in
         ("sigma", "sigma_next", "sigma_1", "timestep", "advantage", "old_log_prob", "loss_mask")],
        device,
    )
    has_next = all(p.next_latents is not None for p in pairs)
    has_debug = all(p.debug_model_output is not None for p in pairs)
    return TrainBatch(
        pairs=pairs,
        latents=_stack([p.latents for p in pairs], "latents", device),
        next_latents=_stack([p.next_latents for p in pairs], "next latents", device) if has_next else None,
        sigmas=sigmas,
        sigmas_next=sigmas_next,
        sigmas_1=sigmas_1,
        timesteps=timesteps,
        advantages=advantages,
        old_log_probs=old_log_probs,
        loss_mask=loss_mask,
        conditioning=conditioning,
        debug_model_outputs=_stack([p.debug_model_output for p in pairs], "debug model outputs", device)
        if has_debug
        else None,
    )
