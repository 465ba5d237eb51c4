"""Training-backend flag declarations: every `FSDPArgs` field becomes `--field-name` on `train_diffusion.py`.

`FSDPArgs` is a declaration table, not a runtime object: after parsing and validation the trainer reads these
values from `miles.config.sections.TrainerConfig`. `miles.config.flags.flag_groups` turns each field into one
`Flag`, and `miles.config.arguments` into one argparse option (a bool becomes a flag, a `True` default
gets a `--no-` form); the field's metadata carries the help text, the `--help` group (a table of
docs/cli-reference.md), choices, a value parser (`type`) and simple bounds (`ge`, `gt`, `le`, `lt`) that the
parser checks. Cross-flag rules live in `miles.config.validation`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

BACKEND = "Training backend"
OPTIMIZER = "Optimizer and schedule"
LORA = "LoRA"
EMA_GROUP = "EMA"

DTYPES = ("fp32", "bf16", "fp16")


def json_object(text: str) -> dict[str, str]:
    """`--train-env-vars '{"NAME": "value"}'`: a JSON object of environment variables (values become strings)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg} at char {err.pos}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"NAME\": \"value\"}}', got {text!r}")
    return {str(k): str(v) for k, v in value.items()}


def _opt(help: str, group: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, "group": group, **extra}


@dataclass
class FSDPArgs:
    # ---- Training backend ---------------------------------------------------------------------------
    fsdp_master_dtype: str = field(
        default="fp32",
        metadata=_opt("Load, shard and optimizer-state precision of the master weights.", BACKEND, choices=DTYPES),
    )
    fsdp_reduce_dtype: str = field(
        default="fp32",
        metadata=_opt(
            "Gradient reduce-scatter dtype. bf16 matches flow_grpo's all-bf16 policy but adds cross-rank add-noise.",
            BACKEND,
            choices=DTYPES,
        ),
    )
    diffusion_forward_dtype: str = field(
        default="bf16",
        metadata=_opt(
            "DiT forward compute dtype: engine, FSDP param_dtype and the training-side input cast. Engine and "
            "trainer must match or log_prob_mean_abs_diff grows.",
            BACKEND,
            choices=("bf16", "fp16", "fp32"),
        ),
    )
    fsdp_cpu_offload: bool = field(
        default=False,
        metadata=_opt("Offload params, grads and optimizer state to CPU; the optimizer then runs on CPU.", BACKEND),
    )
    fsdp_cpu_backend: str = field(default="gloo", metadata=_opt("CPU process group for --fsdp-cpu-offload.", BACKEND))
    dp_replicate_size: int = field(
        default=1,
        metadata=_opt(
            "Hybrid sharding replica count; dp_shard takes the ranks left over from this and SP.", BACKEND, ge=1
        ),
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata=_opt("Sequence parallel size (USP = Ulysses x Ring). dp_size = world / this.", BACKEND, ge=1),
    )
    ulysses_degree: int = field(
        default=0,
        metadata=_opt(
            "Ulysses degree; 0 = auto (Ulysses fills SP). Ring degree = SP / Ulysses; a ring degree > 1 needs "
            "torch >= 2.11 and a ring-capable attention backend.",
            BACKEND,
            ge=0,
        ),
    )
    fsdp_attention_backend: str | None = field(
        default=None, metadata=_opt("diffusers set_attention_backend value for the trainer's DiT.", BACKEND)
    )
    fsdp_flow_shift: float | None = field(
        default=None,
        metadata=_opt(
            "Training-side sigma grid shift, used when no engine supplies scheduler meta (SFT, docs/algorithms.md §7). "
            "Distinct from --diffusion-flow-shift.",
            BACKEND,
            gt=0,
        ),
    )
    gradient_checkpointing: bool = field(default=False, metadata=_opt("Activation checkpointing per block.", BACKEND))
    fsdp_torch_compile: bool = field(
        default=False,
        metadata=_opt("torch.compile each transformer block before FSDP sharding (1.6-1.9x train throughput on "
                      "an H200 at SD3.5-Medium scale; the first step pays the compilation).", BACKEND,
                      extension=True),
    )
    fsdp_blocks_per_unit: int = field(
        default=1,
        metadata=_opt("Consecutive transformer blocks sharded as one FSDP unit: one weight gather and one gradient "
                      "reduction per group and micro-batch instead of per block (less host work per step; the "
                      "group's weights and gradients are unsharded together). The blocks' gradients are bit for "
                      "bit the same; the embeddings every block reads sum their gradient in another order. "
                      "Measured slower on one H100 at 2 and 4 (docs/training.md).",
                      BACKEND, ge=1, extension=True),
    )
    deterministic_mode: bool = field(
        default=False, metadata=_opt("Deterministic algorithms and fixed reduction order (slower).", BACKEND)
    )
    train_env_vars: dict[str, str] = field(
        default_factory=dict,
        metadata=_opt(
            'Extra environment for the training processes, as a JSON object: \'{"NCCL_DEBUG": "INFO"}\'.',
            BACKEND,
            type=json_object,
            metavar="JSON",
            type_name="JSON",
        ),
    )

    # ---- Optimizer and schedule (docs/algorithms.md §9) --------------------------------------------------
    optimizer: str = field(default="adam", metadata=_opt(
        "adam: torch.optim.AdamW with --adam-beta1/--adam-beta2, --adam-eps and --weight-decay. The only value; any "
        "other is refused.", OPTIMIZER, choices=("adam",)))
    lr: float = field(default=1e-6, metadata=_opt("Peak learning rate.", OPTIMIZER, ge=0))
    adam_beta1: float = field(default=0.9, metadata=_opt("AdamW beta1.", OPTIMIZER, ge=0, lt=1))
    adam_beta2: float = field(
        default=0.999, metadata=_opt("AdamW beta2 (flow_grpo's 0.999, not the LLM-side 0.95).", OPTIMIZER, ge=0, lt=1)
    )
    adam_eps: float = field(default=1e-8, metadata=_opt("AdamW epsilon.", OPTIMIZER, gt=0))
    weight_decay: float = field(default=0.0, metadata=_opt("AdamW weight decay.", OPTIMIZER, ge=0))
    clip_grad: float = field(default=1.0, metadata=_opt("Global gradient-norm clip; 0 disables.", OPTIMIZER, ge=0))
    lr_decay_style: str = field(
        default="constant",
        metadata=_opt(
            "LR schedule after warmup.",
            OPTIMIZER,
            choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        ),
    )
    min_lr: float = field(default=0.0, metadata=_opt("Floor of the decayed LR (<= --lr).", OPTIMIZER, ge=0))
    lr_warmup_init: float = field(default=0.0, metadata=_opt("LR at step 0 of the warmup (<= --lr).", OPTIMIZER, ge=0))
    lr_warmup_iters: int = field(default=0, metadata=_opt("Warmup length in optimizer steps.", OPTIMIZER, ge=0))
    lr_warmup_fraction: float | None = field(
        default=None,
        metadata=_opt("Warmup as a fraction of the decay steps; overrides --lr-warmup-iters.", OPTIMIZER, ge=0, lt=1),
    )
    lr_decay_iters: int | None = field(
        default=None, metadata=_opt("Decay length in optimizer steps; default: the whole run.", OPTIMIZER, gt=0)
    )
    lr_wsd_decay_iters: int | None = field(
        default=None,
        metadata=_opt("Warmup-stable-decay: length of the final decay (required by WSD).", OPTIMIZER, gt=0),
    )
    lr_wsd_decay_style: str | None = field(
        default=None,
        metadata=_opt(
            "Warmup-stable-decay: shape of the final decay.",
            OPTIMIZER,
            choices=("linear", "cosine", "exponential", "minus_sqrt"),
        ),
    )
    use_checkpoint_lr_scheduler: bool = field(
        default=True,
        metadata=_opt(
            "On resume, restore the LR schedule (step count and settings) from the checkpoint. "
            "--override-lr-scheduler wins over this default: when it is given, the command-line schedule is used.",
            OPTIMIZER,
        ),
    )
    override_lr_scheduler: bool = field(
        default=False,
        metadata=_opt(
            "On resume, take the LR schedule from the command line instead of the checkpoint "
            "(turns --use-checkpoint-lr-scheduler off).",
            OPTIMIZER,
        ),
    )

    # ---- LoRA ---------------------------------------------------------------------------------------
    use_lora: bool = field(default=False, metadata=_opt("Train LoRA adapters instead of the full DiT.", LORA))
    lora_rank: int = field(default=64, metadata=_opt("LoRA rank.", LORA, gt=0))
    lora_alpha: int = field(default=64, metadata=_opt("LoRA alpha.", LORA, gt=0))
    lora_target_modules: list[str] | None = field(
        default=None, metadata=_opt("Module names to adapt; defaults per model family.", LORA, nargs="+")
    )
    lora_init_weights: str = field(
        default="gaussian",
        metadata=_opt("LoRA init: kaiming-uniform maps to PEFT's default; other PEFT schemes pass through.", LORA),
    )
    lora_ipc_weight_sync: bool = field(
        default=False,
        metadata=_opt("Push only lora_A/lora_B; the engine merges locally. Requires --use-lora.", LORA),
    )

    # ---- EMA (docs/algorithms.md §8) ---------------------------------------------------------------------
    use_ema: bool = field(
        default=False,
        metadata=_opt(
            "Maintain an EMA copy as pi_old. Needs a consumer: --ref-mode ema, --ema-rollout-policy ema, "
            "or --loss-type nft (which selects --ref-mode ema).",
            EMA_GROUP,
        ),
    )
    ema_rollout_policy: str = field(
        default="live",
        metadata=_opt("Which weights get pushed to rollout: live or ema.", EMA_GROUP, choices=("live", "ema")),
    )
    ema_decay_init: float = field(
        default=0.001, metadata=_opt("Decay during the flat period.", EMA_GROUP, ge=0, le=1)
    )
    ema_decay_ramp: float = field(
        default=0.001,
        metadata=_opt("Per-step increase after the flat period; the ramp restarts from zero.", EMA_GROUP, ge=0, le=1),
    )
    ema_decay_max: float = field(default=0.5, metadata=_opt("Decay ceiling.", EMA_GROUP, ge=0, le=1))
    ema_decay_flat_steps: int = field(default=0, metadata=_opt("EMA updates at --ema-decay-init.", EMA_GROUP, ge=0))
