"""Cross-flag rules and derived values of the `train_diffusion.py` command line.

`validate_args` runs the `_rule_*` functions on the final (post-YAML) values, in the order of the reference's
tables (per-value bounds first, then model, cluster, data and batching, rollout steps, loss, reference policy,
optimizer, reward, evaluation, outputs), so a YAML file cannot bypass a rule. A rule either raises one
`MilesUserError` naming the flags and values, or fills resolved and derived values in place
(`DERIVED_ATTRIBUTES` lists the attributes it adds beyond the flags).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Callable

from miles.config.batch_geometry import batch_geometry, step_strategy
from miles.utils.errors import MilesUserError
from miles.config.flags import REWARD_TYPE_NAMES, all_flags
from miles.config.reward_rules import check_reward_selection, reward_components

# The command line's logger: these warnings keep the name users (and tests) filter on.
logger = logging.getLogger(__name__)

# Attributes `validate_args` adds beyond the flags (the flags themselves are resolved in place: global_batch_size,
# num_steps_per_rollout, micro_batch_size, rollout_num_gpus, offload_*, ref_mode, metrics_path, ...).
DERIVED_ATTRIBUTES = (
    "diffusion_model_family_resolved",  # family key, None with --train-pipeline-config-path
    "diffusion_log_prob_no_const_resolved",  # the log-prob form engine and trainer share (docs/algorithms.md §2)
    "train_world_size",  # actor_num_nodes x actor_num_gpus_per_node
    "dp_size",  # train_world_size / sequence_parallel_size
    "ulysses_degree_resolved",  # --ulysses-degree with 0 resolved to the SP size
    "ring_degree",  # sequence_parallel_size / ulysses_degree_resolved
    "eval_prompt_data_pairs",  # [(name, path)] from --eval-prompt-data
    "debug_train_only",  # legacy name of train_only
    "parity_forward_tile",  # samples per DiT forward on both sides under the batch_invariant group, else 0
)

BATCH_INVARIANT_GROUP = "batch_invariant"  # miles/models/batch_invariant.py


def _fail(message: str) -> None:
    raise MilesUserError(message)


def _rule_values(args: argparse.Namespace) -> None:
    """Per-flag choices and bounds (they also cover values that came from the YAML)."""
    for dest, flag in all_flags().items():
        problem = flag.problem(getattr(args, dest, flag.default))
        if problem:
            _fail(f"{flag.name} {problem}")


def _rule_model(args: argparse.Namespace) -> None:
    if not args.hf_checkpoint:
        _fail("--hf-checkpoint is required: the diffusers pipeline to train (hub id or local directory)")
    if args.train_pipeline_config_path and args.diffusion_model_family:
        _fail(f"--train-pipeline-config-path {args.train_pipeline_config_path!r} and --diffusion-model-family "
              f"{args.diffusion_model_family!r} are mutually exclusive: a custom TrainPipelineConfig has no family key")
    args.diffusion_model_family_resolved = None
    if not args.train_pipeline_config_path:
        from miles.config.preflight import check_pipeline_source
        from miles.models import resolve_family_name

        try:
            args.diffusion_model_family_resolved = resolve_family_name(args.hf_checkpoint,
                                                                       args.diffusion_model_family)
        except MilesUserError:
            # a mistyped folder says so, not "cannot tell the family" (the preflight checks it again with the rest)
            check_pipeline_source(args.hf_checkpoint, "--hf-checkpoint")
            raise
    targets = [m.strip() for m in args.update_weight_target_module.split(",") if m.strip()]
    if not targets:
        _fail(f"--update-weight-target-module {args.update_weight_target_module!r} names no module")
    if "transformer_2" in targets and args.diffusion_guidance_scale_2 is None and args.loss_type != "sft_loss":
        _fail(f"--update-weight-target-module {args.update_weight_target_module!r} trains transformer_2 (Wan2.2's "
              "low-noise expert): set --diffusion-guidance-scale-2, its CFG scale")


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _rule_topology(args: argparse.Namespace) -> None:
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    sp = args.sequence_parallel_size
    if world % sp:
        _fail(f"--sequence-parallel-size {sp} must divide the train world size {world} "
              f"(--actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node {args.actor_num_gpus_per_node})")
    dp = world // sp
    if dp % args.dp_replicate_size:
        _fail(f"--dp-replicate-size {args.dp_replicate_size} must divide dp_size {dp} (train world size {world} / "
              f"--sequence-parallel-size {sp})")
    ulysses = args.ulysses_degree or sp
    if sp % ulysses:
        _fail(f"--sequence-parallel-size {sp} must be divisible by --ulysses-degree {args.ulysses_degree}")
    ring = sp // ulysses
    if ring > 1 and _torch_version() < (2, 11):
        _fail(f"ring degree {ring} (--sequence-parallel-size {sp} / --ulysses-degree {ulysses}) needs torch >= 2.11, "
              f"found {'.'.join(map(str, _torch_version()))}; set --ulysses-degree {sp} or upgrade torch")
    args.train_world_size, args.dp_size = world, dp
    args.ulysses_degree_resolved, args.ring_degree = ulysses, ring


def _rule_placement(args: argparse.Namespace) -> None:
    if args.colocate:
        world = args.train_world_size
        if args.rollout_num_gpus is not None and args.rollout_num_gpus != world:
            _fail(f"--colocate uses the train world size ({world}) for rollout, but --rollout-num-gpus is "
                  f"{args.rollout_num_gpus}; drop --rollout-num-gpus or set it to {world}")
        for name in ("offload_train", "offload_rollout"):
            if getattr(args, name) is False:
                _fail(f"--colocate needs --{name.replace('_', '-')} (trainer and engines take turns on the GPUs); "
                      f"remove --no-{name.replace('_', '-')}")
        args.rollout_num_gpus = world
        args.offload_train = args.offload_rollout = True
    else:
        if args.colocate_reward:
            _fail("--colocate-reward needs --colocate (reward actors share the colocated rollout GPUs)")
        args.offload_train, args.offload_rollout = bool(args.offload_train), bool(args.offload_rollout)
    if args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
        _fail(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} exceeds --num-gpus-per-node "
              f"{args.num_gpus_per_node}")
    # how a multi-GPU engine splits its forwards (CFG- or sequence-parallel); the model's heads are checked at load
    from miles.engine.cfg_parallel import engine_parallel_mode
    from miles.models import get_family_class

    family = args.diffusion_model_family_resolved
    engine_parallel_mode(args.rollout_num_gpus_per_engine, args.sglang_ulysses_degree or 0,
                         get_family_class(family) if family else None)
    if args.actor_num_gpus_per_node > args.num_gpus_per_node:
        _fail(f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} exceeds --num-gpus-per-node "
              f"{args.num_gpus_per_node} (the GPUs the job may use per node)")
    if not args.use_miles_router:
        logger.info("--use-miles-router is implied: miles always routes rollout requests through its own router")
    args.use_miles_router = True  # the SGLang router is not supported


def _rule_ci(args: argparse.Namespace) -> None:
    """--ci-test runs the end-of-run metric check (train_diffusion.py), which needs its key and threshold."""
    key, threshold = args.ci_metric_checker_key, args.ci_metric_checker_threshold
    if (key is None) != (threshold is None):
        _fail(f"--ci-metric-checker-key {key!r} and --ci-metric-checker-threshold {threshold!r} go together")
    if key is not None and not args.ci_test:
        _fail(f"--ci-metric-checker-key {key!r} only runs with --ci-test")
    if args.ci_test and key is None:
        _fail("--ci-test checks a metric at the end of the run: set --ci-metric-checker-key and "
              "--ci-metric-checker-threshold")


def _rule_modes(args: argparse.Namespace) -> None:
    if args.load_debug_rollout_data:
        args.train_only = True  # a replayed rollout needs no engine
    if args.debug_rollout_only and args.train_only:
        _fail("--debug-rollout-only and --train-only (or --load-debug-rollout-data) exclude each other")
    args.debug_train_only = args.train_only
    if args.dump_details:
        if args.save_debug_rollout_data is None:
            args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
        if args.save_debug_train_data is None:
            args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}_{rank}.pt")


def _rule_batch(args: argparse.Namespace) -> None:
    """rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout (docs/algorithms.md §5)."""
    rbs, g, gbs, steps = (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size,
                          args.num_steps_per_rollout)
    if rbs is None:
        if not (args.train_only and args.loss_type == "sft_loss"):
            _fail("--rollout-batch-size is required (prompts per rollout); only --train-only with --loss-type "
                  "sft_loss may leave it unset")
        if gbs is None:
            _fail("--train-only sft_loss without --rollout-batch-size needs --global-batch-size")
        steps = steps or 1
        if gbs * steps % g:
            _fail(f"--global-batch-size {gbs} x --num-steps-per-rollout {steps} must be divisible by "
                  f"--n-samples-per-prompt {g}")
        rbs = args.rollout_batch_size = gbs * steps // g
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < rbs:
        _fail(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size {rbs}: "
              "it is how many prompt groups a rollout starts, of which --rollout-batch-size are trained")
    trajectories = rbs * g
    knobs = f"--rollout-batch-size {rbs} x --n-samples-per-prompt {g} = {trajectories} samples per rollout"
    if gbs is None and steps is None:
        steps = 1
    if gbs is None:
        if trajectories % steps:
            _fail(f"{knobs} is not divisible by --num-steps-per-rollout {steps}")
        gbs = trajectories // steps
    elif steps is None:
        if trajectories % gbs:
            _fail(f"{knobs} is not divisible by --global-batch-size {gbs}")
        steps = trajectories // gbs
    elif gbs * steps != trajectories:
        _fail(f"{knobs}, but --global-batch-size {gbs} x --num-steps-per-rollout {steps} = {gbs * steps}; "
              "they must be equal (set one of the two and the other is derived)")
    if gbs % args.dp_size:
        _fail(f"--global-batch-size {gbs} must be divisible by dp_size {args.dp_size} (train world size "
              f"{args.train_world_size} / --sequence-parallel-size {args.sequence_parallel_size})")
    args.global_batch_size, args.num_steps_per_rollout = gbs, steps
    tile = (args.micro_batch_size_sample, args.micro_batch_size_tstep)
    if (tile[0] is None) != (tile[1] is None):
        _fail(f"--micro-batch-size-sample {tile[0]} and --micro-batch-size-tstep {tile[1]} must be set together")
    if tile[0] is not None:
        if args.micro_batch_size not in (1, tile[0] * tile[1]):
            logger.warning("--micro-batch-size %d is replaced by --micro-batch-size-sample x --micro-batch-size-tstep"
                           " = %d", args.micro_batch_size, tile[0] * tile[1])
        args.micro_batch_size = tile[0] * tile[1]
    if g == 1 and not args.disable_grpo_std_normalization:
        args.disable_grpo_std_normalization = True  # the std of a single sample is undefined (docs/algorithms.md §4)
        if args.loss_type in ("policy_loss", "nft") and not args.globalize_reward_mean:
            logger.warning("--n-samples-per-prompt 1 with per-prompt mean gives zero advantages; "
                           "add --globalize-reward-mean")


def _rule_run_length(args: argparse.Namespace) -> None:
    rl = args.loss_type != "sft_loss"
    if rl and not args.prompt_data and not args.disable_rollout_global_dataset and not args.load_debug_rollout_data:
        _fail(f"--prompt-data is required for --loss-type {args.loss_type} (or pass --disable-rollout-global-dataset "
              "with your own --data-source-path, or --load-debug-rollout-data)")
    if args.num_rollout is not None and args.num_epoch is not None:
        logger.warning("both --num-rollout %d and --num-epoch %d are set; --num-epoch is ignored",
                       args.num_rollout, args.num_epoch)
        args.num_epoch = None
    # Unset --num-rollout is derived from the dataset (miles.rollout.data_source.num_rollout_of: --num-epoch
    # passes, one by default), which needs the global prompt dataset.
    from_dataset = bool(args.prompt_data) and not args.disable_rollout_global_dataset
    if args.num_rollout is None and not from_dataset:
        what = f"--num-epoch {args.num_epoch}" if args.num_epoch is not None else "an unset --num-rollout"
        _fail(f"{what} counts passes over --prompt-data, but there is no global prompt dataset "
              "(--prompt-data unset or --disable-rollout-global-dataset); set --num-rollout N")


def _rule_sde_steps(args: argparse.Namespace) -> None:
    """Which steps become train pairs (docs/algorithms.md §3)."""
    n, k, strategy = args.diffusion_num_steps, args.diffusion_num_sde_steps, step_strategy(args)
    path = args.diffusion_step_strategy_path
    if strategy == "sde_window" and k < 1:
        _fail(f"--diffusion-step-strategy-path {path} needs --diffusion-num-sde-steps >= 1, got {k}")
    if args.diffusion_sde_window_range is not None:
        lo, hi = args.diffusion_sde_window_range
        if not 0 <= lo < hi <= n:
            _fail(f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= --diffusion-num-steps {n}")
    if k > 0 and strategy in (None, "sde_window", "all_steps_or_window"):
        lo, hi = args.diffusion_sde_window_range or (0, n)
        if k > hi - lo:
            _fail(f"--diffusion-num-sde-steps {k} must be <= the window size {hi - lo} "
                  f"(--diffusion-sde-window-range {lo},{hi}; --diffusion-num-steps {n})")
    candidates = args.diffusion_sde_candidate_steps
    if strategy == "epoch_global_random_choice" and not candidates:
        _fail(f"--diffusion-step-strategy-path {path} requires --diffusion-sde-candidate-steps \"i,j,...\"")
    if candidates:
        if len(set(candidates)) != len(candidates):
            _fail(f"--diffusion-sde-candidate-steps {candidates} has duplicates")
        if not all(0 <= c < n for c in candidates):
            _fail(f"--diffusion-sde-candidate-steps {candidates} must lie in [0, --diffusion-num-steps {n})")
    if strategy == "ode_and_return_last" and args.loss_type in ("policy_loss", "custom_loss"):
        _fail(f"--diffusion-step-strategy-path {path} records no SDE step, so --loss-type {args.loss_type} has "
              "nothing to train; use --loss-type nft or another strategy")


def _rule_loss(args: argparse.Namespace) -> None:
    loss = args.loss_type
    if loss == "policy_loss":
        if args.diffusion_sde_type == "ode":
            _fail("--loss-type policy_loss needs a stochastic rollout: --diffusion-sde-type ode has no log-prob; "
                  "use sde or cps (or --loss-type nft)")
        if args.diffusion_noise_level <= 0:
            _fail(f"--loss-type policy_loss needs --diffusion-noise-level > 0, got {args.diffusion_noise_level:g} "
                  "(zero noise makes the log-prob undefined)")
    if args.diffusion_recompute_old_log_prob and loss != "policy_loss":
        _fail(f"--diffusion-recompute-old-log-prob only applies to --loss-type policy_loss, not {loss}")
    if loss == "nft" and args.diffusion_nft_beta <= 0:
        _fail(f"--loss-type nft needs --diffusion-nft-beta > 0, got {args.diffusion_nft_beta:g}")
    if (loss == "custom_loss") != bool(args.custom_loss_function_path):
        _fail("--loss-type custom_loss and --custom-loss-function-path go together "
              f"(got --loss-type {loss}, --custom-loss-function-path {args.custom_loss_function_path!r})")
    if args.sft_encoder_checkpoint and loss != "sft_loss":
        _fail(f"--sft-encoder-checkpoint only applies to --loss-type sft_loss, not {loss}")
    # One log-prob form for engine and trainer (docs/algorithms.md §2): no-const for cps/ode or when asked.
    from miles.diffusion.sde import use_no_const_log_prob

    args.diffusion_log_prob_no_const_resolved = use_no_const_log_prob(
        args.diffusion_sde_type, args.diffusion_log_prob_no_const
    )


def _rule_reference(args: argparse.Namespace) -> None:
    """--ref-mode auto rules and --use-ema consumers (docs/algorithms.md §5, §6, §8)."""
    loss, kl = args.loss_type, args.diffusion_kl_beta
    if args.ref_mode is None:
        if loss == "nft":  # v_old: the EMA, else the LoRA base (docs/algorithms.md §6)
            if not args.use_ema and not args.use_lora:
                _fail("--loss-type nft needs a reference policy for v_old: add --use-ema (recommended) or --use-lora")
            args.ref_mode = "ema" if args.use_ema else "lora_base"
        else:
            args.ref_mode = "lora_base" if kl > 0 else "none"
    elif args.ref_mode == "ema" and not args.use_ema:
        _fail("--ref-mode ema needs --use-ema")
    if args.ref_mode == "lora_base" and not args.use_lora:
        _fail(f"--ref-mode lora_base (the reference for --diffusion-kl-beta {kl:g}) needs --use-lora; "
              "or pass --ref-mode ema with --use-ema")
    if kl > 0 and loss != "nft" and args.ref_mode == "none":
        _fail(f"--diffusion-kl-beta {kl:g} needs a reference policy, but --ref-mode is none")
    if args.ema_rollout_policy == "ema" and not args.use_ema:
        _fail("--ema-rollout-policy ema needs --use-ema")
    if args.use_ema and args.ref_mode != "ema" and args.ema_rollout_policy != "ema":
        _fail(f"--use-ema has no consumer: set --ref-mode ema or --ema-rollout-policy ema (--ref-mode is "
              f"{args.ref_mode}, --ema-rollout-policy {args.ema_rollout_policy})")
    if args.lora_ipc_weight_sync and not args.use_lora:
        _fail("--lora-ipc-weight-sync needs --use-lora (it pushes only lora_A/lora_B)")
    if args.check_weight_sync and args.lora_ipc_weight_sync:
        _fail("--check-weight-sync compares full weights; --lora-ipc-weight-sync pushes only LoRA pairs (the engine "
              "merges them): drop one of the two")


def _rule_optimizer(args: argparse.Namespace) -> None:
    """LR schedule sanity (docs/algorithms.md §9) and the checkpoint-vs-override scheduler rule."""
    if args.override_lr_scheduler:
        args.use_checkpoint_lr_scheduler = False  # the explicit override wins over the default-on restore
    for name in ("min_lr", "lr_warmup_init"):
        if getattr(args, name) > args.lr:
            _fail(f"--{name.replace('_', '-')} {getattr(args, name):g} must be <= --lr {args.lr:g}")
    if args.lr_decay_style == "WSD" and (args.lr_wsd_decay_iters is None or args.lr_wsd_decay_style is None):
        _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters and --lr-wsd-decay-style")
    if args.lr_decay_iters is not None:
        if args.lr_warmup_fraction is None and args.lr_warmup_iters >= args.lr_decay_iters:
            _fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters {args.lr_decay_iters}")
        if args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_iters > args.lr_decay_iters:
            _fail(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} must be <= --lr-decay-iters {args.lr_decay_iters}")


# What each built-in reward needs: (flags that must be set, the one-line reason).
_REWARD_NEEDS = {
    "pickscore": (("pickscore_model_path", "pickscore_processor_path"), "the PickScore model and its CLIP processor"),
    "remote_rm": (("rm_url",), "the reward service's URL"),
    "clipscore": (("clipscore_model_path",), "a CLIP folder (model + processor)"),
    "aesthetic": (("aesthetic_model_path", "aesthetic_head_path"), "a CLIP folder and the head's safetensors file"),
    "vlm_judge": (("vlm_judge_url", "vlm_judge_model"), "the OpenAI-compatible endpoint and the model to ask"),
    "geneval": (("geneval_url",), "the GenEval scorer's URL"),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _rule_reward(args: argparse.Namespace) -> None:
    """Each reward's inputs; several rewards per sample need --reward-weights or --reward-key to become one scalar."""
    from miles.config.flags import parse_reward_weights

    rm_types = [part.strip() for part in args.rm_type.split(",")] if args.rm_type else []
    if rm_types:
        args.rm_type = ",".join(rm_types)
    for rm_type in rm_types:
        needs, what = _REWARD_NEEDS.get(rm_type, ((), ""))
        missing = [dest for dest in needs if not getattr(args, dest, None)]
        if missing:
            got = ", ".join(repr(getattr(args, dest, None)) for dest in needs)
            _fail(f"--rm-type {rm_type} needs {' and '.join(_flag(dest) for dest in needs)}: {what} (got {got})")
    if args.reward_weights is not None:
        try:
            args.reward_weights = parse_reward_weights(args.reward_weights)
        except ValueError as err:
            _fail(f"--reward-weights: {err}")
    if args.reward_weights and args.reward_key:
        _fail(f"--reward-key {args.reward_key!r} and --reward-weights exclude each other: the trained reward is one "
              "component or their weighted sum")
    # Rewards that may return dicts with keys of their own; without them every component is a built-in's.
    free_keys = bool(args.custom_rm_path or args.rm_url or args.geneval_url)
    if args.reward_weights and not free_keys:
        known = sorted({key for name in REWARD_TYPE_NAMES for key in reward_components(name) or ()})
        unknown = sorted(set(args.reward_weights) - set(known))
        if unknown:
            _fail(f"--reward-weights names {unknown}, which no reward produces: a component is a built-in reward's "
                  f"({', '.join(known)}) or a key of a dict reward (--custom-rm-path, remote_rm)")
    if rm_types and not args.custom_rm_path:  # the eval sets' rewards: the preflight, which reads their rows
        check_reward_selection(args, args.rm_type, False, "--rm-type")


def _rule_eval(args: argparse.Namespace) -> None:
    pairs = args.eval_prompt_data or []
    if len(pairs) % 2:
        _fail(f"--eval-prompt-data takes NAME PATH pairs, got an odd count: {pairs}")
    names = pairs[0::2]
    if len(set(names)) != len(names):
        _fail(f"--eval-prompt-data repeats a dataset name: {names}")
    args.eval_prompt_data_pairs = list(zip(names, pairs[1::2]))
    has_eval_sets = bool(args.eval_prompt_data_pairs or args.eval_config)
    if args.eval_interval is not None and not has_eval_sets:
        _fail(f"--eval-interval {args.eval_interval} needs eval datasets: --eval-prompt-data NAME PATH or "
              "--eval-config FILE")
    if has_eval_sets and args.eval_interval is None:
        from miles.config.schedule import DEFAULT_EVAL_INTERVAL

        args.eval_interval = DEFAULT_EVAL_INTERVAL
        logger.info("eval sets without --eval-interval: evaluating every %d rollouts (and after the last one)",
                    DEFAULT_EVAL_INTERVAL)


def _rule_outputs(args: argparse.Namespace) -> None:
    if args.save_interval is not None and not args.save:
        _fail(f"--save-interval {args.save_interval} needs --save DIR")
    if args.save_keep_latest is not None and not args.save:
        _fail(f"--save-keep-latest {args.save_keep_latest} needs --save DIR")
    if args.metrics_path is None:
        args.metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if args.use_tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            _fail("--use-tensorboard needs the tensorboard package: pip install tensorboard")


def _rule_micro_batches(args: argparse.Namespace) -> None:
    """A rank's pairs per optimizer window split into whole micro-batches (docs/algorithms.md §5: Q % m == 0)."""
    geometry = batch_geometry(args)
    q, m = geometry.pairs_per_rank_per_optimizer_step, args.micro_batch_size
    if q == 0:
        _fail(f"no train pairs: {geometry.steps_rule} gives 0 trained steps per sample")
    if q is not None and q % m:
        _fail(f"--micro-batch-size {m} must divide the {q} train pairs per DP rank per optimizer step "
              f"(--global-batch-size {args.global_batch_size} / dp_size {args.dp_size} x "
              f"{geometry.trained_steps_per_trajectory} trained steps per sample)")


def _rule_overlap(args: argparse.Namespace) -> None:
    if not args.overlap_rollout:
        return
    if args.colocate:
        _fail("--overlap-rollout needs engines of their own: with --colocate trainer and engines take turns on "
              "the same GPUs; drop one of the two")
    if args.diffusion_recompute_old_log_prob:
        _fail("--overlap-rollout trains one step off-policy, so the ratio must be taken against the engines' "
              "log-probs: drop --diffusion-recompute-old-log-prob")
    if args.train_only or args.debug_rollout_only or args.load_debug_rollout_data:
        _fail("--overlap-rollout overlaps generation with training; it needs both (no --train-only, "
              "--debug-rollout-only or --load-debug-rollout-data)")


# the built-in rollout functions: a user's would send the next rollout's requests without the weights to wait for
BUILT_IN_ROLLOUT_FUNCTIONS = ("miles.rollout.sglang_rollout.generate_rollout",
                              "miles.rollout.sglang_diffusion_rollout.generate_rollout")


def _rule_prefetch(args: argparse.Namespace) -> None:
    """--rollout-prefetch: rollout k+1 is sent while the trainer trains on rollout k, its requests waiting on the
    engines for the weights of version k+1 (miles/engine/scheduler.py). Resolved to on or off."""
    if args.rollout_prefetch == "off":
        return
    needs = [
        (not (args.train_only or args.debug_rollout_only or args.load_debug_rollout_data),
         "both a rollout and a trainer (no --train-only, --debug-rollout-only or --load-debug-rollout-data)"),
        (args.loss_type != "sft_loss", "rollouts from the engines (not --loss-type sft_loss)"),
        (not args.overlap_rollout, "no --overlap-rollout (it sends the next rollout on the current weights)"),
        (args.rollout_function_path in BUILT_IN_ROLLOUT_FUNCTIONS and not args.custom_generate_function_path,
         "the built-in rollout and generate (no --rollout-function-path of your own, no "
         "--custom-generate-function-path: they would not wait for the new weights)"),
        ((not args.colocate and not args.offload_rollout)
         or (args.diffusion_rollout_gradient and args.rollout_gradient_trainer == "host"),
         "engines that stay resident while the trainer trains (engines of their own without --offload-rollout, or "
         "--colocate with the trainer on the host: --diffusion-rollout-gradient, --rollout-gradient-trainer host "
         "or auto)"),
        (args.miles_router_timeout is None, "no --miles-router-timeout (a request sent ahead waits while the "
                                            "trainer trains)"),
    ]
    missing = [what for ok, what in needs if not ok]
    if missing and args.rollout_prefetch == "on":
        _fail(f"--rollout-prefetch on needs {missing[0]}")
    args.rollout_prefetch = "off" if missing else "on"


def _rule_rollout_gradient(args: argparse.Namespace) -> None:
    """--diffusion-rollout-gradient: the gradient at ratio 1 is Σ −clip(A)·∇ℓ / pairs only for the plain clipped
    loss with one optimizer step per rollout; each sample's term is taken in a one-process engine's forward."""
    if not args.diffusion_rollout_gradient:
        for name, value, default in (("tile", args.rollout_gradient_tile, 0),
                                     ("trainer", args.rollout_gradient_trainer, "auto"),
                                     ("engine-step", args.rollout_gradient_engine_step, "auto")):
            if value != default:
                _fail(f"--rollout-gradient-{name} applies under --diffusion-rollout-gradient; pass that flag too, "
                      f"or drop this one")
        return
    if args.rollout_gradient_trainer == "host" and not (args.colocate and args.actor_num_nodes == 1):
        _fail("--rollout-gradient-trainer host needs --colocate on one node (--actor-num-nodes 1): the engines "
              "reach a trainer on the CPU only through shared-memory files of their own host")
    if args.rollout_gradient_trainer == "auto":  # the measured default: one colocated trainer rank on the host
        one_rank = args.colocate and args.actor_num_nodes == 1 and args.actor_num_gpus_per_node == 1
        args.rollout_gradient_trainer = "host" if one_rank else "device"
    flag = "--diffusion-rollout-gradient"
    needs = [
        (args.use_lora, "--use-lora (the engines keep a per-sample copy of the adapter)"),
        (args.loss_type == "policy_loss", f"--loss-type policy_loss, not {args.loss_type}"),
        (args.num_steps_per_rollout == 1, f"one optimizer step per rollout, not --num-steps-per-rollout "
                                          f"{args.num_steps_per_rollout}"),
        (args.diffusion_kl_beta == 0, f"--diffusion-kl-beta 0, not {args.diffusion_kl_beta:g}"),
        (not args.diffusion_recompute_old_log_prob, "no --diffusion-recompute-old-log-prob (nothing is replayed)"),
        (not args.use_ema or args.ema_rollout_policy != "ema", "the trained weights as the rollout policy, not "
                                                               "--ema-rollout-policy ema"),
        (args.rollout_num_gpus_per_engine == 1, "one-process engines, not --rollout-num-gpus-per-engine "
                                                f"{args.rollout_num_gpus_per_engine}"),
        (not args.overlap_rollout, "no --overlap-rollout (the gradient is taken on the current weights)"),
        (not (args.train_only or args.debug_rollout_only or args.load_debug_rollout_data),
         "both a rollout and a trainer (no --train-only, --debug-rollout-only or --load-debug-rollout-data)"),
        (not (args.custom_generate_function_path or args.custom_loss_function_path
              or args.custom_convert_samples_to_train_data_path or args.custom_expand_samples_to_train_pairs_path
              or args.custom_prepare_train_batch_path),
         "the built-in generate, pairs and loss (no --custom-generate-function-path, --custom-loss-function-path, "
         "--custom-convert-samples-to-train-data-path, --custom-expand-samples-to-train-pairs-path or "
         "--custom-prepare-train-batch-path)"),
        (not args.diffusion_debug_mode, "no --diffusion-debug-mode (no trainer forward to compare)"),
        (not args.check_weight_sync, "no --check-weight-sync (LoRA pairs are pushed, not full weights)"),
    ]
    for ok, what in needs:
        if not ok:
            _fail(f"{flag} needs {what}")
    args.lora_ipc_weight_sync = True  # the engines need the factors themselves, not only the merged weights


def _rule_parity(args: argparse.Namespace) -> None:
    """`--rollout-patch-group` unset means exact rollout/train parity (`batch_invariant`), eager or compiled (a
    compiled side keeps its matmuls and norms opaque to the compiler: miles/models/opaque_kernels.py). `none`: no
    group (the engine batches freely; its log-probs then differ from the trainer's by the kernels' rounding)."""
    groups = args.rollout_patch_group
    if groups is None:
        groups = [BATCH_INVARIANT_GROUP]
    elif isinstance(groups, str):
        groups = [g.strip() for g in groups.split(",") if g.strip()]
    groups = [g for g in groups if g != "none"]
    args.rollout_patch_group = groups
    args.parity_forward_tile = args.micro_batch_size if BATCH_INVARIANT_GROUP in groups else 0


def _rule_engine_limits(args: argparse.Namespace) -> None:
    """The run's own requests must fit the engines' per-request limits (`--sglang-max-*`): found here, not by the
    first 400 after Ray and the engines started."""
    steps = max(args.diffusion_num_steps, args.diffusion_eval_num_steps or 0)
    for value, what, limit_flag in (
        (args.diffusion_height, "--diffusion-height", "max_image_size"),
        (args.diffusion_width, "--diffusion-width", "max_image_size"),
        (steps, "--diffusion-num-steps (or --diffusion-eval-num-steps)", "max_num_steps"),
        (args.diffusion_output_num_frames, "--diffusion-output-num-frames", "max_num_frames"),
        (args.rollout_microgroup_size, "--rollout-microgroup-size", "max_samples_per_request"),
    ):
        limit = getattr(args, f"sglang_{limit_flag}")
        if value > limit:
            _fail(f"{what} {value} exceeds the engines' --sglang-{limit_flag.replace('_', '-')} {limit}: raise that "
                  "limit or lower the run's value")
    from miles.engine.protocol import pixel_steps

    cost = pixel_steps(args.rollout_microgroup_size, steps, args.diffusion_height, args.diffusion_width,
                       args.diffusion_output_num_frames)
    if cost > args.sglang_max_request_pixel_steps:
        _fail(f"one rollout request costs {cost} pixel-steps (--rollout-microgroup-size x steps x --diffusion-height "
              f"x --diffusion-width x --diffusion-output-num-frames), over the engines' "
              f"--sglang-max-request-pixel-steps {args.sglang_max_request_pixel_steps}")


RULES: tuple[Callable[[argparse.Namespace], None], ...] = (
    _rule_values, _rule_model, _rule_topology, _rule_placement, _rule_ci, _rule_modes, _rule_batch, _rule_run_length,
    _rule_sde_steps, _rule_loss, _rule_reference, _rule_optimizer, _rule_reward, _rule_eval, _rule_outputs,
    _rule_micro_batches, _rule_rollout_gradient, _rule_parity, _rule_overlap, _rule_prefetch, _rule_engine_limits,
)


def validate_args(args: argparse.Namespace) -> None:
    """Check every rule and fill the derived values in place; the first violation raises MilesUserError."""
    for rule in RULES:
        rule(args)



def validation_rules(names: tuple[str, ...]) -> tuple[Callable[[argparse.Namespace], None], ...]:
    """The rules `_rule_<name>` for each name, in `RULES` order (test scaffolding runs a subset)."""
    by_name = {rule.__name__.removeprefix("_rule_"): rule for rule in RULES}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise KeyError(f"no such rules: {unknown}")
    return tuple(rule for name, rule in by_name.items() if name in names)
