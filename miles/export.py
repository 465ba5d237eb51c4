"""Export a training checkpoint for inference, in one process, without Ray or a GPU.

    python -m miles.export --load ckpt --out my-lora                      # a --use-lora run: the adapter
    python -m miles.export --load ckpt --ckpt-step 40 --merge --out my-pipeline
    python -m miles.export --load ckpt --ema --out my-pipeline-ema        # θ̄ instead of the live weights

A LoRA run exports a diffusers LoRA adapter (`pipe.load_lora_weights(OUT)` on the base pipeline); `--merge`, or
a full fine-tune, a complete pipeline folder (`DiffusionPipeline.from_pretrained(OUT)`). The base pipeline is
the `--hf-checkpoint` the checkpoint records (checkpoints of older versions do not: pass it). Every mistake
is one line naming the flag and the file, exit code 2. docs/training.md, "Export for inference".
"""

from __future__ import annotations

import argparse
import sys

from miles.utils.errors import USER_ERROR_EXIT_CODE, MilesUserError

DTYPE_CHOICES = ("fp32", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="CKPT_DIR",
                        help="the run's --save folder (or one iter_* folder in it)")
    parser.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                        help="the checkpoint iter_N; default: the one latest_checkpointed_iteration.txt names")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write; must not hold files yet")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA run: merge the adapter into the base weights and write a complete pipeline")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (the run had --use-ema)")
    parser.add_argument("--hf-checkpoint", default=None, metavar="BASE",
                        help="the base pipeline (folder or hub id); default: the one the checkpoint records")
    parser.add_argument("--lora-alpha", type=int, default=None, metavar="ALPHA",
                        help="only for LoRA checkpoints older than the recorded LoRA settings: the run's --lora-alpha")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="dtype of the exported pipeline's trained modules; default: the base's stored dtype")
    return parser


def export_checkpoint(argv: list[str]) -> str:
    """Parse, load, write; returns what was written ("lora" or "pipeline"). Raises MilesUserError."""
    args = build_parser().parse_args(argv)
    from miles.backends.fsdp_utils.model_export import export_weights, load_checkpoint_weights
    from miles.models.common import parse_dtype

    weights = load_checkpoint_weights(args.load, args.ckpt_step, use_ema=args.ema, lora_alpha=args.lora_alpha)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    kind = export_weights(weights, args.out, merge=args.merge, base=args.hf_checkpoint, dtype=dtype)
    what = "a LoRA adapter: load it with pipe.load_lora_weights" if kind == "lora" else \
        "a pipeline folder: load it with DiffusionPipeline.from_pretrained"
    print(f"exported {weights.source} ({'EMA' if weights.ema else 'live'} weights) to {args.out}, {what}")
    return kind


def main(argv: list[str] | None = None) -> None:
    """The command line: a user mistake is one line on stderr and exit status 2."""
    try:
        export_checkpoint(sys.argv[1:] if argv is None else argv)
    except MilesUserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
