"""Build a tiny random-weight pipeline of one family, offline, in the diffusers folder format.

    python -m miles.testing.make_tiny --family sd3 --out /tmp/tiny-sd3

Each family's builder lives in `miles/testing/tiny/<family>.py` and exposes `build(out_dir, seed)`; it
creates locally built tokenizers (no hub), random weights from a fixed seed, and saves with
`save_pretrained`, so the result loads through the same `from_pretrained` path as a real checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import os

TINY_FAMILIES = ("sd3", "flux", "qwen_image", "wan2_2", "ltx", "cosmos3")


def build_tiny_pipeline(family: str, out_dir: str, seed: int = 0) -> str:
    """Build (or reuse, when `out_dir` already holds one) the tiny pipeline of `family`; returns `out_dir`."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny builder for family {family!r}; known: {TINY_FAMILIES}")
    if os.path.exists(os.path.join(out_dir, "model_index.json")):
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    builder = importlib.import_module(f"miles.testing.tiny.{family}")
    builder.build(out_dir, seed=seed)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=TINY_FAMILIES)
    parser.add_argument("--out", required=True, help="output folder (diffusers format)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_pipeline(args.family, args.out, args.seed))


if __name__ == "__main__":
    main()
