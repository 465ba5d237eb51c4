"""The `train_diffusion.py` command line: three flag sources, YAML override, validation, derived values.

Sources (docs/cli-reference.md is generated from them by `miles.utils.cli_docs`):
- `FSDPArgs` (miles/backends/fsdp_utils/arguments.py): every field becomes `--field-name`;
- the miles flags declared below, one `Flag` each, in groups shaped like the reference's tables;
- the rollout engine's `ServerArgs` minus `SET_BY_MILES`, re-registered as `--sglang-<field-name>`.

`parse_args` parses, applies `--custom-config-path` (the YAML wins, one warning per collision), then runs
`validate_args` on the final values, so a YAML file cannot bypass a rule. Every user mistake is one
`MilesUserError` naming the flags and values; the entry point prints it as one line and exits 2.
Per-value bounds sit on each `Flag`; the cross-flag rules are the `_rule_*` functions, in table order.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, get_args, get_origin, get_type_hints

from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
STEP_STRATEGY_HUB = "miles.rollout.step_strategy_hub"

# Attributes `validate_args` adds beyond the flags (the flags themselves are resolved in place: global_batch_size,
# num_steps_per_rollout, micro_batch_size, rollout_num_gpus, offload_*, ref_mode, metrics_path, ...).
DERIVED_ATTRIBUTES = (
    "diffusion_model_family_resolved",  # family key, None with --train-pipeline-config-path
    "diffusion_log_prob_no_const_resolved",  # the log-prob form engine and trainer share (ALGORITHMS.md §2)
    "train_world_size",  # actor_num_nodes x actor_num_gpus_per_node
    "dp_size",  # train_world_size / sequence_parallel_size
    "ulysses_degree_resolved",  # --ulysses-degree with 0 resolved to the SP size
    "ring_degree",  # sequence_parallel_size / ulysses_degree_resolved
    "eval_prompt_data_pairs",  # [(name, path)] from --eval-prompt-data
    "debug_train_only",  # legacy name of train_only
)


# ---- value parsers (argparse `type=`; an ArgumentTypeError becomes a one-line user error) -----------------
def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """ "1,2,3" -> [1, 2, 3]."""
    items = [item.strip() for item in str(text).split(",")]
    try:
        return [int(item) for item in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like '1,2,3', got {text!r}") from None


def int_pair(text: str) -> list[int]:
    """ "lo,hi" -> [lo, hi]."""
    try:
        values = int_list(text)
    except argparse.ArgumentTypeError:
        values = []
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two integers 'lo,hi' like '0,5', got {text!r}")
    return values


def comma_list(text: str) -> list[str]:
    """ "sgld, ltx" -> ["sgld", "ltx"]."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list like 'a,b', got {text!r}")
    return items


_BYTE_UNITS = {"kib": 1024, "mib": MIB, "gib": 1024 * MIB, "b": 1}


def byte_size(text: str) -> int:
    """Bytes: "536870912", or with a binary unit "512MiB" / "1GiB"."""
    raw = str(text).strip().lower().replace(" ", "")
    for unit, scale in _BYTE_UNITS.items():
        if raw.endswith(unit) and raw[: -len(unit)].isdigit():
            return int(raw[: -len(unit)]) * scale
    if raw.isdigit():
        return int(raw)
    raise argparse.ArgumentTypeError(f"expected a byte count like 536870912 or 512MiB, got {text!r}")


# ---- one flag, declared once ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One command-line flag: everything `--help`, the docs and the per-value checks need."""

    name: str  # "--rollout-batch-size"
    type: Callable[[str], Any] | None = None  # value parser; None for on/off flags
    default: Any = None
    help: str = ""
    kind: str = "value"  # value | switch (store_true) | tri (--x/--no-x, None when unset) | toggle (--x/--no-x)
    choices: tuple | None = None
    nargs: str | None = None
    aliases: tuple[str, ...] = ()
    ge: float | None = None  # bounds, checked on the final (post-YAML) value when it is not None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: int | None = None
    dotted: bool = False  # a dotted path to user code; `check_user_paths` imports it when user-given
    extension: bool = False  # beyond the reference CLI
    metavar: str | None = None
    type_name: str | None = None  # how the docs show the type
    default_text: str | None = None  # how the docs show the default, when it is derived
    action: Any = None  # a custom argparse action (or "extend")

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def problem(self, value: Any) -> str | None:
        """What is wrong with a final value of this flag, or None."""
        values = value if isinstance(value, list) else [value]
        for item in values:
            if item is None or isinstance(item, (bool, str, dict)):
                if self.choices is not None and item is not None and item not in self.choices:
                    return f"must be one of {list(self.choices)}, got {item!r}"
                continue
            if isinstance(item, float) and not math.isfinite(item):
                return f"must be a finite number, got {item!r}"
            for bound, ok, word in (
                (self.ge, lambda b: item >= b, ">="),
                (self.gt, lambda b: item > b, ">"),
                (self.le, lambda b: item <= b, "<="),
                (self.lt, lambda b: item < b, "<"),
            ):
                if bound is not None and not ok(bound):
                    return f"must be {word} {bound:g}, got {item!r}"
            if self.multiple_of and item % self.multiple_of:
                return f"must be a multiple of {self.multiple_of}, got {item!r}"
        return None


def F(name: str, type: Callable | None, default: Any, help: str, **kw: Any) -> Flag:  # noqa: A002 - mirrors argparse
    return Flag(name=name, type=type, default=default, help=help, **kw)


def S(name: str, help: str, **kw: Any) -> Flag:
    """An off-by-default switch."""
    return Flag(name=name, default=False, help=help, kind="switch", **kw)


def P(name: str, help: str, default: str | None = None, **kw: Any) -> Flag:
    """A dotted path to user code."""
    return Flag(name=name, type=str, default=default, help=help, dotted=True, **kw)


class _OffloadAction(argparse.Action):
    """`--offload` = `--offload-train` + `--offload-rollout`."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.offload = namespace.offload_train = namespace.offload_rollout = True


# ---- the miles flags, in the reference's tables -------------------------------------------------------
# Groups that FSDPArgs also feeds ("Training backend", "Optimizer and schedule", "LoRA", "EMA") get its fields
# appended by `flag_groups`. `extension=True` marks flags beyond the reference CLI.
MILES_GROUPS: list[tuple[str, list[Flag]]] = [
    ("Configuration", [
        F("--custom-config-path", str, None, "YAML file of flag values (keys: flag names with _ or -). Applied after "
          "the command line; a key that names a flag overrides it with one logged warning (the YAML wins); unknown "
          "keys are set too, with a warning. Validation runs on the final values.", metavar="FILE.yaml"),
        S("--dry-run", "Print the resolved configuration and the batch geometry, then exit 0 without starting "
          "anything.", extension=True),
    ]),
    ("Cluster", [
        F("--actor-num-nodes", int, 1, "Nodes for the training actor.", ge=1),
        F("--actor-num-gpus-per-node", int, 8, "GPUs (CPU slots on a CPU run) per actor node. Train world size is "
          "nodes x this.", ge=1),
        F("--rollout-num-gpus", int, None, "GPUs for rollout-side work. Forced to the train world size under "
          "--colocate. For train-only SFT, unset colocates encoders with training; set it to reserve dedicated "
          "encoder GPUs.", ge=1),
        F("--rollout-num-gpus-per-engine", int, 1, "GPUs per engine (its TP x SP), like sglang's tp_size.", ge=1),
        F("--num-gpus-per-node", int, 8, "Total GPUs the job may use per node. Set this when using fewer than 8.",
          ge=1),
        S("--colocate", "Trainer and engines share the GPUs (the reference requires it for CUDA IPC weight sync); "
          "forces --rollout-num-gpus to the train world size and turns both offload flags on."),
        S("--offload", "--offload-train + --offload-rollout.", action=_OffloadAction),
        F("--offload-train", None, None, "Offload the trainer while engines generate. Always on under --colocate.",
          kind="tri"),
        F("--offload-rollout", None, None, "Engines release their memory while the trainer trains. Always on under "
          "--colocate.", kind="tri"),
        F("--distributed-backend", str, "nccl", "torch.distributed backend of the trainer (gloo on a CPU run)."),
        F("--distributed-timeout-minutes", int, 10, "torch.distributed timeout.", ge=1),
    ]),
    ("Training backend", [
        F("--train-backend", str, "fsdp", "Training backend. The only value.", choices=("fsdp",)),
    ]),
    ("Optimizer and schedule", [
        F("--seed", int, 1234, "Trainer seed (init, NFT/SFT noise).", ge=0),
    ]),
    ("Rollout", [
        F("--hf-checkpoint", str, None, "Required. The diffusers pipeline to train and to serve (hub id or local "
          "directory); also the family source."),
        F("--diffusion-model-family", str, None, "Registered family key (sd3, wan2_2, ltx, qwen_image, cosmos3, "
          "flux). Overrides $MILES_DIFFUSION_MODEL_FAMILY and name matching; needed when the checkpoint name "
          "carries no family hint."),
        P("--rollout-function-path", "Rollout function. Diffusion recipes set "
          "miles.rollout.sglang_diffusion_rollout.generate_rollout explicitly.",
          default="miles.rollout.sglang_rollout.generate_rollout"),
        P("--train-pipeline-config-path", "Your own TrainPipelineConfig for an unregistered family. Mutually "
          "exclusive with --diffusion-model-family."),
        P("--model-backend-path", "Override the family's model loader."),
        F("--diffusion-num-steps", int, 10, "Denoising steps per rollout sample.", ge=1),
        F("--diffusion-flow-shift", finite_float, None, "Generation-schedule shift, sent to the engine.", gt=0),
        F("--rollout-microgroup-size", int, 1, "Samples per prompt sent in one POST /rollout/generate.", ge=1),
        F("--diffusion-fps", finite_float, None, "Video only: frames per second.", gt=0),
        F("--diffusion-output-num-frames", int, 1, "Frames; 1 for images.", ge=1),
        F("--diffusion-guidance-scale", finite_float, 4.0, "CFG scale; CFG is on when > 1.", ge=0),
        F("--diffusion-guidance-scale-2", finite_float, None, "Wan2.2 low-noise expert's CFG scale; required when "
          "training transformer_2.", ge=0),
        F("--diffusion-true-cfg-scale", finite_float, None, "True-CFG scale (Qwen-Image); replaces the guidance "
          "scale when set.", ge=0),
        F("--diffusion-negative-prompt", str, None, "Negative prompt; the engine uses \" \" when CFG is on."),
        F("--diffusion-noise-level", finite_float, 0.7, "SDE noise eta injected during rollout (ALGORITHMS.md §2).",
          ge=0),
        F("--diffusion-height", int, 512, "Rollout output height; SFT center-crop size. A multiple of 16.", ge=16,
          multiple_of=16),
        F("--diffusion-width", int, 512, "Rollout output width; SFT center-crop size. A multiple of 16.", ge=16,
          multiple_of=16),
        F("--diffusion-sde-type", str, "sde", "Step kind: sde (Flow-GRPO), cps or ode. Selects the train-side SDE "
          "backend too.", choices=("sde", "cps", "ode")),
        P("--sde-step-backend-path", "Your own SdeStepBackend subclass (custom dynamics)."),
        F("--diffusion-num-sde-steps", int, 0, "How many steps become train pairs; 0 = every step (no subset "
          "selection).", ge=0),
        F("--diffusion-sde-window-range", int_pair, None, "\"lo,hi\": the sde_window range; defaults to [0, "
          "--diffusion-num-steps). Needs 0 <= lo < hi <= steps and 1 <= K <= hi-lo.", metavar="LO,HI",
          type_name='"lo,hi"'),
        F("--diffusion-sde-candidate-steps", int_list, None, "\"1,2,3\": candidate steps; required by "
          "epoch_global_random_choice.", metavar="I,J,...", type_name='"1,2,3"'),
        P("--diffusion-step-strategy-path", "Which steps are SDE steps (e.g. "
          "miles.rollout.step_strategy_hub.sde_window); overrides the bare --diffusion-num-sde-steps selection."),
        S("--diffusion-log-prob-no-const", "Drop log-prob constants (ALGORITHMS.md §2). Implied by "
          "--diffusion-sde-type cps/ode."),
        F("--diffusion-generator-device", str, "cuda", "Device of the per-sample noise generators."),
        F("--rollout-patch-group", comma_list, None, "Comma-separated numeric-parity patch groups, e.g. sgld,ltx.",
          type_name="str"),
        F("--update-weight-target-module", str, "transformer", "Modules to train and sync, comma-separated. "
          "Wan2.2: transformer,transformer_2."),
        F("--update-weight-buffer-size", byte_size, 512 * MIB, "Weight-sync chunk size in bytes (512MiB-style "
          "units accepted).", ge=1, type_name="int"),
        F("--rollout-seed", int, 42, "Base seed of rollout noise and step selection.", ge=0),
        F("--over-sampling-batch-size", int, None, "Must equal --rollout-batch-size today.", ge=1),
        F("--sglang-server-concurrency", int, 512, "Per-engine in-flight request cap.", ge=1),
        S("--use-distributed-post", "Rollout HTTP POSTs go through per-node Ray actors instead of the local client "
          "(MILES_HTTP_POST_ACTORS_PER_NODE sets the count)."),
        S("--use-miles-router", "Accepted for compatibility: miles always routes through its own router (the "
          "SGLang router is not supported), so this is always on."),
        F("--miles-router-timeout", finite_float, None, "Router request timeout in seconds.", gt=0),
        F("--miles-router-max-connections", int, None, "Router connection cap.", ge=1),
        F("--miles-router-health-check-failure-threshold", int, 3, "Failed health checks before an engine is "
          "dropped.", ge=1),
    ]),
    ("Data and batching", [
        F("--prompt-data", str, None, "jsonl, one row per prompt. Required for RL unless "
          "--disable-rollout-global-dataset or --load-debug-rollout-data."),
        F("--input-key", str, "input", "Prompt field of a row."),
        F("--metadata-key", str, "metadata", "Metadata field of a row."),
        P("--data-source-path", "Data source class; defaults to RolloutDataSourceWithBuffer."),
        S("--disable-rollout-global-dataset", "Manage data yourself."),
        F("--rollout-batch-size", int, None, "Prompts per rollout. Required unless --train-only with sft_loss.",
          ge=1, default_text="unset"),
        F("--n-samples-per-prompt", int, 1, "Samples per prompt (GRPO group size).", ge=1),
        F("--global-batch-size", int, None, "Samples per optimizer step; must divide by dp_size. Derived from "
          "rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout.", ge=1,
          default_text="derived"),
        F("--num-steps-per-rollout", int, None, "Optimizer steps per rollout; derived (1 when neither this nor "
          "--global-batch-size is set).", ge=1, default_text="derived"),
        F("--micro-batch-size", int, 1, "Flat: train pairs per DiT forward, contiguous within an optimizer window.",
          ge=1),
        F("--micro-batch-size-sample", int, None, "2D: samples per DiT-forward tile. Set with "
          "--micro-batch-size-tstep; their product replaces --micro-batch-size.", ge=1),
        F("--micro-batch-size-tstep", int, None, "2D: SDE timesteps per tile. Set with --micro-batch-size-sample.",
          ge=1),
        F("--diffusion-train-iter-order", str, "sample_major", "Tile visit order; only meaningful with the 2D pair.",
          choices=("sample_major", "timestep_major")),
        F("--train-dp-split-mode", str, "contiguous", "contiguous lets a micro-batch reproduce a rollout microgroup "
          "exactly; stride deals round-robin.", choices=("contiguous", "stride")),
        F("--num-rollout", int, None, "Total rollout iterations; unset = --num-epoch passes over --prompt-data.",
          ge=1, default_text="from dataset"),
        F("--num-epoch", int, None, "Alternative to --num-rollout: passes over --prompt-data (1 when neither is "
          "set); ignored if both are set.", ge=1),
        F("--start-rollout-id", int, None, "First rollout id; resumed from --load when unset.", ge=0),
        F("--sft-encoder-checkpoint", str, None, "SFT only: tokenizer/text_encoder/vae source."),
        F("--sft-frame-stride", int, 1, "SFT encode temporal stride.", ge=1),
    ]),
    ("Evaluation", [
        F("--eval-interval", int, None, "Evaluate every N rollouts. Requires --eval-prompt-data or --eval-config.",
          ge=1),
        F("--eval-prompt-data", str, None, "Repeatable NAME PATH pairs.", nargs="+", action="extend",
          metavar="NAME PATH", type_name="str+"),
        F("--eval-config", str, None, "OmegaConf YAML/JSON eval config; overrides --eval-prompt-data."),
        P("--eval-function-path", "Eval rollout function; defaults to --rollout-function-path."),
        F("--eval-input-key", str, None, "Prompt field of eval rows; defaults to --input-key."),
        F("--n-samples-per-eval-prompt", int, 1, "Samples per eval prompt.", ge=1),
        F("--diffusion-eval-num-steps", int, None, "Eval denoising steps; defaults to --diffusion-num-steps.", ge=1),
        S("--skip-eval-before-train", "No eval before the first rollout."),
        F("--eval-reward-key", str, None, "Key of a dict eval reward; defaults to --reward-key."),
    ]),
    ("Algorithm and loss", [
        F("--loss-type", str, "policy_loss", "policy_loss (Flow-GRPO), nft (DiffusionNFT), sft_loss or custom_loss.",
          choices=("policy_loss", "nft", "sft_loss", "custom_loss")),
        F("--advantage-estimator", str, "grpo", "Only grpo today.", choices=("grpo",)),
        S("--disable-grpo-std-normalization", "Dr.GRPO. Also forced on when --n-samples-per-prompt is 1."),
        S("--globalize-reward-mean", "Batch-wide mean instead of per-prompt. Leave off for flow_grpo parity."),
        S("--globalize-reward-std", "Batch-wide std instead of per-group. On for flow_grpo's PickScore recipe."),
        F("--diffusion-clip-range", finite_float, 1e-4, "PPO ratio clip.", gt=0),
        F("--diffusion-adv-clip-max", finite_float, 5.0, "Advantage clamp; under nft also sets the advantage-to-r "
          "slope.", gt=0),
        S("--diffusion-recompute-old-log-prob", "Recompute old log-probs with the trainer forward instead of "
          "trusting the rollout's. policy_loss only."),
        F("--diffusion-kl-beta", finite_float, 0.0, "Reference-KL coefficient; > 0 turns on a reference forward.",
          ge=0),
        F("--ref-mode", str, None, "Reference policy: none / lora_base / ema. Unset = auto: under nft ema (the "
          "LoRA base without --use-ema), else lora_base when --diffusion-kl-beta > 0 (needs --use-lora), else none.",
          choices=("none", "lora_base", "ema")),
        P("--custom-prepare-train-batch-path", "Builds DiT inputs."),
        P("--custom-loss-function-path", "Loss formula for --loss-type custom_loss (required by it); the DiT "
          "forward stays in the actor."),
        F("--diffusion-nft-beta", finite_float, 1.0, "NFT implicit-policy beta (> 0).", gt=0),
        F("--diffusion-nft-timestep-fraction", finite_float, 0.99, "NFT: fraction of the rollout sigmas trained.",
          gt=0, le=1),
        S("--no-diffusion-nft-adaptive-weight", "NFT: no adaptive x0-error weighting."),
        S("--no-diffusion-nft-shuffle-timesteps", "NFT: keep descending sigma order."),
    ]),
    ("Reward", [
        F("--rm-type", str, None, "Built-in reward. Overridable per sample via metadata.rm_type.",
          choices=("pickscore", "ocr", "remote_rm", "jpeg_compressibility", "brightness")),
        F("--rm-url", str, None, "URL of the remote reward service for --rm-type remote_rm.", extension=True),
        F("--rm-timeout", finite_float, 300.0, "Seconds per remote reward request (--rm-type remote_rm).", gt=0,
          extension=True),
        F("--rm-max-retries", int, 3, "Retries of a failed remote reward request.", ge=0, extension=True),
        F("--reward-key", str, None, "Key to read when the reward is a dict."),
        S("--group-rm", "Score a whole prompt group at once."),
        P("--custom-rm-path", "async def rm(args, samples) -> list[float]. Batched only."),
        P("--custom-reward-post-process-path", "Replace advantage normalisation: fn(args, samples) -> list[float]."),
        S("--colocate-reward", "Reward actors onto rollout GPUs (train 0.7 + rollout 0.25 + reward 0.05). Requires "
          "--colocate."),
        F("--pickscore-model-path", str, None, "Required for --rm-type pickscore."),
        F("--pickscore-processor-path", str, None, "Required for --rm-type pickscore."),
        F("--pickscore-num-workers", int, 1, "PickScore actors.", ge=1),
        F("--pickscore-num-gpus-per-worker", finite_float, 1.0, "Fractional values allowed.", ge=0),
        F("--pickscore-batch-size", int, 8, "Images per PickScore forward.", ge=1),
        F("--pickscore-num-frames", int, None, "Frames scored per video; unset = all.", ge=1),
        F("--ocr-num-workers", int, 4, "OCR actors.", ge=1),
        F("--rollout-parser-num-workers", int, 1, "Ray actors deserializing rollout responses. Raise when "
          "trajectory tensors are large.", ge=1),
    ]),
    ("Rollout customization hooks", [
        P("--custom-generate-function-path", "Replaces the inner generate call in the diffusion rollout."),
        P("--dynamic-sampling-filter-path", "Per-group keep/drop (DAPO-style)."),
        P("--rollout-sample-filter-path", "Per-sample loss mask: set sample.remove_sample = True. Samples still "
          "count for advantage normalisation."),
        P("--buffer-filter-path", "Buffer selection."),
        P("--custom-convert-samples-to-train-data-path", "The whole samples -> train-data conversion."),
        P("--custom-expand-samples-to-train-pairs-path", "Just the sample -> train-pair expansion."),
        P("--custom-rollout-log-function-path", "Train rollout logging."),
        P("--custom-eval-rollout-log-function-path", "Eval rollout logging."),
    ]),
    ("LoRA", []),
    ("EMA", []),
    ("Checkpointing", [
        F("--save", str, None, "Checkpoint directory to write."),
        F("--save-interval", int, None, "Save every N rollouts. Requires --save.", ge=1),
        S("--no-save-optim", "Smaller checkpoints, but no resumption."),
        F("--load", str, None, "Checkpoint directory to resume from."),
        F("--ckpt-step", int, None, "Defaults to latest_checkpointed_iteration.txt.", ge=0),
        S("--no-load-optim", "Do not restore the optimizer state."),
        S("--no-load-rng", "Do not restore the RNG state."),
    ]),
    ("Logging", [
        F("--output-dir", str, "outputs/miles", "The run's output folder for metrics, plots and sample images.",
          extension=True),
        F("--metrics-path", str, None, "Metrics JSONL file.", extension=True,
          default_text="<output-dir>/metrics.jsonl"),
        S("--use-wandb", "Log to Weights & Biases."),
        F("--wandb-project", str, None, "wandb project."),
        F("--wandb-group", str, None, "wandb group."),
        F("--wandb-run-id", str, None, "wandb run id."),
        F("--wandb-team", str, None, "wandb team (entity)."),
        F("--wandb-host", str, None, "wandb host."),
        F("--wandb-key", str, None, "wandb API key."),
        F("--wandb-mode", str, None, "Overrides WANDB_MODE.", choices=("online", "offline", "disabled")),
        F("--wandb-dir", str, None, "Defaults to ./wandb."),
        S("--disable-wandb-random-suffix", "Run names include a random suffix by default; this disables it."),
        F("--wandb-log-num-images", int, 0, "Images/videos per rollout; 0 disables.", ge=0),
        F("--wandb-log-image-interval", int, 1, "Send media every N rollouts.", ge=1),
        S("--use-miles-dashboard", "Async phase/trajectory telemetry."),
        F("--miles-dashboard-workspace", str, "./miles_dashboard", "Dashboard output folder."),
    ]),
    ("Fault tolerance", [
        S("--use-fault-tolerance", "Restart dead engines during rollout."),
        F("--rollout-health-check-interval", finite_float, 30.0, "Seconds between engine health checks. Raise it "
          "for video models: a request can take minutes.", gt=0),
        F("--rollout-health-check-timeout", finite_float, 30.0, "Seconds before a health check fails.", gt=0),
        F("--rollout-health-check-first-wait", finite_float, 0.0, "Grace period for compilation/init.", ge=0),
    ]),
    ("Debugging", [
        S("--debug-rollout-only", "Rollout, no training."),
        S("--train-only", "No engines, no weight sync, no eval. (--debug-train-only is a legacy alias.)",
          aliases=("--debug-train-only",)),
        S("--debug-skip-optimizer-step", "No backward/step: weights never drift. Measures pure forward divergence "
          "from the engine (with --diffusion-debug-mode)."),
        F("--save-debug-rollout-data", str, None, "Path template, .format(rollout_id=...).",
          type_name="path template"),
        F("--load-debug-rollout-data", str, None, "Path template; replays a rollout with no engines started "
          "(implies --train-only).", type_name="path template"),
        F("--load-debug-rollout-data-subsample", finite_float, None, "Fraction of the replayed samples to keep.",
          gt=0, le=1),
        F("--save-debug-train-data", str, None, "Path template, .format(rollout_id=..., rank=...).",
          type_name="path template"),
        F("--dump-details", str, None, "Sets the debug dump paths (unless given) under this folder.",
          type_name="dir"),
        S("--diffusion-debug-mode", "Engine returns per-step debug tensors; enables the model_output_*_abs_diff "
          "metrics."),
    ]),
    ("CI", [
        S("--ci-test", "CI mode (tests/e2e); not meant for manual runs."),
        F("--ci-metric-checker-key", str, None, "Metric the CI checker reads."),
        F("--ci-metric-checker-threshold", finite_float, None, "Threshold the CI checker compares against."),
    ]),
]
SGLANG_GROUP = "sglang-d passthrough"


_FLAG_FIELDS = frozenset(f.name for f in fields(Flag)) - {"name", "default", "kind"}


def _flags_from_dataclass(cls: type, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[tuple[str, Flag]]:
    """(group, Flag) for each dataclass field: bools become switches (a True default gets a --no- form)."""
    hints = get_type_hints(cls)
    out = []
    for fld in fields(cls):
        if fld.name in skip:
            continue
        meta = {key: value for key, value in fld.metadata.items() if key in _FLAG_FIELDS or key == "type"}
        group = fld.metadata.get("group")
        hint = hints[fld.name]
        optional_args = [a for a in get_args(hint) if a is not type(None)]
        if optional_args and type(None) in get_args(hint):
            hint = optional_args[0]
        default = fld.default if fld.default is not MISSING else fld.default_factory()  # type: ignore[misc]
        name = "--" + prefix + fld.name.replace("_", "-")
        if hint is bool:
            flag = Flag(name=name, default=default, kind="toggle" if default else "switch", **meta)
        else:
            if get_origin(hint) is list:
                meta.setdefault("nargs", "+")
                meta.setdefault("type_name", "str+")
                hint = get_args(hint)[0]
            value_type = meta.pop("type", None) or (finite_float if hint is float else hint)
            meta.setdefault("type_name", getattr(hint, "__name__", str(hint)))
            flag = Flag(name=name, type=value_type, default=default, **meta)
        out.append((group, flag))
    return out


_GROUPS_CACHE: list[tuple[str, list[Flag]]] | None = None


def flag_groups() -> list[tuple[str, list[Flag]]]:
    """Every flag of `train_diffusion.py`, grouped like the reference's tables (the one source of truth)."""
    global _GROUPS_CACHE
    if _GROUPS_CACHE is None:
        from miles.backends.fsdp_utils.arguments import FSDPArgs
        from miles.engine.server_args import SET_BY_MILES, ServerArgs

        groups = {title: list(flags) for title, flags in MILES_GROUPS}
        for group, flag in _flags_from_dataclass(FSDPArgs):
            groups[group].append(flag)
        taken = {flag.dest for flags in groups.values() for flag in flags}
        sglang = [f for _, f in _flags_from_dataclass(ServerArgs, "sglang-", SET_BY_MILES) if f.dest not in taken]
        groups[SGLANG_GROUP] = [
            Flag(**{**f.__dict__, "help": f"Engine ServerArgs.{f.dest.removeprefix('sglang_')}: {f.help}"})
            for f in sglang
        ]
        _GROUPS_CACHE = list(groups.items())
    return _GROUPS_CACHE


def all_flags() -> dict[str, Flag]:
    """dest -> Flag."""
    return {flag.dest: flag for _, flags in flag_groups() for flag in flags}


def default_text(flag: Flag) -> str:
    """How docs and --help show a default."""
    if flag.default_text is not None:
        return flag.default_text
    value = flag.default
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "on" if value else "off"
    if flag.type is byte_size and value % MIB == 0:
        return f"{value // MIB} MiB"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class MilesArgumentParser(argparse.ArgumentParser):
    """argparse whose own errors (unknown flag, bad value) are one-line `MilesUserError`s (exit status 2)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        # Read "-1e-6" as a (negative) value, not as an unknown option; argparse only knows "-1" and "-0.5".
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):  # type: ignore[override]
        hints = []
        if message.startswith("unrecognized arguments:"):
            for token in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(token.split("=")[0], self._option_string_actions, n=1, cutoff=0.75)
                if token.startswith("--") and close:
                    hints.append(f"did you mean {close[0]} for {token}?")
        raise MilesUserError(" ".join([message, *hints, f"(see {self.prog} --help)"]))


def _add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
    names = [flag.name, *flag.aliases]
    help_text = (flag.help + (" [extension: not in the reference CLI]" if flag.extension else "")).replace("%", "%%")
    if flag.kind in ("switch", "tri", "toggle") and flag.action is None:
        if flag.kind == "switch":
            group.add_argument(*names, action="store_true", default=flag.default, help=help_text)
        else:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, default=flag.default,
                               help=f"{help_text} [default: {default_text(flag)}]")
        return
    if flag.kind == "switch":  # a custom zero-argument action
        group.add_argument(*names, action=flag.action, default=flag.default, help=help_text)
        return
    kwargs: dict[str, Any] = {"type": flag.type, "default": flag.default, "dest": flag.dest}
    if flag.choices:
        kwargs["choices"] = flag.choices
    if flag.nargs:
        kwargs["nargs"] = flag.nargs
    if flag.action:
        kwargs["action"] = flag.action
    metavar = flag.metavar or _METAVARS.get(flag.type_name or getattr(flag.type, "__name__", ""), "VALUE")
    if not flag.choices or flag.metavar:
        kwargs["metavar"] = tuple(metavar.split()) if " " in metavar else metavar
    kwargs["help"] = f"{help_text} [default: {default_text(flag)}]"
    group.add_argument(*names, **kwargs)


_METAVARS = {"int": "N", "float": "X", "finite_float": "X", "str": "STR", "str+": "STR", "path template": "TEMPLATE",
             "dir": "DIR"}


def build_parser() -> argparse.ArgumentParser:
    parser = MilesArgumentParser(
        prog="train_diffusion.py",
        usage="%(prog)s --hf-checkpoint PATH [options]   (--help lists every flag by group)",
        description="RL post-training (Flow-GRPO, DiffusionNFT, SFT) for image and video diffusion models.",
        allow_abbrev=False,
    )
    for title, flags in flag_groups():
        group = parser.add_argument_group(title)
        for flag in flags:
            _add_flag(group, flag)
    return parser


# ---- --custom-config-path ---------------------------------------------------------------------------------
ALIAS_DESTS = {"debug_train_only": "train_only"}


def _coerce_yaml_value(flag: Flag, value: Any) -> Any:
    """A YAML value in the flag's parsed form (YAML reads `1e-4` as a string; "0,5" and [0, 5] both work)."""
    if value is None:
        return None
    if flag.kind in ("switch", "tri", "toggle"):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if flag.nargs:
        items = value if isinstance(value, list) else str(value).split()
        return [flag.type(str(item)) if flag.type else item for item in items]
    if flag.type in (int_pair, int_list, comma_list) and isinstance(value, list):
        value = ",".join(str(item) for item in value)
    if isinstance(value, dict) and getattr(flag.type, "__name__", "") == "json_object":
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a single {flag.type_name or flag.type.__name__} value, got {value!r}")
    if flag.type is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        value = int(value)
    return flag.type(str(value))


def apply_config_file(args: argparse.Namespace) -> None:
    """Apply --custom-config-path: the YAML wins over the command line, with one warning per overridden flag."""
    import yaml

    path = args.custom_config_path
    where = f"--custom-config-path {path!r}"
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise MilesUserError(f"{where}: cannot read the file: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise MilesUserError(f"{where}: not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise MilesUserError(f"{where}: expected a mapping of flag names to values, got a {type(data).__name__}")
    flags = all_flags()
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        key = ALIAS_DESTS.get(key, key)
        flag = flags.get(key)
        if flag is None:
            logger.warning("%s: key %r is not a miles flag; setting args.%s = %r anyway", where, raw_key, key, value)
            setattr(args, key, value)
            continue
        try:
            new_value = _coerce_yaml_value(flag, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            raise MilesUserError(f"{where}: key {raw_key!r} ({flag.name}): {err}") from None
        logger.warning("%s: key %r overrides %s (%r -> %r)", where, raw_key, flag.name, getattr(args, key), new_value)
        setattr(args, key, new_value)
        if key == "offload" and new_value:
            args.offload_train = args.offload_rollout = True


# ---- batch geometry (ALGORITHMS.md §3, §5) ----------------------------------------------------------------
def _strategy(args: argparse.Namespace) -> str | None:
    """The step-strategy function name when it is one of the hub's, "custom" for a user's, None for the bare count."""
    path = args.diffusion_step_strategy_path
    if not path:
        return None
    module, _, name = path.replace(":", ".").rpartition(".")
    return name if module == STEP_STRATEGY_HUB else "custom"


def trained_steps_per_trajectory(args: argparse.Namespace) -> tuple[int | None, str]:
    """Train pairs per sample and how that number is chosen (None when a user function decides)."""
    n, k = args.diffusion_num_steps, args.diffusion_num_sde_steps
    if args.loss_type == "sft_loss":
        return 1, "sft_loss: one (image, sigma) pair per sample"
    if args.loss_type == "nft":  # same count as miles.diffusion.losses.nft_train_sigmas (ALGORITHMS.md §6)
        kept = max(1, math.floor(n * args.diffusion_nft_timestep_fraction + 1e-9))
        return kept, "nft: max(1, floor(steps x timestep fraction))"
    strategy = _strategy(args)
    if strategy == "epoch_global_random_choice":
        candidates = args.diffusion_sde_candidate_steps or []
        chosen = len(candidates) if k == 0 else min(k, len(candidates))
        return chosen, "epoch_global_random_choice: K of the candidates (all when K is 0 or >= their count)"
    if strategy == "ode_and_return_last":
        return 0, "ode_and_return_last: no SDE step"
    if strategy in (None, "sde_window", "all_steps_or_window"):
        return (k, "K = --diffusion-num-sde-steps") if k > 0 else (n, "every step (--diffusion-num-sde-steps 0)")
    return None, f"chosen per sample by {args.diffusion_step_strategy_path}"


@dataclass(frozen=True)
class BatchGeometry:
    prompts: int | None
    samples_per_prompt: int
    trajectories: int | None
    trained_steps_per_trajectory: int | None
    steps_rule: str
    pairs: int | None
    dp_size: int
    pairs_per_rank: int | None
    optimizer_steps: int | None
    pairs_per_rank_per_optimizer_step: int | None
    micro_batch_size: int
    forwards_per_optimizer_step: int | None  # DiT forwards (micro-batches) per rank; CFG doubles each batch


def batch_geometry(args: argparse.Namespace) -> BatchGeometry:
    steps, rule = trained_steps_per_trajectory(args)
    prompts = args.rollout_batch_size
    trajectories = args.global_batch_size * args.num_steps_per_rollout if args.global_batch_size else None
    pairs = trajectories * steps if trajectories is not None and steps is not None else None
    per_rank = pairs // args.dp_size if pairs is not None else None
    per_step = per_rank // args.num_steps_per_rollout if per_rank is not None else None
    return BatchGeometry(
        prompts=prompts,
        samples_per_prompt=args.n_samples_per_prompt,
        trajectories=trajectories,
        trained_steps_per_trajectory=steps,
        steps_rule=rule,
        pairs=pairs,
        dp_size=args.dp_size,
        pairs_per_rank=per_rank,
        optimizer_steps=args.num_steps_per_rollout,
        pairs_per_rank_per_optimizer_step=per_step,
        micro_batch_size=args.micro_batch_size,
        forwards_per_optimizer_step=-(-per_step // args.micro_batch_size) if per_step is not None else None,
    )


# ---- validation and derived values: one rule per concern, in table order ---------------------------------
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
        from miles.models import resolve_family_name

        args.diffusion_model_family_resolved = resolve_family_name(args.hf_checkpoint, args.diffusion_model_family)
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
    args.use_miles_router = True  # miles always routes through its own router


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
    """rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout (ALGORITHMS.md §5)."""
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
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size != rbs:
        _fail(f"--over-sampling-batch-size {args.over_sampling_batch_size} must equal --rollout-batch-size {rbs} "
              "(over-sampling is not supported yet)")
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
        args.disable_grpo_std_normalization = True  # the std of a single sample is undefined (ALGORITHMS.md §4)
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
    # Unset --num-rollout is derived from the dataset (miles.rollout.data_source.num_rollout_from_args: --num-epoch
    # passes, one by default), which needs the global prompt dataset.
    from_dataset = bool(args.prompt_data) and not args.disable_rollout_global_dataset
    if args.num_rollout is None and not from_dataset:
        what = f"--num-epoch {args.num_epoch}" if args.num_epoch is not None else "an unset --num-rollout"
        _fail(f"{what} counts passes over --prompt-data, but there is no global prompt dataset "
              "(--prompt-data unset or --disable-rollout-global-dataset); set --num-rollout N")


def _rule_sde_steps(args: argparse.Namespace) -> None:
    """Which steps become train pairs (ALGORITHMS.md §3)."""
    n, k, strategy = args.diffusion_num_steps, args.diffusion_num_sde_steps, _strategy(args)
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
    # One log-prob form for engine and trainer (ALGORITHMS.md §2): no-const for cps/ode or when asked.
    from miles.diffusion.sde import use_no_const_log_prob

    args.diffusion_log_prob_no_const_resolved = use_no_const_log_prob(
        args.diffusion_sde_type, args.diffusion_log_prob_no_const
    )


def _rule_reference(args: argparse.Namespace) -> None:
    """--ref-mode auto rules and --use-ema consumers (ALGORITHMS.md §5, §6, §8)."""
    loss, kl = args.loss_type, args.diffusion_kl_beta
    if args.ref_mode is None:
        if loss == "nft":  # v_old: the EMA, else the LoRA base (ALGORITHMS.md §6)
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


def _rule_optimizer(args: argparse.Namespace) -> None:
    """LR schedule sanity (ALGORITHMS.md §9) and the checkpoint-vs-override scheduler rule."""
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


def _rule_reward(args: argparse.Namespace) -> None:
    if args.rm_type == "pickscore" and not (args.pickscore_model_path and args.pickscore_processor_path):
        _fail("--rm-type pickscore needs --pickscore-model-path and --pickscore-processor-path "
              f"(got {args.pickscore_model_path!r}, {args.pickscore_processor_path!r})")
    if args.rm_type == "remote_rm" and not args.rm_url:
        _fail("--rm-type remote_rm needs --rm-url (the reward service's URL)")


def _rule_eval(args: argparse.Namespace) -> None:
    pairs = args.eval_prompt_data or []
    if len(pairs) % 2:
        _fail(f"--eval-prompt-data takes NAME PATH pairs, got an odd count: {pairs}")
    names = pairs[0::2]
    if len(set(names)) != len(names):
        _fail(f"--eval-prompt-data repeats a dataset name: {names}")
    args.eval_prompt_data_pairs = list(zip(names, pairs[1::2]))
    if args.eval_interval is not None and not args.eval_prompt_data_pairs and not args.eval_config:
        _fail(f"--eval-interval {args.eval_interval} needs eval datasets: --eval-prompt-data NAME PATH or "
              "--eval-config FILE")


def _rule_outputs(args: argparse.Namespace) -> None:
    if args.save_interval is not None and not args.save:
        _fail(f"--save-interval {args.save_interval} needs --save DIR")
    if args.metrics_path is None:
        args.metrics_path = os.path.join(args.output_dir, "metrics.jsonl")


def _rule_micro_batches(args: argparse.Namespace) -> None:
    """A rank's pairs per optimizer window split into whole micro-batches (ALGORITHMS.md §5: Q % m == 0)."""
    geometry = batch_geometry(args)
    q, m = geometry.pairs_per_rank_per_optimizer_step, args.micro_batch_size
    if q == 0:
        _fail(f"no train pairs: {geometry.steps_rule} gives 0 trained steps per sample")
    if q is not None and q % m:
        _fail(f"--micro-batch-size {m} must divide the {q} train pairs per DP rank per optimizer step "
              f"(--global-batch-size {args.global_batch_size} / dp_size {args.dp_size} x "
              f"{geometry.trained_steps_per_trajectory} trained steps per sample)")


RULES: tuple[Callable[[argparse.Namespace], None], ...] = (
    _rule_values, _rule_model, _rule_topology, _rule_placement, _rule_modes, _rule_batch, _rule_run_length,
    _rule_sde_steps, _rule_loss, _rule_reference, _rule_optimizer, _rule_reward, _rule_eval, _rule_outputs,
    _rule_micro_batches,
)


def validate_args(args: argparse.Namespace) -> None:
    """Check every rule and fill the derived values in place; the first violation raises MilesUserError."""
    for rule in RULES:
        rule(args)


def check_user_paths(args: argparse.Namespace) -> None:
    """Import every user-given dotted path (defaults are the project's own) and check the data files exist.

    Separate from `validate_args` because it imports user code; the entry point calls it right after parsing.
    """
    from miles.utils.imports import load_object

    for dest, flag in all_flags().items():
        value = getattr(args, dest, None)
        if flag.dotted and value and value != flag.default:
            load_object(value, flag.name)
    files = [("--prompt-data", args.prompt_data), ("--eval-config", args.eval_config)]
    files += [("--eval-prompt-data", path) for _, path in getattr(args, "eval_prompt_data_pairs", [])]
    for flag_name, path in files:
        if path and not os.path.exists(path):
            _fail(f"{flag_name} {path!r}: no such file")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, apply --custom-config-path, validate and derive. Raises MilesUserError on any user mistake."""
    args = build_parser().parse_args(argv)
    for dest, flag in all_flags().items():
        if isinstance(flag.default, (dict, list)) and getattr(args, dest) is flag.default:
            setattr(args, dest, type(flag.default)(flag.default))  # never share a mutable default between runs
    if args.custom_config_path:
        apply_config_file(args)
    validate_args(args)
    return args


def format_dry_run(args: argparse.Namespace) -> str:
    """The resolved configuration and the batch geometry, as `--dry-run` prints them."""
    from miles.utils.cli_docs import render_dry_run

    return render_dry_run(args)
