"""The flag declarations of `train_diffusion.py`: one `Flag` each, grouped like docs/cli-reference.md's tables.

Three sources make up the command line, all assembled by `flag_groups()` (the one source of truth that
`--help`, `docs/cli-reference.md`, the YAML override and the per-value checks read):
- `FSDPArgs` (miles/config/backend_flags.py): every field becomes `--field-name`;
- the miles flags declared below in `MILES_GROUPS`;
- the rollout engine's `ServerArgs` minus `SET_BY_MILES`, re-registered as `--sglang-<field-name>`.

Per-value bounds and choices sit on each `Flag` (`Flag.problem`); the cross-flag rules are in
`miles.config.validation`, in the same table order.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, get_args, get_origin, get_type_hints

from miles.config.schedule import DEFAULT_EVAL_INTERVAL
from miles.utils.defaults import DEFAULT_NOISE_LEVEL

MIB = 1024 * 1024
DEFAULT_VLM_JUDGE_PROMPT = (
    'Rate how well this image matches the description "{prompt}" on a scale from 0 to 10, where 10 is a perfect '
    "match. Reply with only the number."
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


# Each built-in reward and what it gives a sample: None a float (one component, named after the reward), a tuple
# the keys of its dict (tests/rollout/test_rm_shapes.py holds `shapes` to its), RUNTIME_KEYS a value its service
# decides at run time.
RUNTIME_KEYS = "decided by its service"
BUILTIN_REWARD_OUTPUTS: dict[str, tuple[str, ...] | str | None] = {
    "pickscore": None, "ocr": None, "remote_rm": RUNTIME_KEYS, "jpeg_compressibility": None, "brightness": None,
    "clipscore": None, "aesthetic": None, "vlm_judge": None, "geneval": RUNTIME_KEYS,
    "shapes": ("shapes", "shapes_correct"),
}
REWARD_TYPE_NAMES = tuple(BUILTIN_REWARD_OUTPUTS)


class RewardTypeChoices(tuple):
    """The built-in rewards as `choices`; a comma-separated list of them ("ocr,pickscore") is a member too, so
    argparse, `--help` and `Flag.problem` accept several rewards per sample."""

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        parts = [part.strip() for part in value.split(",")]
        return all(tuple.__contains__(self, part) for part in parts) and len(set(parts)) == len(parts)


REWARD_TYPES = RewardTypeChoices(REWARD_TYPE_NAMES)


def parse_reward_weights(value: Any) -> dict[str, float]:
    """ "ocr=1,pickscore=0.5" (or a YAML mapping) -> {"ocr": 1.0, "pickscore": 0.5}; ValueError says what is wrong."""
    if isinstance(value, dict):
        items = [(str(name), weight) for name, weight in value.items()]
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            name, sep, weight = part.partition("=")
            if not sep:
                raise ValueError(f"expected name=weight pairs like 'ocr=1,pickscore=0.5', got {value!r}")
            items.append((name.strip(), weight.strip()))
    weights: dict[str, float] = {}
    for name, weight in items:
        if not name:
            raise ValueError(f"a weight without a component name in {value!r}")
        if name in weights:
            raise ValueError(f"component {name!r} is weighted twice in {value!r}")
        try:
            number = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"the weight of {name!r} is not a number: {weight!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"the weight of {name!r} must be finite, got {weight!r}")
        weights[name] = number
    if not weights:
        raise ValueError(f"expected name=weight pairs like 'ocr=1,pickscore=0.5', got {value!r}")
    if all(weight == 0 for weight in weights.values()):
        raise ValueError(f"every weight is 0 in {value!r}: the trained reward would be a constant")
    return weights


def reward_weights(text: str) -> dict[str, float]:
    try:
        return parse_reward_weights(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
          "the command line; a key that names a flag overrides it with one logged warning (the YAML wins); an "
          "unknown key close to a flag name is an error (\"did you mean\"), other unknown keys are set too, with a "
          "warning, for your hooks. Validation runs on the final values.", metavar="FILE.yaml"),
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
        F("--num-gpus-per-node", int, 8, "Total GPUs the job may use per node. Set this when using fewer than 8: a "
          "Ray cluster miles starts itself gets at most this many of the node's GPUs, and --actor-num-gpus-per-node "
          "and --rollout-num-gpus-per-engine must fit in it.", ge=1),
        S("--colocate", "Trainer and engines share the GPUs (the reference requires it for CUDA IPC weight sync); "
          "forces --rollout-num-gpus to the train world size and turns both offload flags on."),
        S("--offload", "--offload-train + --offload-rollout.", action=_OffloadAction),
        F("--offload-train", None, None, "Offload the trainer while engines generate. Always on under --colocate.",
          kind="tri"),
        F("--offload-rollout", None, None, "Engines release their memory while the trainer trains. Always on under "
          "--colocate.", kind="tri"),
        F("--colocate-offload-policy", str, "auto", "Under --colocate: 'always' takes turns (offload/release) every "
          "iteration; 'auto' takes turns in the first iteration, measures both sides' GPU memory, and from then on "
          "keeps both resident when both peaks fit, else only the engines release while the trainer trains when "
          "the engine's peak fits beside the resting trainer, else keeps both resident when the trainer parks its "
          "optimizer state on the host while it trains; 'park' tries that parking before the engines' release "
          "(docs/training.md).",
          choices=("auto", "park", "always"), extension=True),
        S("--overlap-rollout", "Generate rollout k+1 on the engines while the trainer trains on rollout k (one step "
          "off-policy; the ratio is taken against the engines' log-probs, `rollout/staleness` logs the lag). Needs "
          "engines of their own (not --colocate).", extension=True),
        F("--rollout-prefetch", str, "auto", "Send rollout k+1 to the engines while the trainer trains on rollout "
          "k: they encode its prompts and initial noise at once and denoise it only on the weights trained on "
          "rollout k (on-policy, the same samples bit for bit). auto: on where it applies (the built-in rollout "
          "and generate, engines that stay resident while the trainer trains: no --colocate or --offload-rollout, "
          "or the trainer on the host; no --overlap-rollout, no --miles-router-timeout), else off. "
          "docs/training.md.",
          choices=("auto", "on", "off"), extension=True),
        F("--colocate-memory-margin-gb", float, 8.0, "GiB that must stay free on each GPU for "
          "--colocate-offload-policy auto to keep trainer and engines resident, and beside the trainer's projected "
          "training peak, else its optimizer state waits on the host during forwards and backwards "
          "(docs/training.md).", ge=0, extension=True),
        F("--ray-address", str, None, "The Ray cluster to join (the address `ray start --head` printed, or `auto` "
          "on a node of it; docs/cluster.md). Unset: $RAY_ADDRESS when set, else the run starts a Ray instance of "
          "its own that ends with it, so several runs (and other Ray users) share a machine without meeting. "
          "`local` also means a private instance.", extension=True, metavar="ADDRESS"),
        F("--distributed-backend", str, "nccl", "torch.distributed backend of the trainer's process group on GPU "
          "(with --fsdp-cpu-offload, its cuda part). A CPU run uses gloo whatever the value, and logs it once.",
          choices=("nccl", "gloo")),
        F("--distributed-timeout-minutes", int, 10, "torch.distributed timeout.", ge=1),
    ]),
    ("Training backend", [
        F("--train-backend", str, "fsdp", "Training backend: FSDP2 (miles/backends/fsdp_utils). The only value; "
          "any other is refused.", choices=("fsdp",)),
    ]),
    ("Optimizer and schedule", [
        F("--seed", int, 1234, "Trainer seed (init, NFT/SFT noise).", ge=0),
    ]),
    ("Rollout", [
        F("--hf-checkpoint", str, None, "Required. The diffusers pipeline to train and to serve (hub id or local "
          "directory); also the family source."),
        F("--diffusion-model-family", str, None, "Registered family key (docs/models.md lists them; an unknown key is "
          "refused with the list). Overrides $MILES_DIFFUSION_MODEL_FAMILY, a local folder's model_index.json pipeline class and name "
          "matching; needed when none of those tells the family."),
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
        F("--diffusion-noise-level", finite_float, DEFAULT_NOISE_LEVEL, "SDE noise eta injected during rollout (docs/algorithms.md §2).",
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
        S("--diffusion-log-prob-no-const", "Drop log-prob constants (docs/algorithms.md §2). Implied by "
          "--diffusion-sde-type cps/ode."),
        F("--diffusion-generator-device", str, "cuda", "Device of the per-sample noise generators."),
        F("--rollout-patch-group", comma_list, None, "Comma-separated numeric-parity patch groups, e.g. sgld,ltx.",
          type_name="str"),
        F("--update-weight-target-module", str, "transformer", "Modules to train and sync, comma-separated. "
          "Wan2.2: transformer,transformer_2."),
        F("--update-weight-buffer-size", byte_size, 512 * MIB, "Weight-sync chunk size in bytes (512MiB-style "
          "units accepted).", ge=1, type_name="int"),
        F("--update-weight-transport", str, "auto", "How weights reach the engines: 'ipc' (shared memory on CPU, "
          "CUDA IPC on GPU: the engine must share the trainer's device and host), 'broadcast' (a torch.distributed "
          "group of the trainer's rank 0 and every engine: NCCL on GPU, gloo on CPU; works across devices and "
          "nodes), or 'auto': broadcast without --colocate, and under --colocate ipc for the engines on the "
          "trainer rank 0's device, broadcast for the others.", choices=("auto", "ipc", "broadcast"),
          extension=True),
        S("--check-weight-sync", "After every weight push, compare each engine's per-tensor checksums with the "
          "pushed tensors (rank 0 hashes them in the engine's dtype as they go) and fail the run on a mismatch. "
          "Costs a host copy and a sha256 of every synced tensor; full-weight pushes only.", extension=True),
        F("--rollout-seed", int, 42, "Base seed of rollout noise and step selection.", ge=0),
        F("--over-sampling-batch-size", int, None, "Prompt groups a rollout starts at once (>= --rollout-batch-size; "
          "unset = --rollout-batch-size). With --dynamic-sampling-filter-path dropping groups, the extra ones fill "
          "the batch without waiting for replacements; --rollout-batch-size kept groups are trained, the rest are "
          "left out (rollout/num_groups_unused).", ge=1),
        F("--sglang-server-concurrency", int, 512, "Per-engine in-flight request cap.", ge=1),
        S("--use-distributed-post", "Rollout HTTP POSTs go through per-node Ray actors instead of the local client "
          "(MILES_HTTP_POST_ACTORS_PER_NODE sets the count)."),
        S("--use-miles-router", "Required by the reference (the SGLang router is not supported). miles always "
          "routes rollout requests through its own router, so it is implied: on whether given or not."),
        F("--miles-router-timeout", finite_float, None, "Router request timeout in seconds.", gt=0),
        F("--miles-router-max-connections", int, None, "Router connection cap.", ge=1),
        F("--miles-router-health-check-failure-threshold", int, 3, "Failed health checks before an engine is "
          "dropped.", ge=1),
    ]),
    ("Data and batching", [
        F("--prompt-data", str, None, "jsonl, one row per prompt; also a .txt file (one prompt per line) or GenEval "
          "metadata (*_metadata.jsonl), docs/data.md. Required for RL unless --disable-rollout-global-dataset or "
          "--load-debug-rollout-data."),
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
        F("--sft-cache-dir", str, None, "Where SFT encodings are cached; default <jsonl folder>/.miles_sft_cache.",
          extension=True),
        F("--sft-encode-batch-size", int, 8, "Images encoded per VAE/text-encoder call for SFT data.", ge=1,
          extension=True),
        S("--no-rollout-shuffle", "Walk --prompt-data in file order instead of a seeded permutation per epoch.",
          extension=True),
    ]),
    ("Evaluation", [
        F("--eval-interval", int, None, "Evaluate every N rollouts (before rollout 0 too, unless "
          "--skip-eval-before-train, and after the last one). Requires --eval-prompt-data or --eval-config; with "
          f"them, unset means every {DEFAULT_EVAL_INTERVAL} rollouts.", ge=1,
          default_text=f"{DEFAULT_EVAL_INTERVAL} with eval sets"),
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
        F("--advantage-estimator", str, "grpo", "grpo: group-relative advantages (docs/algorithms.md §4). The "
          "only value; any other is refused. --custom-reward-post-process-path replaces it with your own.",
          choices=("grpo",)),
        S("--disable-grpo-std-normalization", "Dr.GRPO. Also forced on when --n-samples-per-prompt is 1."),
        S("--globalize-reward-mean", "Batch-wide mean instead of per-prompt. Leave off for flow_grpo parity."),
        S("--globalize-reward-std", "Batch-wide std instead of per-group. On for flow_grpo's PickScore recipe."),
        F("--diffusion-clip-range", finite_float, 1e-4, "PPO ratio clip.", gt=0),
        F("--diffusion-adv-clip-max", finite_float, 5.0, "Advantage clamp; under nft also sets the advantage-to-r "
          "slope.", gt=0),
        S("--diffusion-recompute-old-log-prob", "Recompute old log-probs with the trainer forward instead of "
          "trusting the rollout's. policy_loss only."),
        S("--diffusion-rollout-gradient", "LoRA Flow-GRPO, one optimizer step per rollout: the engines take each "
          "sample's log-prob gradient during the rollout and the trainer steps on Σ −clip(A)·∇ℓ / pairs without "
          "replaying the forwards (on-policy by construction; implies --lora-ipc-weight-sync). docs/algorithms.md "
          "§5.", extension=True),
        F("--rollout-gradient-tile", int, 0, "Under --diffusion-rollout-gradient: samples per forward-with-backward "
          "in the engines (0: --micro-batch-size). Each sample's gradient is its own whatever the tile; a larger "
          "tile keeps the GPU busier and holds that many samples' activations. The batch_invariant group still "
          "forwards in --micro-batch-size tiles; --rollout-patch-group none lifts that (exactness does not need "
          "the group here: no trainer forward has to match).", ge=0, extension=True),
        F("--rollout-gradient-trainer", str, "auto", "Under --diffusion-rollout-gradient, where the trainer "
          "process runs. device: on the GPU it shares with the engine (the GPU on a GPU run). host: on the CPU, "
          "never touching a GPU (no CUDA context and no memory beside the engine's): the trainer runs no forward "
          "in this mode, only the adapters' fused AdamW step, and the engines add their gradient into, and read "
          "the new factors from, shared-memory files; needs --colocate on one node (--actor-num-nodes 1). auto: "
          "host for one colocated trainer rank (--colocate, --actor-num-nodes 1, --actor-num-gpus-per-node 1), "
          "else device. docs/training.md.",
          choices=("auto", "device", "host"), extension=True),
        F("--rollout-gradient-engine-step", str, "auto", "Under --diffusion-rollout-gradient with the trainer on the "
          "host: auto: where one engine holds the rollout and shares the trainer's memory, that engine takes the "
          "optimizer step on its own adapter too, with the trainer's AdamW arithmetic (both sides run the same "
          "correctly rounded fp32 operations and the trainer checks the engine's checksum each step), so the next "
          "rollout starts without a weight push; the trainer keeps the run's weights and moments. off: the trainer "
          "steps with torch's fused AdamW and pushes the factors. docs/training.md.",
          choices=("auto", "off"), extension=True),
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
        F("--rm-type", str, None, "Built-in reward, or several comma-separated (e.g. ocr,pickscore): each sample then "
          "gets every component, combined by --reward-weights or picked by --reward-key. Overridable per sample via "
          "metadata.rm_type.", choices=REWARD_TYPES),
        F("--rm-url", str, None, "URL of the remote reward service for --rm-type remote_rm.", extension=True),
        F("--rm-timeout", finite_float, 300.0, "Seconds per HTTP reward request (remote_rm, vlm_judge, geneval).",
          gt=0, extension=True),
        F("--rm-max-retries", int, 3, "Retries of a failed HTTP reward request (remote_rm, vlm_judge, geneval).",
          ge=0, extension=True),
        F("--reward-weights", reward_weights, None, "The trained reward as a weighted sum of reward components, e.g. "
          "ocr=1,pickscore=0.5 (components: the rewards of --rm-type, or the keys of a dict reward). Excludes "
          "--reward-key. Every component is logged as rollout/reward/<name>_mean and _std.", extension=True,
          metavar="NAME=W,...", type_name="name=w,..."),
        F("--reward-key", str, None, "Key to read when the reward is a dict."),
        S("--group-rm", "Score a whole prompt group at once."),
        P("--custom-rm-path", "async def rm(args, samples) -> list[float]. Batched only."),
        P("--custom-reward-post-process-path", "Replace advantage normalisation: fn(args, samples) -> list[float]."),
        S("--colocate-reward", "Reward actors onto rollout GPUs (train 0.7 + rollout 0.25 + reward 0.05). Requires "
          "--colocate. The model rewards' workers (pickscore, clipscore, aesthetic) go onto the colocated bundles, "
          "splitting each GPU's 0.05 among those on it; ocr and the HTTP rewards need no GPU."),
        F("--pickscore-model-path", str, None, "Required for --rm-type pickscore."),
        F("--pickscore-processor-path", str, None, "Required for --rm-type pickscore."),
        F("--pickscore-num-workers", int, 1, "PickScore actors.", ge=1),
        F("--pickscore-num-gpus-per-worker", finite_float, 1.0, "Fractional values allowed.", ge=0),
        F("--pickscore-batch-size", int, 8, "Images per PickScore forward.", ge=1),
        F("--pickscore-num-frames", int, None, "Frames scored per video; unset = all. Also used by clipscore and "
          "aesthetic.", ge=1),
        F("--clipscore-model-path", str, None, "CLIP folder (model + processor) for --rm-type clipscore.",
          extension=True),
        F("--aesthetic-model-path", str, None, "CLIP folder (model + processor) for --rm-type aesthetic.",
          extension=True),
        F("--aesthetic-head-path", str, None, "Safetensors file of the aesthetic head on CLIP image embeddings "
          "(LAION aesthetic predictor style) for --rm-type aesthetic.", extension=True),
        F("--clip-reward-num-workers", int, 1, "Ray actors of each of clipscore and aesthetic.", ge=1,
          extension=True),
        F("--clip-reward-num-gpus-per-worker", finite_float, 1.0, "GPUs per clipscore/aesthetic actor; fractional "
          "values allowed.", ge=0, extension=True),
        F("--clip-reward-batch-size", int, 8, "Images per clipscore/aesthetic forward.", ge=1, extension=True),
        F("--vlm-judge-url", str, None, "OpenAI-compatible endpoint for --rm-type vlm_judge: the base URL "
          "(http://host:8000/v1) or the full .../chat/completions URL.", extension=True),
        F("--vlm-judge-model", str, None, "The \"model\" field of the vlm_judge chat request.", extension=True),
        F("--vlm-judge-prompt", str, DEFAULT_VLM_JUDGE_PROMPT, "Question sent with each image; {prompt} is "
          "replaced by the sample's prompt. The reward is the first number in the reply.", extension=True,
          default_text="asks for a 0-10 match score"),
        F("--vlm-judge-api-key-env", str, "MILES_VLM_JUDGE_API_KEY", "Environment variable holding the vlm_judge "
          "API key (sent as Authorization: Bearer); unset variable = no key.", extension=True),
        F("--vlm-judge-max-concurrency", int, 8, "vlm_judge requests in flight at once.", ge=1, extension=True),
        F("--geneval-url", str, None, "URL of a GenEval-style scorer for --rm-type geneval (remote_rm wire format; "
          "samples need metadata tag and include).", extension=True),
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
        F("--save-keep-latest", int, None, "Keep only the newest K checkpoints under --save: after each complete "
          "save the older iter_* folders are deleted (the one just saved always stays). Unset keeps all.", ge=1,
          extension=True, metavar="K"),
        S("--no-save-optim", "Smaller checkpoints, but no resumption."),
        F("--load", str, None, "Checkpoint directory to resume from."),
        F("--ckpt-step", int, None, "Defaults to latest_checkpointed_iteration.txt.", ge=0),
        S("--no-load-optim", "Do not restore the optimizer state."),
        S("--no-load-rng", "Do not restore the RNG state."),
        F("--export-interval", int, None, "Every N rollouts and after the last one, write the policy the engines "
          "serve for inference to <--output-dir>/export/iter_<rollout id>/: a diffusers LoRA adapter for a "
          "--use-lora run, else a complete pipeline folder. `python -m miles.export` does the same from a "
          "checkpoint (docs/training.md).", ge=1, extension=True, metavar="N"),
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
        F("--wandb-log-num-images", int, 0, "Images/videos per rollout sent to wandb; 0 disables. Every eval's images "
          "are written to <output-dir>/eval/<rollout_id>/ whatever this says.", ge=0),
        F("--wandb-log-image-interval", int, 1, "Send media every N rollouts.", ge=1),
        S("--use-tensorboard", "Also write every metric (scalars) and the sample grid to TensorBoard under "
          "<output-dir>/tensorboard (needs the tensorboard package).", extension=True),
        F("--plot-interval", int, 10, "Every N rollouts, rewrite <output-dir>/samples.png (captioned samples of the "
          "first and the latest rollout), reward_curve.png (rollout and eval rewards since the run's first "
          "rollout, across resumes) and, for video families, the latest samples as videos/*.mp4; the grid also "
          "goes to TensorBoard and wandb. They are written again when the run ends, however it ends.", ge=1,
          extension=True),
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
        S("--ci-test", "CI mode (tests/e2e); not meant for manual runs. At the end of the run the metric checker "
          "passes if any logged value of --ci-metric-checker-key is >= --ci-metric-checker-threshold, else the run "
          "exits with status 2 and one line. Needs both checker flags."),
        F("--ci-metric-checker-key", str, None, "Metric the CI checker reads (a metrics.jsonl key, e.g. "
          "eval/<name>/reward_mean). Needs --ci-test."),
        F("--ci-metric-checker-threshold", finite_float, None, "Threshold the CI checker compares against (value >= "
          "threshold passes)."),
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
        from miles.config.backend_flags import FSDPArgs
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

