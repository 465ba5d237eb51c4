"""The validated configuration as typed, frozen sections: one per concern, built once by `RunConfig.from_args`.

A section's field is named after its flag's dest (`--diffusion-noise-level` -> `SamplingConfig.diffusion_noise_level`)
and has no default of its own: every value comes from the parsed, validated namespace, whose defaults live in the
flag declarations (`miles.config.flags`, `miles.config.backend_flags`). Each flag lands in exactly one section (or in
`PARSE_ONLY`); tests/config/test_sections.py checks that. The derived values of `validate_args` (`DERIVED_ATTRIBUTES`)
sit in the section of the concern they belong to, computed once by the rules.

Each part of the program receives the config or the sections it needs: the trainer reads `config.trainer`,
`config.sampling`, ...; the LR schedule a `TrainerConfig`, the router a `RolloutConfig`, the CI check a
`LoggingConfig`; the rollout side's built-in parts the small classes of `rollout_sections.py` built here once
(`config.data_source`, `config.sft_data`, `config.eval_sets`, `config.step_strategy`, `config.reward_selection`)
and the rewards `config.reward`. User hooks keep the reference's `fn(args, ...)` signature: they get
`RunConfig.hook_args`, a read-only view of every value (the flags, the derived values, the YAML-only keys
`apply_config_file` keeps for them, `miles_router_url`), handed over by miles/rollout/hooks.py (the rollout side)
and the trainer where they are called. A built-in that keeps a hook signature because users call or subclass it
(the default rollout function `generate_rollout(args, ...)`, the default data source) reaches the typed
configuration with `run_config_of(args)`.

Lists inside a section (`rollout_patch_group`, `lora_target_modules`, ...) stay lists: the sections are frozen
against rebinding, not deep-frozen.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping

from miles.config.rollout_sections import (
    DataSourceConfig,
    EvalSetsConfig,
    RewardSelection,
    SftDataConfig,
    StepStrategyConfig,
    rollout_parts,
)

# Flags that steer parsing itself and are not read after it.
PARSE_ONLY = ("custom_config_path", "dry_run", "offload")
# Attributes `validate_args` sets that only keep the reference's names alive for hooks.
HOOK_ONLY = ("debug_train_only",)


@dataclass(frozen=True)
class ModelConfig:
    """Which pipeline is trained and served, and which of its modules (Rollout table)."""

    hf_checkpoint: str
    diffusion_model_family: str | None
    diffusion_model_family_resolved: str | None  # derived: the family key; None with train_pipeline_config_path
    train_pipeline_config_path: str | None
    model_backend_path: str | None
    update_weight_target_module: str

    def family_source(self) -> dict[str, str | None]:
        """The keyword arguments of `miles.models.common.build_train_pipeline_config` for this run."""
        return dict(
            hf_checkpoint=self.hf_checkpoint,
            diffusion_model_family=self.diffusion_model_family_resolved or self.diffusion_model_family,
            train_pipeline_config_path=self.train_pipeline_config_path,
            model_backend_path=self.model_backend_path,
        )


@dataclass(frozen=True)
class PlacementConfig:
    """Cluster shape, colocation and offload (Cluster table), with the derived world and dp sizes."""

    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int | None  # resolved: the train world size under --colocate
    rollout_num_gpus_per_engine: int
    num_gpus_per_node: int
    colocate: bool
    offload_train: bool  # resolved: True under --colocate
    offload_rollout: bool
    colocate_offload_policy: str
    overlap_rollout: bool
    rollout_prefetch: str  # resolved: on / off
    colocate_memory_margin_gb: float
    ray_address: str | None  # None: $RAY_ADDRESS, else a private Ray instance (miles.ray.placement)
    distributed_backend: str
    distributed_timeout_minutes: int
    train_world_size: int  # derived: actor_num_nodes x actor_num_gpus_per_node
    dp_size: int  # derived: train_world_size / sequence_parallel_size


@dataclass(frozen=True)
class SamplingConfig:
    """How a trajectory is sampled, shared by the engine requests and the trainer (docs/algorithms.md §2, §3)."""

    diffusion_num_steps: int
    diffusion_flow_shift: float | None
    diffusion_fps: float | None
    diffusion_output_num_frames: int
    diffusion_guidance_scale: float
    diffusion_guidance_scale_2: float | None
    diffusion_true_cfg_scale: float | None
    diffusion_negative_prompt: str | None
    diffusion_noise_level: float
    diffusion_height: int
    diffusion_width: int
    diffusion_sde_type: str
    sde_step_backend_path: str | None
    diffusion_num_sde_steps: int
    diffusion_sde_window_range: list[int] | None
    diffusion_sde_candidate_steps: list[int] | None
    diffusion_step_strategy_path: str | None
    diffusion_log_prob_no_const: bool
    diffusion_log_prob_no_const_resolved: bool  # derived: the form engine and trainer share
    diffusion_generator_device: str
    rollout_patch_group: list[str]  # resolved: the numeric-parity groups, "none" dropped
    parity_forward_tile: int  # derived: samples per DiT forward under batch_invariant, else 0
    rollout_seed: int


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout side: functions, engines, router, hooks and fault tolerance (Rollout, hooks, Fault tolerance)."""

    rollout_function_path: str
    rollout_microgroup_size: int
    over_sampling_batch_size: int | None
    sglang_server_concurrency: int
    use_distributed_post: bool
    use_miles_router: bool
    miles_router_timeout: float | None
    miles_router_max_connections: int | None
    miles_router_health_check_failure_threshold: int
    update_weight_buffer_size: int
    update_weight_transport: str
    check_weight_sync: bool
    rollout_parser_num_workers: int
    custom_generate_function_path: str | None
    dynamic_sampling_filter_path: str | None
    rollout_sample_filter_path: str | None
    buffer_filter_path: str | None
    custom_rollout_log_function_path: str | None
    custom_eval_rollout_log_function_path: str | None
    use_fault_tolerance: bool
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
    rollout_health_check_first_wait: float


@dataclass(frozen=True)
class DataConfig:
    """Prompts, batch sizes and run length (Data and batching)."""

    prompt_data: str | None
    input_key: str
    metadata_key: str
    data_source_path: str | None
    disable_rollout_global_dataset: bool
    rollout_batch_size: int  # resolved
    n_samples_per_prompt: int
    global_batch_size: int  # resolved
    num_steps_per_rollout: int  # resolved
    micro_batch_size: int  # resolved: sample x tstep when the 2D pair is set
    micro_batch_size_sample: int | None
    micro_batch_size_tstep: int | None
    diffusion_train_iter_order: str
    train_dp_split_mode: str
    num_rollout: int | None  # None until the entry point counts it from the dataset
    num_epoch: int | None
    start_rollout_id: int | None
    sft_encoder_checkpoint: str | None
    sft_frame_stride: int
    sft_cache_dir: str | None
    sft_encode_batch_size: int
    no_rollout_shuffle: bool


@dataclass(frozen=True)
class EvaluationConfig:
    """Evaluation datasets and settings (Evaluation)."""

    eval_interval: int | None
    eval_prompt_data: list[str] | None
    eval_prompt_data_pairs: list[tuple[str, str]]  # derived: [(name, path)]
    eval_config: str | None
    eval_function_path: str | None
    eval_input_key: str | None
    n_samples_per_eval_prompt: int
    diffusion_eval_num_steps: int | None
    skip_eval_before_train: bool
    eval_reward_key: str | None


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer: FSDP, optimizer and LR schedule, LoRA, EMA and the losses (Training backend, Optimizer and
    schedule, LoRA, EMA, Algorithm and loss)."""

    train_backend: str
    fsdp_master_dtype: str
    fsdp_reduce_dtype: str
    diffusion_forward_dtype: str
    fsdp_cpu_offload: bool
    fsdp_cpu_backend: str
    dp_replicate_size: int
    sequence_parallel_size: int
    ulysses_degree: int
    ulysses_degree_resolved: int  # derived: 0 resolved to the SP size
    ring_degree: int  # derived: SP / Ulysses
    fsdp_attention_backend: str | None
    fsdp_flow_shift: float | None
    gradient_checkpointing: bool
    fsdp_torch_compile: bool
    fsdp_blocks_per_unit: int
    deterministic_mode: bool
    train_env_vars: dict[str, str]
    seed: int
    optimizer: str
    lr: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float
    lr_decay_style: str
    min_lr: float
    lr_warmup_init: float
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_decay_iters: int | None
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_style: str | None
    use_checkpoint_lr_scheduler: bool  # resolved: off under --override-lr-scheduler
    override_lr_scheduler: bool
    use_lora: bool
    lora_rank: int
    lora_alpha: int
    lora_target_modules: list[str] | None
    lora_init_weights: str
    lora_ipc_weight_sync: bool
    use_ema: bool
    ema_rollout_policy: str
    ema_decay_init: float
    ema_decay_ramp: float
    ema_decay_max: float
    ema_decay_flat_steps: int
    loss_type: str
    diffusion_clip_range: float
    diffusion_adv_clip_max: float
    diffusion_recompute_old_log_prob: bool
    diffusion_rollout_gradient: bool  # each sample's ∇ℓ from the engines, no replay (miles/engine/rollout_gradients.py)
    rollout_gradient_tile: int  # the engines' samples per forward-with-backward under the flag above (0: micro-batch)
    rollout_gradient_trainer: str  # under the flag above, resolved: device / host (where the trainer runs); else auto
    rollout_gradient_engine_step: str  # auto / off: the engine takes the host trainer's AdamW step too (adapter_step.py)
    diffusion_kl_beta: float
    ref_mode: str  # resolved: none / lora_base / ema (docs/algorithms.md §5, §6, §8)
    custom_prepare_train_batch_path: str | None
    custom_loss_function_path: str | None
    custom_convert_samples_to_train_data_path: str | None
    custom_expand_samples_to_train_pairs_path: str | None
    diffusion_nft_beta: float
    diffusion_nft_timestep_fraction: float
    no_diffusion_nft_adaptive_weight: bool
    no_diffusion_nft_shuffle_timesteps: bool

    @property
    def on_host(self) -> bool:
        """The trainer process runs on the CPU whatever GPUs there are (`--rollout-gradient-trainer host`)."""
        return self.diffusion_rollout_gradient and self.rollout_gradient_trainer == "host"


@dataclass(frozen=True)
class RewardConfig:
    """Rewards and the advantages made from them (Reward, and the advantage flags of Algorithm and loss)."""

    rm_type: str | None
    rm_url: str | None
    rm_timeout: float
    rm_max_retries: int
    reward_weights: dict[str, float] | None
    reward_key: str | None
    group_rm: bool
    custom_rm_path: str | None
    custom_reward_post_process_path: str | None
    colocate_reward: bool
    pickscore_model_path: str | None
    pickscore_processor_path: str | None
    pickscore_num_workers: int
    pickscore_num_gpus_per_worker: float
    pickscore_batch_size: int
    pickscore_num_frames: int | None
    clipscore_model_path: str | None
    aesthetic_model_path: str | None
    aesthetic_head_path: str | None
    clip_reward_num_workers: int
    clip_reward_num_gpus_per_worker: float
    clip_reward_batch_size: int
    vlm_judge_url: str | None
    vlm_judge_model: str | None
    vlm_judge_prompt: str
    vlm_judge_api_key_env: str
    vlm_judge_max_concurrency: int
    geneval_url: str | None
    ocr_num_workers: int
    advantage_estimator: str
    disable_grpo_std_normalization: bool  # resolved: on when n_samples_per_prompt is 1
    globalize_reward_mean: bool
    globalize_reward_std: bool


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, resuming and exporting (Checkpointing)."""

    save: str | None
    save_interval: int | None
    save_keep_latest: int | None
    no_save_optim: bool
    load: str | None
    ckpt_step: int | None
    no_load_optim: bool
    no_load_rng: bool
    export_interval: int | None


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics, wandb, TensorBoard, the dashboard and the CI metric check (Logging, CI)."""

    output_dir: str
    metrics_path: str  # resolved: <output-dir>/metrics.jsonl when unset
    use_wandb: bool
    wandb_project: str | None
    wandb_group: str | None
    wandb_run_id: str | None
    wandb_team: str | None
    wandb_host: str | None
    wandb_key: str | None
    wandb_mode: str | None
    wandb_dir: str | None
    disable_wandb_random_suffix: bool
    wandb_log_num_images: int
    wandb_log_image_interval: int
    use_tensorboard: bool
    plot_interval: int
    use_miles_dashboard: bool
    miles_dashboard_workspace: str
    ci_test: bool
    ci_metric_checker_key: str | None
    ci_metric_checker_threshold: float | None


@dataclass(frozen=True)
class DebugConfig:
    """Debugging modes and dumps (Debugging)."""

    debug_rollout_only: bool
    train_only: bool  # resolved: on with --load-debug-rollout-data
    debug_skip_optimizer_step: bool
    save_debug_rollout_data: str | None  # resolved under --dump-details
    load_debug_rollout_data: str | None
    load_debug_rollout_data_subsample: float | None
    save_debug_train_data: str | None
    dump_details: str | None
    diffusion_debug_mode: bool


@dataclass(frozen=True)
class EngineConfig:
    """The `--sglang-*` passthrough: its values by engine `ServerArgs` field name (None dropped: the engine keeps
    its own default). Their defaults are the `ServerArgs` field defaults, declared once in miles/engine/."""

    passthrough: dict[str, Any]

    @staticmethod
    def flag_dests() -> tuple[str, ...]:
        from miles.engine.server_args import SET_BY_MILES, ServerArgs

        return tuple(f"sglang_{f.name}" for f in fields(ServerArgs) if f.name not in SET_BY_MILES)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "placement": PlacementConfig,
    "sampling": SamplingConfig,
    "rollout": RolloutConfig,
    "data": DataConfig,
    "evaluation": EvaluationConfig,
    "trainer": TrainerConfig,
    "reward": RewardConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "debug": DebugConfig,
}


# The sections `rollout_sections.rollout_parts` gathers the rollout side's parts from.
ROLLOUT_PART_SOURCES = ("model", "sampling", "rollout", "data", "evaluation", "trainer", "reward")


def _section(cls: type, values: Mapping[str, Any]) -> Any:
    return cls(**{f.name: values[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class RunConfig:
    """Every section of one run, built once from the validated namespace (`from_args`)."""

    model: ModelConfig
    placement: PlacementConfig
    sampling: SamplingConfig
    rollout: RolloutConfig
    data: DataConfig
    evaluation: EvaluationConfig
    trainer: TrainerConfig
    reward: RewardConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    debug: DebugConfig
    engine: EngineConfig
    # What each built-in part of the rollout side reads, gathered from the sections above (rollout_sections.py).
    data_source: DataSourceConfig
    sft_data: SftDataConfig
    reward_selection: RewardSelection
    eval_sets: EvalSetsConfig
    step_strategy: StepStrategyConfig
    # Every value of the namespace (flags, derived values, YAML-only keys for hooks); read it through `hook_args`.
    values: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunConfig":
        """The sections of a namespace that went through `validate_args` (`parse_args` does both)."""
        values = dict(vars(args))
        engine_dests = EngineConfig.flag_dests()
        required = {f.name for section in SECTIONS.values() for f in fields(section)} | set(engine_dests)
        missing = sorted(required - set(values))
        if missing:
            raise ValueError(f"not a validated namespace: missing {missing} (build it with parse_args)")
        passthrough = {dest.removeprefix("sglang_"): values[dest] for dest in engine_dests if values[dest] is not None}
        sections = {name: _section(section, values) for name, section in SECTIONS.items()}
        parts = rollout_parts(**{name: sections[name] for name in ROLLOUT_PART_SOURCES})
        return cls(**sections, engine=EngineConfig(passthrough=passthrough), **parts, values=values)

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with flag values changed (by dest), each routed to its section; the hook view follows. The values
        are taken as given: the validation rules do not run again (tests, and values known only at run time)."""
        values = {**self.values, **changes}
        return RunConfig.from_args(argparse.Namespace(**values))

    @property
    def router_url(self) -> str | None:
        """The miles router's URL, known once the engines started (`with_router_url`); None before."""
        return self.values.get(ROUTER_URL_KEY)

    def with_router_url(self, url: str) -> "RunConfig":
        """This config once the router runs; hooks see it as `args.miles_router_url`, as in the reference."""
        return dataclasses.replace(self, values={**self.values, ROUTER_URL_KEY: url})

    @property
    def hook_args(self) -> "HookArgs":
        """The `args` user hooks receive (the reference's `fn(args, ...)`): every value, read-only."""
        return HookArgs(self)


ROUTER_URL_KEY = "miles_router_url"  # a run-time value, not a flag: set by the rollout manager


class HookArgs:
    """What a hook gets as `args`: a read-only namespace over every value of the run (flags, derived values,
    YAML-only keys, `miles_router_url`): `args.rollout_batch_size`, `getattr(args, "key", None)` and
    `vars(args)` work as on the reference's namespace; assigning raises. The built-in implementations of a hook
    signature (the default rollout function, step strategies, rewards) read the typed sections through
    `run_config_of(args)`."""

    __slots__ = ("_config",)

    def __init__(self, config: RunConfig):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_config").values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def __dict__(self) -> Mapping[str, Any]:  # type: ignore[override] # vars(args)
        return MappingProxyType(object.__getattribute__(self, "_config").values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"args is read-only in a hook (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"args is read-only in a hook (tried to delete {name!r})")

    def __contains__(self, name: str) -> bool:
        return name in object.__getattribute__(self, "_config").values

    def __repr__(self) -> str:
        return f"HookArgs({len(object.__getattribute__(self, '_config').values)} values)"

    def __reduce__(self):
        return HookArgs, (object.__getattribute__(self, "_config"),)


def run_config_of(args: HookArgs | RunConfig) -> RunConfig:
    """The typed configuration behind the `args` a hook received (a RunConfig passes through)."""
    if isinstance(args, RunConfig):
        return args
    if isinstance(args, HookArgs):
        return object.__getattribute__(args, "_config")
    raise TypeError(f"expected the run's HookArgs or RunConfig, got {type(args).__name__}; build one with "
                    "miles.config.sections.RunConfig.from_args (tests: miles.testing.config)")
