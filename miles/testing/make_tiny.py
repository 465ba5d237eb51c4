"""Build a random-weight pipeline of one family, offline, in the diffusers folder format.

    python -m miles.testing.make_tiny --family sd3 --out /tmp/tiny-sd3
    python -m miles.testing.make_tiny --family wan2_2 --variant wan2_1 --out /tmp/tiny-wan21
    python -m miles.testing.make_tiny --family ltx --variant ltx2 --out /tmp/tiny-ltx2
    python -m miles.testing.make_tiny --family sd3 --real-size --out /tmp/sd35m --device cuda
    python -m miles.testing.make_tiny --family wan2_2 --real-size --num-layers 2 --out /tmp/wan5b-2l

Each family's builder lives in `miles/testing/tiny/<family>.py` and exposes `build(out_dir, seed)`; a family
with several published layouts lists them in `VARIANTS` and takes `build(out_dir, seed, variant=...)`
(`--variant`; flux: flux (default), kontext; wan2_2: a14b (default), ti2v_5b, wan2_1; ltx: ltx-video (default),
ltx2, ltx2_i2v; qwen_image: qwen_image (default), edit; sd3: sd3 (default), wide). It creates locally built
tokenizers (no hub), random weights from a fixed seed, and saves with `save_pretrained`, so the result loads through the same `from_pretrained` path as a real checkpoint.

`--real-size` (sd3: SD3.5-Medium; wan2_2: Wan2.2-TI2V-5B) calls the family's `build_real_size` instead: the
published transformer and VAE configs (`miles/testing/real_size.py`) and text encoders of the real output
widths with 1–2 narrow layers, so conditioning has the real shapes. `--num-layers N` keeps every width but gives
the transformer N blocks and the VAE at most N layers per block (CPU smoke tests). The models are initialised
on `--device` (use cuda for the full 2–5 B parameters) and saved in `--dtype`; the parameter count of each
component is printed, then the folder.
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch

TINY_FAMILIES = ("sd3", "flux", "flux2", "qwen_image", "wan2_2", "ltx", "cosmos3", "hunyuan_video")
# The families with a `build_real_size`, and the checkpoint each one reproduces.
REAL_SIZE_MODELS = {"sd3": "SD3.5-Medium", "wan2_2": "Wan2.2-TI2V-5B"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_tiny_pipeline(family: str, out_dir: str, seed: int = 0, variant: str | None = None) -> str:
    """Build (or reuse, when `out_dir` already holds one) the tiny pipeline of `family` (and `variant`, for a
    family whose builder has `VARIANTS`); returns `out_dir`."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny builder for family {family!r}; known: {TINY_FAMILIES}")
    builder = importlib.import_module(f"miles.testing.tiny.{family}")
    variants = getattr(builder, "VARIANTS", ())
    if variant is not None and variant not in variants:
        raise ValueError(unknown_variant_message(family, variant, variants))
    if os.path.exists(os.path.join(out_dir, "model_index.json")):
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if variant is None:
        builder.build(out_dir, seed=seed)
    else:
        builder.build(out_dir, seed=seed, variant=variant)
    return out_dir


def unknown_variant_message(family: str, variant: str, variants: tuple[str, ...]) -> str:
    known = f"one of {', '.join(variants)}" if variants else "it has none"
    return f"no tiny {family} variant {variant!r}; {known}"


def build_real_size_pipeline(
    family: str,
    out_dir: str,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, int]:
    """Build the real-size pipeline of `family` into `out_dir`; returns each component's parameter count.

    Unlike the tiny builder this never reuses a folder: one built with another `num_layers` or dtype would be
    silently wrong, and rebuilding over it could leave stale weight shards behind.
    """
    if family not in REAL_SIZE_MODELS:
        raise ValueError(f"no real-size builder for family {family!r}; known: {tuple(REAL_SIZE_MODELS)}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    if os.path.exists(os.path.join(out_dir, "model_index.json")):
        raise FileExistsError(f"{out_dir!r} already holds a pipeline; remove it or choose another --out")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    builder = importlib.import_module(f"miles.testing.tiny.{family}")
    return builder.build_real_size(out_dir, seed=seed, num_layers=num_layers, dtype=dtype, device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=TINY_FAMILIES)
    parser.add_argument("--out", required=True, help="output folder (diffusers format)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", default=None,
                        help="a published layout of the family (flux: flux (default), kontext; wan2_2: a14b "
                             "(default), ti2v_5b, wan2_1; ltx: ltx-video (default), ltx2, ltx2_i2v; qwen_image: "
                             "qwen_image (default), edit)")
    real = parser.add_argument_group("real size (--real-size only)")
    real.add_argument(
        "--real-size", action="store_true",
        help="published denoiser and VAE configs: " + ", ".join(f"{k} = {v}" for k, v in REAL_SIZE_MODELS.items()),
    )
    real.add_argument("--num-layers", type=int, default=None,
                      help="transformer blocks (widths kept); the VAE gets at most this many layers per block")
    real.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="dtype of the saved weights (default bf16)")
    real.add_argument("--device", default=None, help="where the weights are initialised (default cpu)")
    args = parser.parse_args()
    if not args.real_size:
        given = [flag for flag, value in (("--num-layers", args.num_layers), ("--dtype", args.dtype),
                                          ("--device", args.device)) if value is not None]
        if given:
            parser.error(f"{', '.join(given)} only apply with --real-size")
        if args.variant is not None:
            variants = getattr(importlib.import_module(f"miles.testing.tiny.{args.family}"), "VARIANTS", ())
            if args.variant not in variants:
                parser.error(unknown_variant_message(args.family, args.variant, variants))
        print(build_tiny_pipeline(args.family, args.out, args.seed, args.variant))
        return
    if args.variant is not None:
        parser.error(f"--variant does not apply with --real-size (it builds {REAL_SIZE_MODELS.get(args.family)})")
    if args.family not in REAL_SIZE_MODELS:
        parser.error(f"--real-size supports --family {', '.join(REAL_SIZE_MODELS)}, not {args.family}")
    counts = build_real_size_pipeline(
        args.family, args.out, args.seed, args.num_layers, DTYPES[args.dtype or "bf16"], args.device or "cpu"
    )
    for component, count in counts.items():
        print(f"{component:<16} {count:>15,} parameters")
    print(f"{'total':<16} {sum(counts.values()):>15,} parameters")
    print(args.out)


if __name__ == "__main__":
    main()
