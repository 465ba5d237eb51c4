"""The command line: value parsing, one test per validation rule (error text names the flags), the YAML
override, derived values, --dry-run, and the entry point's exit status 2 with a one-line message."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import arguments, validation
from miles.config.arguments import (
    build_parser,
    check_user_paths,
    format_dry_run,
    parse_args,
    validate_args,
)
from miles.utils.errors import MilesUserError

REPO = Path(__file__).resolve().parents[2]

BASE = [
    "--hf-checkpoint", "org/sd3-tiny",
    "--prompt-data", "prompts.jsonl",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "2",
    "--num-rollout", "1",
    "--actor-num-gpus-per-node", "1",
]


@pytest.fixture(autouse=True)
def _no_family_env(monkeypatch):
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY", raising=False)


def parse(*extra: str, base: list[str] = BASE):
    return parse_args([*base, *extra])


def error(*extra: str, base: list[str] = BASE) -> str:
    with pytest.raises(MilesUserError) as info:
        parse(*extra, base=base)
    message = str(info.value)
    assert "\n" not in message
    return message


def without(flag: str, argv: list[str] = BASE) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


# ---- parsing ---------------------------------------------------------------------------------------------
def test_minimal_command_line_resolves_defaults_and_derived_values():
    args = parse()
    assert args.global_batch_size == 8 and args.num_steps_per_rollout == 1
    assert args.diffusion_model_family_resolved == "sd3"
    assert args.dp_size == 1 and args.train_world_size == 1
    assert args.offload_train is False and args.offload_rollout is False
    assert args.ref_mode == "none"
    assert args.use_miles_router is True
    assert args.metrics_path == os.path.join("outputs/miles", "metrics.jsonl")
    assert args.update_weight_buffer_size == 512 * 1024 * 1024
    assert args.train_env_vars == {}


def test_raw_parser_defaults_for_tri_states_and_negative_flags():
    raw = build_parser().parse_args([])
    assert raw.offload_train is None and raw.offload_rollout is None
    assert raw.no_save_optim is False and raw.no_load_optim is False and raw.no_load_rng is False
    assert raw.no_diffusion_nft_adaptive_weight is False and raw.no_diffusion_nft_shuffle_timesteps is False
    assert raw.use_checkpoint_lr_scheduler is True
    flipped = build_parser().parse_args(["--no-offload-train", "--offload-rollout", "--no-use-checkpoint-lr-scheduler"])
    assert flipped.offload_train is False and flipped.offload_rollout is True
    assert flipped.use_checkpoint_lr_scheduler is False


def test_legacy_alias_and_offload_expansion():
    raw = build_parser().parse_args(["--debug-train-only", "--offload"])
    assert raw.train_only is True
    assert raw.offload_train is True and raw.offload_rollout is True
    args = parse("--debug-train-only", "--offload")
    assert args.train_only and args.debug_train_only and args.offload_train and args.offload_rollout


def test_list_valued_flags_parse():
    args = parse(
        "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "3,5",
        "--diffusion-sde-candidate-steps", "1, 2,3",
        "--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl", "--eval-prompt-data", "c", "c.jsonl",
        "--lora-target-modules", "to_q", "to_k",
        "--rollout-patch-group", "sgld, ltx",
        "--train-env-vars", '{"NCCL_DEBUG": "INFO", "N": 3}',
        "--update-weight-buffer-size", "64MiB",
        "--sde-step-backend-path", "my.backend.Cls",
        "--fsdp-attention-backend", "native",
        "--ci-test", "--ci-metric-checker-key", "train/loss", "--ci-metric-checker-threshold", "0.5",
        "--sglang-max-batch-size", "4", "--sglang-enable-torch-compile",
    )
    assert args.diffusion_sde_window_range == [3, 5]
    assert args.diffusion_sde_candidate_steps == [1, 2, 3]
    assert args.eval_prompt_data_pairs == [("a", "a.jsonl"), ("b", "b.jsonl"), ("c", "c.jsonl")]
    assert args.lora_target_modules == ["to_q", "to_k"]
    assert args.rollout_patch_group == ["sgld", "ltx"]
    assert args.train_env_vars == {"NCCL_DEBUG": "INFO", "N": "3"}
    assert args.update_weight_buffer_size == 64 * 1024 * 1024
    assert args.ci_test and args.ci_metric_checker_key == "train/loss" and args.ci_metric_checker_threshold == 0.5
    assert args.sglang_max_batch_size == 4 and args.sglang_enable_torch_compile is True


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--diffusion-sde-window-range", "3"], "--diffusion-sde-window-range: expected two integers 'lo,hi'"),
        (["--diffusion-sde-window-range", "a,b"], "--diffusion-sde-window-range: expected two integers"),
        (["--diffusion-sde-candidate-steps", "1,x"], "--diffusion-sde-candidate-steps: expected comma-separated"),
        (["--train-env-vars", "{bad"], "--train-env-vars: not valid JSON"),
        (["--train-env-vars", "[1]"], "--train-env-vars: expected a JSON object"),
        (["--update-weight-buffer-size", "lots"], "--update-weight-buffer-size: expected a byte count"),
        (["--lr", "nan"], "--lr: expected a finite number"),
        (["--rollout-batch-size", "four"], "--rollout-batch-size: invalid int value"),
        (["--loss-type", "dpo"], "--loss-type: invalid choice"),
        (["--wandb-mode", "cloud"], "--wandb-mode: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--sglang-model-path", "x"], "unrecognized arguments: --sglang-model-path"),
        (["--rollout-batch"], "unrecognized arguments: --rollout-batch"),
        (["--rollout-bach-size", "4"], "did you mean --rollout-batch-size for --rollout-bach-size?"),
    ],
)
def test_argparse_errors_become_one_line_user_errors(argv, needle):
    assert needle in error(*argv)


def test_every_fsdp_args_field_is_a_flag():
    import dataclasses

    from miles.config.backend_flags import FSDPArgs
    from miles.config.sections import RunConfig

    options = build_parser()._option_string_actions
    for fld in dataclasses.fields(FSDPArgs):
        assert "--" + fld.name.replace("_", "-") in options, fld.name
    typed = RunConfig.from_args(parse("--lr", "3e-5", "--use-lora")).trainer  # the typed view the trainer gets
    assert typed.lr == 3e-5 and typed.use_lora is True


def test_sglang_passthrough_skips_what_miles_sets():
    from miles.engine.server_args import SET_BY_MILES, ServerArgs
    import dataclasses

    options = build_parser()._option_string_actions
    for fld in dataclasses.fields(ServerArgs):
        flag = "--sglang-" + fld.name.replace("_", "-")
        assert (flag in options) == (fld.name not in SET_BY_MILES), flag


# ---- validation: one test per rule -------------------------------------------------------------------------
def test_hf_checkpoint_required():
    assert "--hf-checkpoint is required" in error(base=without("--hf-checkpoint"))


def test_batch_invariant_derives_the_unset_knob():
    args = parse("--num-steps-per-rollout", "2")
    assert (args.global_batch_size, args.num_steps_per_rollout) == (4, 2)
    args = parse("--global-batch-size", "2")
    assert (args.global_batch_size, args.num_steps_per_rollout) == (2, 4)


def test_batch_invariant_contradiction_aborts():
    message = error("--global-batch-size", "4", "--num-steps-per-rollout", "3")
    assert "--global-batch-size 4 x --num-steps-per-rollout 3 = 12" in message
    assert "--rollout-batch-size 4 x --n-samples-per-prompt 2 = 8" in message


def test_batch_invariant_divisibility():
    assert "is not divisible by --global-batch-size 3" in error("--global-batch-size", "3")
    assert "is not divisible by --num-steps-per-rollout 3" in error("--num-steps-per-rollout", "3")


def test_global_batch_size_divisible_by_dp_size():
    message = error("--actor-num-gpus-per-node", "4", "--global-batch-size", "2")
    assert "--global-batch-size 2 must be divisible by dp_size 4" in message


def test_dp_size_uses_sequence_parallel_size():
    args = parse("--actor-num-gpus-per-node", "4", "--sequence-parallel-size", "2", "--global-batch-size", "2")
    assert args.dp_size == 2 and args.ulysses_degree_resolved == 2 and args.ring_degree == 1
    assert "--sequence-parallel-size 3 must divide the train world size 4" in error(
        "--actor-num-gpus-per-node", "4", "--sequence-parallel-size", "3")
    assert "--dp-replicate-size 3 must divide dp_size 4" in error(
        "--actor-num-gpus-per-node", "4", "--dp-replicate-size", "3")


def test_ulysses_degree_must_divide_sequence_parallel_size():
    assert "--sequence-parallel-size 4 must be divisible by --ulysses-degree 3" in error(
        "--actor-num-gpus-per-node", "4", "--sequence-parallel-size", "4", "--ulysses-degree", "3")


def test_ring_degree_needs_torch_2_11(monkeypatch):
    ring = ("--actor-num-gpus-per-node", "4", "--sequence-parallel-size", "4", "--ulysses-degree", "2",
            "--global-batch-size", "8")
    monkeypatch.setattr(validation, "_torch_version", lambda: (2, 10))
    assert "ring degree 2" in error(*ring) and "needs torch >= 2.11" in error(*ring)
    monkeypatch.setattr(validation, "_torch_version", lambda: (2, 11))
    assert parse(*ring).ring_degree == 2


def test_micro_batch_tile_set_together_and_replaces_flat_size():
    assert "--micro-batch-size-sample 2 and --micro-batch-size-tstep None must be set together" in error(
        "--micro-batch-size-sample", "2")
    assert parse("--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "2",
                 "--diffusion-num-sde-steps", "2").micro_batch_size == 4


def test_micro_batch_must_divide_pairs_per_rank_per_step():
    # 8 samples x 2 trained steps / 1 rank / 1 step = 16 pairs; 3 does not divide it.
    message = error("--diffusion-num-sde-steps", "2", "--micro-batch-size", "3")
    assert "--micro-batch-size 3 must divide the 16 train pairs" in message


def test_colocate_forces_rollout_gpus_and_offload():
    args = parse("--colocate", "--actor-num-gpus-per-node", "2")
    assert args.rollout_num_gpus == 2 and args.offload_train is True and args.offload_rollout is True


def test_colocate_rejects_explicit_no_offload():
    assert "--colocate needs --offload-train" in error("--colocate", "--no-offload-train")
    assert "remove --no-offload-rollout" in error("--colocate", "--no-offload-rollout")


def test_colocate_rejects_other_rollout_gpu_count():
    assert "--rollout-num-gpus is 3" in error("--colocate", "--rollout-num-gpus", "3")


def test_engine_size_fits_a_node():
    assert "--rollout-num-gpus-per-engine 4 exceeds --num-gpus-per-node 2" in error(
        "--rollout-num-gpus-per-engine", "4", "--num-gpus-per-node", "2")


def test_engine_parallel_mode_is_checked_at_launch():
    gpus = ("--num-gpus-per-node", "8", "--diffusion-model-family", "sd3")
    assert "CFG-parallel and sequence parallel in one engine are not implemented" in error(
        *gpus, "--rollout-num-gpus-per-engine", "4", "--sglang-ulysses-degree", "2")
    assert "a sequence-parallel degree needs that many GPUs" in error(*gpus, "--sglang-ulysses-degree", "2")
    parse(*gpus, "--rollout-num-gpus-per-engine", "4", "--sglang-ulysses-degree", "4")


def test_nft_geometry_counts_trained_sigmas():
    args = parse("--loss-type", "nft", "--use-ema", "--diffusion-sde-type", "ode", "--diffusion-noise-level", "0",
                 "--diffusion-num-steps", "100", "--diffusion-nft-timestep-fraction", "0.29")
    assert arguments.trained_steps_per_trajectory(args)[0] == 29


def test_colocate_reward_needs_colocate():
    assert "--colocate-reward needs --colocate" in error("--colocate-reward")
    assert parse("--colocate-reward", "--colocate").colocate_reward
    pickscore = ["--rm-type", "pickscore", "--pickscore-model-path", "m", "--pickscore-processor-path", "p"]
    assert parse("--colocate-reward", "--colocate", *pickscore).colocate_reward


def test_weight_sync_transport_and_check_flags():
    assert parse().update_weight_transport == "auto" and not parse().check_weight_sync
    assert parse("--update-weight-transport", "broadcast", "--check-weight-sync").update_weight_transport == "broadcast"
    assert "--update-weight-transport" in error("--update-weight-transport", "nccl")
    message = error("--check-weight-sync", "--use-lora", "--lora-ipc-weight-sync")
    assert "--check-weight-sync" in message and "--lora-ipc-weight-sync" in message and "\n" not in message.strip()


def test_lora_ipc_weight_sync_needs_use_lora():
    assert "--lora-ipc-weight-sync needs --use-lora" in error("--lora-ipc-weight-sync")
    assert parse("--lora-ipc-weight-sync", "--use-lora").lora_ipc_weight_sync


def test_lora_rank_and_alpha_positive():
    assert "--lora-rank must be > 0, got 0" in error("--lora-rank", "0")
    assert "--lora-alpha must be > 0, got -1" in error("--lora-alpha", "-1")


def test_pickscore_needs_both_paths():
    message = error("--rm-type", "pickscore", "--pickscore-model-path", "m")
    assert "--pickscore-model-path and --pickscore-processor-path" in message
    assert parse("--rm-type", "pickscore", "--pickscore-model-path", "m", "--pickscore-processor-path", "p")


def test_remote_rm_needs_url():
    assert "--rm-type remote_rm needs --rm-url" in error("--rm-type", "remote_rm")
    assert parse("--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:9/score").rm_url


def test_use_ema_needs_a_consumer():
    assert "--use-ema has no consumer" in error("--use-ema")
    assert parse("--use-ema", "--ema-rollout-policy", "ema").use_ema
    assert parse("--use-ema", "--ref-mode", "ema").ref_mode == "ema"


def test_ema_consumers_need_use_ema():
    assert "--ema-rollout-policy ema needs --use-ema" in error("--ema-rollout-policy", "ema")
    assert "--ref-mode ema needs --use-ema" in error("--ref-mode", "ema")


def test_ref_mode_auto_rules():
    assert parse("--diffusion-kl-beta", "0.04", "--use-lora").ref_mode == "lora_base"
    nft = ("--loss-type", "nft", "--diffusion-sde-type", "ode", "--diffusion-noise-level", "0")
    assert parse(*nft, "--use-ema").ref_mode == "ema"
    assert parse(*nft, "--use-lora").ref_mode == "lora_base"  # no EMA: v_old falls back to the LoRA base
    assert "--loss-type nft needs a reference policy" in error(*nft)
    assert "--ref-mode lora_base" in error("--diffusion-kl-beta", "0.04")  # auto lora_base without LoRA
    assert "needs --use-lora" in error("--ref-mode", "lora_base")
    assert "--diffusion-kl-beta 0.04 needs a reference policy" in error("--diffusion-kl-beta", "0.04",
                                                                         "--ref-mode", "none")


def test_train_pipeline_config_path_excludes_family():
    message = error("--train-pipeline-config-path", "my.pkg.Config", "--diffusion-model-family", "sd3")
    assert "--train-pipeline-config-path" in message and "--diffusion-model-family" in message
    args = parse("--train-pipeline-config-path", "my.pkg.Config", "--hf-checkpoint", "/weights/unnamed")
    assert args.diffusion_model_family_resolved is None


def test_family_resolution_order(monkeypatch, tmp_path):
    assert parse("--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B").diffusion_model_family_resolved == "wan2_2"
    monkeypatch.setenv("MILES_DIFFUSION_MODEL_FAMILY", "flux")
    assert parse("--hf-checkpoint", "/weights/unnamed").diffusion_model_family_resolved == "flux"
    assert parse("--diffusion-model-family", "ltx").diffusion_model_family_resolved == "ltx"
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY")
    unnamed = tmp_path / "weights"  # a pipeline folder whose class and name say no family
    unnamed.mkdir()
    (unnamed / "model_index.json").write_text('{"_class_name": "MyPipeline"}')
    assert "pass --diffusion-model-family" in error("--hf-checkpoint", str(unnamed))
    assert "no such folder" in error("--hf-checkpoint", "/weights/unnamed")  # not the family it cannot tell
    assert "'nope' is not a registered family" in error("--diffusion-model-family", "nope")


def test_over_sampling_batch_size_covers_the_rollout_batch():
    assert "--over-sampling-batch-size 2 must be >= --rollout-batch-size 4" in error(
        "--over-sampling-batch-size", "2")
    assert parse("--over-sampling-batch-size", "8").over_sampling_batch_size == 8


def test_save_interval_needs_save():
    assert "--save-interval 2 needs --save" in error("--save-interval", "2")
    assert "--save-keep-latest 3 needs --save" in error("--save-keep-latest", "3")


def test_eval_interval_needs_eval_datasets():
    assert "--eval-interval 5 needs eval datasets" in error("--eval-interval", "5")
    assert parse("--eval-interval", "5", "--eval-config", "eval.yaml").eval_interval == 5


def test_eval_prompt_data_pairs():
    assert "odd count" in error("--eval-prompt-data", "a", "a.jsonl", "b")
    assert "repeats a dataset name" in error("--eval-prompt-data", "a", "x.jsonl", "a", "y.jsonl")


def test_policy_loss_needs_stochastic_steps():
    assert "--diffusion-sde-type ode has no log-prob" in error("--diffusion-sde-type", "ode")
    assert "--diffusion-noise-level > 0, got 0" in error("--diffusion-noise-level", "0")


def test_nft_rejects_recompute_and_nonpositive_beta():
    nft = ("--loss-type", "nft", "--use-ema", "--diffusion-sde-type", "ode")
    assert "--diffusion-recompute-old-log-prob only applies to --loss-type policy_loss, not nft" in error(
        *nft, "--diffusion-recompute-old-log-prob")
    assert "--diffusion-nft-beta must be > 0" in error(*nft, "--diffusion-nft-beta", "0")


def test_recompute_old_log_prob_only_with_policy_loss():
    sft = ("--loss-type", "sft_loss")
    assert "not sft_loss" in error(*sft, "--diffusion-recompute-old-log-prob")
    assert parse("--diffusion-recompute-old-log-prob").diffusion_recompute_old_log_prob


def test_custom_loss_type_and_path_go_together():
    assert "--loss-type custom_loss and --custom-loss-function-path go together" in error(
        "--loss-type", "custom_loss")
    assert "--custom-loss-function-path 'my.loss'" in error("--custom-loss-function-path", "my.loss")
    assert parse("--loss-type", "custom_loss", "--custom-loss-function-path", "my.loss").loss_type == "custom_loss"


def test_sft_encoder_checkpoint_only_with_sft():
    assert "--sft-encoder-checkpoint only applies to --loss-type sft_loss" in error(
        "--sft-encoder-checkpoint", "enc")


def test_candidate_steps_required_by_epoch_global_random_choice():
    strategy = ("--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.epoch_global_random_choice",
                "--diffusion-num-sde-steps", "2")
    assert "requires --diffusion-sde-candidate-steps" in error(*strategy)
    assert "has duplicates" in error(*strategy, "--diffusion-sde-candidate-steps", "1,1,2")
    assert "must lie in [0, --diffusion-num-steps 10)" in error(*strategy, "--diffusion-sde-candidate-steps", "1,10")
    args = parse(*strategy, "--diffusion-sde-candidate-steps", "1,2,3")
    assert arguments.trained_steps_per_trajectory(args)[0] == 2
    args = parse(*strategy[:2], "--diffusion-sde-candidate-steps", "1,2,3")  # K = 0: every candidate
    assert arguments.trained_steps_per_trajectory(args)[0] == 3


def test_sde_window_range_rules():
    assert "--diffusion-sde-window-range 5,5 must satisfy 0 <= lo < hi" in error(
        "--diffusion-sde-window-range", "5,5")
    assert "--diffusion-sde-window-range 0,11 must satisfy" in error("--diffusion-sde-window-range", "0,11")
    assert "--diffusion-num-sde-steps 3 must be <= the window size 2" in error(
        "--diffusion-num-sde-steps", "3", "--diffusion-sde-window-range", "3,5")
    assert "--diffusion-num-sde-steps 11 must be <= the window size 10" in error("--diffusion-num-sde-steps", "11")
    assert parse("--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "3,5").diffusion_num_sde_steps == 2
    assert "needs --diffusion-num-sde-steps >= 1" in error(
        "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window")


def test_ode_and_return_last_trains_nothing_under_policy_loss():
    assert "records no SDE step" in error(
        "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.ode_and_return_last")


def test_override_lr_scheduler_wins_over_default_checkpoint_scheduler():
    assert parse().use_checkpoint_lr_scheduler is True
    args = parse("--override-lr-scheduler")
    assert args.override_lr_scheduler is True and args.use_checkpoint_lr_scheduler is False


def test_lr_schedule_rules():
    assert "--min-lr 0.1 must be <= --lr 0.01" in error("--lr", "0.01", "--min-lr", "0.1")
    assert "--lr-decay-style WSD needs --lr-wsd-decay-iters" in error("--lr-decay-style", "WSD")
    assert "--lr-warmup-iters 10 must be < --lr-decay-iters 10" in error(
        "--lr-warmup-iters", "10", "--lr-decay-iters", "10")


def test_num_rollout_or_num_epoch(caplog):
    no_rollout = without("--num-rollout")
    assert parse(base=no_rollout).num_rollout is None  # one epoch of --prompt-data, counted by the data source
    assert parse("--num-epoch", "2", base=no_rollout).num_epoch == 2
    with caplog.at_level(logging.WARNING, logger="miles.utils"):
        args = parse("--num-epoch", "2")
    assert args.num_epoch is None and args.num_rollout == 1
    assert any("--num-epoch is ignored" in r.getMessage() for r in caplog.records)
    no_data = without("--prompt-data", no_rollout)
    assert "--num-epoch 2 counts passes over --prompt-data" in error(
        "--num-epoch", "2", "--disable-rollout-global-dataset", base=no_data)
    assert "set --num-rollout N" in error("--disable-rollout-global-dataset", base=no_rollout)


def test_rollout_batch_size_required_unless_train_only_sft():
    no_rbs = without("--rollout-batch-size")
    assert "--rollout-batch-size is required" in error(base=no_rbs)
    args = parse("--train-only", "--loss-type", "sft_loss", "--global-batch-size", "4", base=no_rbs)
    assert args.rollout_batch_size == 2 and args.num_steps_per_rollout == 1
    assert "needs --global-batch-size" in error("--train-only", "--loss-type", "sft_loss", base=no_rbs)


def test_prompt_data_required_for_rl():
    no_data = without("--prompt-data")
    assert "--prompt-data is required for --loss-type policy_loss" in error(base=no_data)
    assert parse("--disable-rollout-global-dataset", base=no_data).prompt_data is None
    args = parse("--load-debug-rollout-data", "dump/{rollout_id}.pt", base=no_data)
    assert args.train_only is True
    assert parse("--loss-type", "sft_loss", base=no_data).loss_type == "sft_loss"


def test_rollout_only_and_train_only_exclusive():
    assert "--debug-rollout-only and --train-only" in error("--debug-rollout-only", "--train-only")


def test_guidance_scale_2_required_when_training_transformer_2():
    wan = ("--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B", "--update-weight-target-module", "transformer,transformer_2")
    assert "set --diffusion-guidance-scale-2" in error(*wan)
    assert parse(*wan, "--diffusion-guidance-scale-2", "3.0").diffusion_guidance_scale_2 == 3.0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lr", "-1e-6"], "--lr must be >= 0, got -1e-06"),
        (["--diffusion-clip-range", "0"], "--diffusion-clip-range must be > 0"),
        (["--diffusion-noise-level", "-0.1"], "--diffusion-noise-level must be >= 0"),
        (["--diffusion-height", "500"], "--diffusion-height must be a multiple of 16, got 500"),
        (["--diffusion-width", "8"], "--diffusion-width must be >= 16"),
        (["--wandb-log-image-interval", "0"], "--wandb-log-image-interval must be >= 1"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1"),
        (["--adam-beta2", "1"], "--adam-beta2 must be < 1"),
        (["--diffusion-nft-timestep-fraction", "1.5"], "--diffusion-nft-timestep-fraction must be <= 1"),
    ],
)
def test_nonsense_values_rejected(argv, needle):
    assert needle in error(*argv)


def test_wandb_mode_choices():
    assert parse("--wandb-mode", "offline").wandb_mode == "offline"


def test_log_prob_no_const_resolution():
    assert parse().diffusion_log_prob_no_const_resolved is False
    assert parse("--diffusion-sde-type", "cps").diffusion_log_prob_no_const_resolved is True
    assert parse("--diffusion-log-prob-no-const").diffusion_log_prob_no_const_resolved is True


def test_single_sample_groups_force_dr_grpo():
    args = parse("--n-samples-per-prompt", "1", "--globalize-reward-mean")
    assert args.disable_grpo_std_normalization is True


def test_dump_details_fills_debug_paths():
    args = parse("--dump-details", "dump")
    assert args.save_debug_rollout_data == os.path.join("dump", "rollout_data", "{rollout_id}.pt")
    assert parse("--dump-details", "d", "--save-debug-rollout-data", "x").save_debug_rollout_data == "x"


def test_validate_args_is_idempotent():
    args = parse("--colocate", "--diffusion-kl-beta", "0.01", "--use-lora", "--micro-batch-size-sample", "2",
                 "--micro-batch-size-tstep", "1", "--global-batch-size", "4")
    before = dict(vars(args))
    validate_args(args)
    assert vars(args) == before


# ---- dotted paths and data files (checked by the entry point, after parsing) ------------------------------
def test_check_user_paths(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"input": "a cat"}\n')
    base = [*without("--prompt-data"), "--prompt-data", str(data), "--rm-type", "brightness"]
    check_user_paths(parse(base=base))  # the defaults point at project modules and are not imported here
    with pytest.raises(MilesUserError, match="--custom-rm-path 'os.path.join': must be an async function"):
        check_user_paths(parse("--custom-rm-path", "os.path.join", base=base))
    with pytest.raises(MilesUserError, match="--custom-rm-path 'no_such_pkg.rm'"):
        check_user_paths(parse("--custom-rm-path", "no_such_pkg.rm", base=base))
    with pytest.raises(MilesUserError, match="--buffer-filter-path 'os.path.no_such_fn'.*no attribute"):
        check_user_paths(parse("--buffer-filter-path", "os.path.no_such_fn", base=base))
    with pytest.raises(MilesUserError, match="--prompt-data .*missing.jsonl': no such file"):
        check_user_paths(parse("--prompt-data", str(tmp_path / "missing.jsonl")))


# ---- --custom-config-path ---------------------------------------------------------------------------------
def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_overrides_with_one_warning_per_collision(tmp_path, caplog):
    path = write_yaml(tmp_path, "lr: 1e-4\nrollout-batch-size: 8\ndiffusion_sde_window_range: [0, 4]\n"
                                "my_extra_knob: 3\ndebug_train_only: true\n")
    with caplog.at_level(logging.WARNING, logger="miles.utils"):
        args = parse("--lr", "2e-5", "--custom-config-path", path)
    assert args.lr == 1e-4  # YAML wins, and "1e-4" (a string to YAML) is parsed as the flag's float
    assert args.rollout_batch_size == 8 and args.global_batch_size == 16  # derived values use the final values
    assert args.diffusion_sde_window_range == [0, 4]
    assert args.my_extra_knob == 3 and args.train_only is True
    messages = [r.getMessage() for r in caplog.records]
    overrides = [m for m in messages if "' overrides --" in m]
    assert len(overrides) == 4
    assert any("'lr' overrides --lr (2e-05 -> 0.0001)" in m for m in overrides)
    assert sum("'my_extra_knob' is not a miles flag" in m for m in messages) == 1


def test_yaml_values_are_validated(tmp_path):
    path = write_yaml(tmp_path, "global_batch_size: 3\n")
    assert "is not divisible by --global-batch-size 3" in error("--custom-config-path", path)
    path = write_yaml(tmp_path, "lora_ipc_weight_sync: true\n")
    assert "--lora-ipc-weight-sync needs --use-lora" in error("--custom-config-path", path)
    path = write_yaml(tmp_path, "loss_type: dpo\n")
    assert "--loss-type must be one of" in error("--custom-config-path", path)


def test_yaml_type_errors_name_file_and_key(tmp_path):
    path = write_yaml(tmp_path, "colocate: 'yes please'\n")
    message = error("--custom-config-path", path)
    assert path in message and "'colocate'" in message and "expected true or false" in message
    path = write_yaml(tmp_path, "rollout_batch_size: 2.5\n")
    assert "expected an integer" in error("--custom-config-path", path)


def test_yaml_must_be_a_mapping(tmp_path):
    path = write_yaml(tmp_path, "- lr\n- 1e-4\n")
    message = error("--custom-config-path", path)
    assert path in message and "expected a mapping" in message
    path = write_yaml(tmp_path, "lr: [unclosed\n")
    assert "not valid YAML" in error("--custom-config-path", path)
    assert "cannot read the file" in error("--custom-config-path", str(tmp_path / "absent.yaml"))


def test_hostile_yaml_is_one_line_and_bounded(tmp_path, caplog):
    for key in ("__dict__", "__class__", "_private", "a b"):
        path = write_yaml(tmp_path, f"{key}: 1\n")
        assert "is not a flag name" in error("--custom-config-path", path), key
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9))
    assert len(laughs) < 700  # a few hundred bytes that expand to 9**10 items
    assert "once its aliases are expanded" in error("--custom-config-path", write_yaml(tmp_path, laughs))
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]\n"
    assert "more than 100 YAML aliases" in error("--custom-config-path", write_yaml(tmp_path, many))
    huge = tmp_path / "huge.yaml"
    huge.write_text("my_knob: '" + "x" * (2 << 20) + "'\n")
    assert "larger than" in error("--custom-config-path", str(huge))
    # an unknown key's long value is logged cut short, not in full
    path = write_yaml(tmp_path, "my_knob: '" + "y" * 100_000 + "'\n")
    with caplog.at_level(logging.WARNING):
        assert parse("--custom-config-path", path).my_knob == "y" * 100_000
    assert max(len(r.getMessage()) for r in caplog.records) < 500


# ---- --dry-run and the entry point --------------------------------------------------------------------------
def test_dry_run_prints_configuration_and_geometry():
    args = parse("--actor-num-gpus-per-node", "2", "--diffusion-num-sde-steps", "3", "--global-batch-size", "4",
                 "--micro-batch-size", "2", "--lr", "3e-5")
    text = format_dry_run(args)
    assert "* --lr" in text and "3e-05" in text
    for line in ("prompts (--rollout-batch-size)                     4",
                 "= trajectories                                       8",
                 "x trained steps per trajectory                       3",
                 "= train pairs                                        24",
                 "= pairs per DP rank                                  12",
                 "/ optimizer steps (--num-steps-per-rollout)          2",
                 "= pairs per DP rank per optimizer step               6",
                 "= DiT forwards per DP rank per optimizer step        3"):
        assert line in text
    assert "diffusion_model_family_resolved" in text


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    assert "--diffusion-sde-window-range" in capsys.readouterr().out


def _run_entry_point(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    return subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *argv], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


@pytest.mark.skipif(not (REPO / "train_diffusion.py").exists(), reason="train_diffusion.py is not in the repo")
def test_entry_point_user_errors_exit_2_with_one_line():
    for argv in (["--no-such-flag"], [*BASE, "--colocate-reward"]):
        result = _run_entry_point(*argv)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(not (REPO / "train_diffusion.py").exists(), reason="train_diffusion.py is not in the repo")
def test_entry_point_dry_run_exits_0(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "a cat"}\n')
    argv = [str(prompts) if arg == "prompts.jsonl" else arg for arg in BASE]
    result = _run_entry_point(*argv, "--rm-type", "brightness", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "Batch geometry of one rollout" in result.stdout


@pytest.mark.skipif(not (REPO / "train_diffusion.py").exists(), reason="train_diffusion.py is not in the repo")
def test_the_dry_run_prints_the_schedule(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"input": "prompt {i}"}}\n' for i in range(10)))
    argv = [str(prompts) if arg == "prompts.jsonl" else arg for arg in BASE]
    del argv[argv.index("--num-rollout"):argv.index("--num-rollout") + 2]
    result = _run_entry_point(*argv, "--rm-type", "brightness", "--num-epoch", "4", "--eval-prompt-data", "val",
                              str(prompts), "--save", str(tmp_path / "ckpt"), "--save-interval", "4", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    schedule = lines[lines.index("Run schedule") + 1:]
    # 4 epochs of 10 prompts at 4 per rollout: ceil(40 / 4) = 10 rollouts; eval sets default to every 10 rollouts
    assert schedule[0].split()[:2] == ["rollouts", "10"] and "4 epoch(s) of --prompt-data" in schedule[0]
    assert schedule[2].split()[-1] == "10" and schedule[3].split()[-1] == "10"  # rollouts to train, optimizer steps
    assert schedule[4].endswith("3, 7, 9 (3)") and schedule[5].endswith(" 0, 10 (2)")
    assert schedule[6].endswith("none")


def test_entry_point_dry_run_checks_user_paths():
    result = _run_entry_point(*BASE, "--dry-run")
    assert result.returncode == 2
    assert "--prompt-data" in result.stderr and "Traceback" not in result.stderr


def test_parity_group_is_the_default_eager_or_compiled_and_sets_the_forward_tile():
    args = parse("--micro-batch-size", "4")
    assert args.rollout_patch_group == ["batch_invariant"] and args.parity_forward_tile == 4
    compiled = parse("--micro-batch-size", "4", "--fsdp-torch-compile", "--sglang-enable-torch-compile")
    assert compiled.rollout_patch_group == ["batch_invariant"] and compiled.parity_forward_tile == 4
    off = parse("--micro-batch-size", "4", "--rollout-patch-group", "none")
    assert off.rollout_patch_group == [] and off.parity_forward_tile == 0
    engine_only = parse("--rollout-patch-group", "sgld")
    assert engine_only.rollout_patch_group == ["sgld"] and engine_only.parity_forward_tile == 0


def test_rollout_gradient_needs_lora_flow_grpo_with_one_step_per_rollout():
    fused = ("--diffusion-rollout-gradient", "--use-lora")
    args = parse(*fused)
    assert args.diffusion_rollout_gradient and args.lora_ipc_weight_sync  # the engines need the factors
    assert "needs --use-lora" in error("--diffusion-rollout-gradient")
    assert "needs one optimizer step per rollout, not --num-steps-per-rollout 2" in error(
        *fused, "--num-steps-per-rollout", "2")
    assert "needs --diffusion-kl-beta 0" in error(*fused, "--diffusion-kl-beta", "0.04")
    assert "needs --loss-type policy_loss, not nft" in error(*fused, "--loss-type", "nft", "--diffusion-sde-type",
                                                             "ode", "--diffusion-noise-level", "0")
    assert "no --overlap-rollout" in error(*fused, "--overlap-rollout")
    from miles.config.sections import RunConfig
    from miles.ray.engines import build_server_args

    def engine_tile(*extra):
        return build_server_args(RunConfig.from_args(parse(*extra)), "cpu").rollout_gradient_tile

    micro_batch = parse(*fused).micro_batch_size
    assert engine_tile(*fused) == micro_batch and engine_tile("--use-lora") == 0
    assert engine_tile(*fused, "--rollout-gradient-tile", "16") == 16
    assert "--rollout-gradient-tile applies under --diffusion-rollout-gradient" in error(
        "--use-lora", "--rollout-gradient-tile", "16")


def test_a_trainer_on_the_host_needs_the_rollout_gradient_and_one_colocated_node():
    from miles.config.sections import RunConfig

    fused = ("--diffusion-rollout-gradient", "--use-lora")
    host = ("--rollout-gradient-trainer", "host")
    assert "--rollout-gradient-trainer applies under --diffusion-rollout-gradient" in error("--use-lora", *host)
    assert "--rollout-gradient-trainer host needs --colocate on one node" in error(*fused, *host)
    assert "--rollout-gradient-trainer host needs --colocate on one node" in error(
        *fused, *host, "--colocate", "--actor-num-nodes", "2")
    assert RunConfig.from_args(parse(*fused, *host, "--colocate", "--actor-num-gpus-per-node", "2")).trainer.on_host
    assert "invalid choice" in error(*fused, "--rollout-gradient-trainer", "gpu")

    def where(*extra) -> str:
        return RunConfig.from_args(parse(*extra)).trainer.rollout_gradient_trainer

    # auto (the default): the host for one colocated trainer rank, the device otherwise and without the mode
    assert where(*fused, "--colocate") == "host"
    assert where(*fused, "--colocate", "--rollout-gradient-trainer", "device") == "device"
    assert where(*fused) == where(*fused, "--colocate", "--actor-num-gpus-per-node", "2") == "device"
    assert not RunConfig.from_args(parse("--use-lora", "--colocate")).trainer.on_host


def test_colocated_engines_on_gpus_pin_their_release_buffers_ahead():
    from miles.config.sections import RunConfig
    from miles.ray.engines import build_server_args

    def ahead(device, *extra):
        return build_server_args(RunConfig.from_args(parse(*extra)), device).release_buffers_ahead

    assert ahead("cuda", "--colocate") and not ahead("cpu", "--colocate") and not ahead("cuda")
    host_trainer = ("--use-lora", "--diffusion-rollout-gradient", "--rollout-gradient-trainer", "host")
    assert not ahead("cuda", "--colocate", *host_trainer)  # nothing is released: no turns


def test_overlapped_rollout_needs_engines_of_their_own_and_engine_log_probs():
    assert parse("--overlap-rollout").overlap_rollout
    assert "--overlap-rollout needs engines of their own" in error("--overlap-rollout", "--colocate")
    assert "drop --diffusion-recompute-old-log-prob" in error("--overlap-rollout", "--diffusion-recompute-old-log-prob")


def test_the_rollout_prefetch_is_on_where_the_engines_stay_resident_with_the_built_in_rollout():
    def prefetch(*extra) -> str:
        return parse(*extra).rollout_prefetch

    fused = ("--diffusion-rollout-gradient", "--use-lora")
    # auto: engines of their own, or colocated beside a trainer on the host; off where they release for the trainer
    assert prefetch() == prefetch(*fused, "--colocate") == "on"
    assert prefetch("--colocate") == prefetch(*fused, "--colocate", "--rollout-gradient-trainer", "device") == "off"
    assert prefetch("--offload-rollout") == prefetch(*fused, "--colocate", "--actor-num-gpus-per-node", "2") == "off"
    assert prefetch("--overlap-rollout") == prefetch("--miles-router-timeout", "60") == "off"
    assert prefetch("--custom-generate-function-path", "my.generate") == "off"
    assert prefetch("--rollout-function-path", "my.rollout") == "off"
    assert prefetch("--rollout-prefetch", "off") == "off"
    assert "--rollout-prefetch on needs engines that stay resident" in error("--colocate", "--rollout-prefetch", "on")
    assert "--rollout-prefetch on needs no --overlap-rollout" in error("--overlap-rollout", "--rollout-prefetch", "on")
