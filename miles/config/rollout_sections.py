"""What each built-in part of the rollout side reads, as small frozen dataclasses built once by `RunConfig.from_args`.

The sections of `sections.py` follow the CLI reference's tables (each flag in exactly one); a part of the rollout
side reads flags of several tables (the data source: the prompt file from Data, the seed from Sampling). Each class
here names exactly the values one part depends on, taken from the sections (a field keeps its flag's dest; a value
combined from several flags says so), so a reader sees a reward's or the data source's inputs in one place:

- `DataSourceConfig`: the prompt data source (miles/rollout/data_source.py);
- `SftDataConfig`: the SFT dataset and its latent cache (miles/rollout/sft_data.py);
- `RewardSelection`: which scalar a dict reward becomes (`reward_value`, miles/rollout/rm_hub); the rewards
  themselves read the `reward` section (`RewardConfig`), which holds exactly their flags;
- `EvalSetsConfig`: the eval datasets and the defaults of their settings (miles/rollout/eval_config.py);
- `StepStrategyConfig`: the built-in step strategies (miles/rollout/step_strategy_hub.py).

User hooks do not see these: they get the read-only `args` (`RunConfig.hook_args`), handed over by
miles/rollout/hooks.py, the one place that calls user code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.config.sections import (
        DataConfig,
        EvaluationConfig,
        ModelConfig,
        RewardConfig,
        RolloutConfig,
        SamplingConfig,
        TrainerConfig,
    )


@dataclass(frozen=True)
class DataSourceConfig:
    """The prompt data source: which class, which file, how its rows are read, how groups are made, ordered and
    taken back from the buffer."""

    data_source_path: str | None
    buffer_filter_path: str | None
    prompt_data: str | None
    input_key: str
    metadata_key: str
    disable_rollout_global_dataset: bool
    n_samples_per_prompt: int
    rollout_seed: int
    no_rollout_shuffle: bool


@dataclass(frozen=True)
class SftDataConfig:
    """The SFT dataset: the data file, the encoder and the cache of its latents, the output shape, the batches."""

    prompt_data: str | None
    input_key: str
    hf_checkpoint: str
    sft_encoder_checkpoint: str | None
    sft_cache_dir: str | None
    sft_frame_stride: int
    sft_encode_batch_size: int
    diffusion_height: int
    diffusion_width: int
    diffusion_output_num_frames: int
    diffusion_fps: float | None
    diffusion_forward_dtype: str
    rollout_batch_size: int
    n_samples_per_prompt: int
    rollout_seed: int
    family_source: dict[str, str | None]  # ModelConfig.family_source(): which family encodes the data


@dataclass(frozen=True)
class RewardSelection:
    """Which scalar a reward becomes for the advantages (`--reward-key`, `--reward-weights`) and for the eval
    logs (`--eval-reward-key` first)."""

    reward_key: str | None
    reward_weights: dict[str, float] | None
    eval_reward_key: str | None


@dataclass(frozen=True)
class EvalSetsConfig:
    """The eval datasets (`--eval-prompt-data` pairs or `--eval-config`) and the defaults of their settings; a
    dataset of `--eval-config` may override each default."""

    eval_prompt_data: list[str] | None  # NAME PATH pairs
    eval_config: str | None
    input_key: str  # --eval-input-key, else --input-key
    metadata_key: str
    n_samples_per_eval_prompt: int
    num_steps: int  # --diffusion-eval-num-steps, else --diffusion-num-steps
    reward_key: str | None  # --eval-reward-key, else --reward-key
    reward_weights: dict[str, float] | None


@dataclass(frozen=True)
class StepStrategyConfig:
    """The built-in step strategies: how many SDE steps, where, and which strategy the run uses."""

    diffusion_step_strategy_path: str | None
    diffusion_num_sde_steps: int
    diffusion_sde_window_range: list[int] | None
    diffusion_sde_candidate_steps: list[int] | None
    diffusion_sde_type: str
    loss_type: str
    rollout_batch_size: int
    rollout_seed: int


def rollout_parts(model: "ModelConfig", sampling: "SamplingConfig", rollout: "RolloutConfig", data: "DataConfig",
                  evaluation: "EvaluationConfig", trainer: "TrainerConfig", reward: "RewardConfig") -> dict[str, Any]:
    """The `RunConfig` fields of this module, from the sections (`RunConfig.from_args` calls it once)."""
    return dict(
        data_source=DataSourceConfig(
            data_source_path=data.data_source_path, buffer_filter_path=rollout.buffer_filter_path,
            prompt_data=data.prompt_data, input_key=data.input_key, metadata_key=data.metadata_key,
            disable_rollout_global_dataset=data.disable_rollout_global_dataset,
            n_samples_per_prompt=data.n_samples_per_prompt, rollout_seed=sampling.rollout_seed,
            no_rollout_shuffle=data.no_rollout_shuffle,
        ),
        sft_data=SftDataConfig(
            prompt_data=data.prompt_data, input_key=data.input_key, hf_checkpoint=model.hf_checkpoint,
            sft_encoder_checkpoint=data.sft_encoder_checkpoint, sft_cache_dir=data.sft_cache_dir,
            sft_frame_stride=data.sft_frame_stride, sft_encode_batch_size=data.sft_encode_batch_size,
            diffusion_height=sampling.diffusion_height, diffusion_width=sampling.diffusion_width,
            diffusion_output_num_frames=sampling.diffusion_output_num_frames, diffusion_fps=sampling.diffusion_fps,
            diffusion_forward_dtype=trainer.diffusion_forward_dtype, rollout_batch_size=data.rollout_batch_size,
            n_samples_per_prompt=data.n_samples_per_prompt, rollout_seed=sampling.rollout_seed,
            family_source=model.family_source(),
        ),
        reward_selection=RewardSelection(reward_key=reward.reward_key, reward_weights=reward.reward_weights,
                                         eval_reward_key=evaluation.eval_reward_key),
        eval_sets=EvalSetsConfig(
            eval_prompt_data=evaluation.eval_prompt_data, eval_config=evaluation.eval_config,
            input_key=evaluation.eval_input_key or data.input_key, metadata_key=data.metadata_key,
            n_samples_per_eval_prompt=evaluation.n_samples_per_eval_prompt,
            num_steps=int(evaluation.diffusion_eval_num_steps or sampling.diffusion_num_steps),
            reward_key=evaluation.eval_reward_key or reward.reward_key, reward_weights=reward.reward_weights,
        ),
        step_strategy=StepStrategyConfig(
            diffusion_step_strategy_path=sampling.diffusion_step_strategy_path,
            diffusion_num_sde_steps=sampling.diffusion_num_sde_steps,
            diffusion_sde_window_range=sampling.diffusion_sde_window_range,
            diffusion_sde_candidate_steps=sampling.diffusion_sde_candidate_steps,
            diffusion_sde_type=sampling.diffusion_sde_type, loss_type=trainer.loss_type,
            rollout_batch_size=data.rollout_batch_size, rollout_seed=sampling.rollout_seed,
        ),
    )
