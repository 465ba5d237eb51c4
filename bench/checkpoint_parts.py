"""A pipeline folder carried between machines through size-limited files: packed into parts, unpacked again.

The GPU machine keeps nothing between calls outside what travels with the working tree (64 MiB in all) and returns
files of at most 16 MiB each. The 128 px `shapes` base of bench_learning.py (≈ 30 MB of fp32 weights) is pretrained
in one call and used by the methods in the next, so it comes back packed in parts and travels back carried:

    python bench/checkpoint_parts.py pack /tmp/shapes-large $OUT --dtype fp16       # on the GPU machine
    python bench/checkpoint_parts.py unpack .shapes-large /work/.device/N/shapes-large.tar.gz.part-*   # here

`--dtype fp16` rounds every floating weight to float16 (half the bytes); the loaders cast them back to the dtype a
run asks for, so the rounded weights are the base every method starts from. fp16 keeps 3 more mantissa bits than
bf16, which matters for these small weights: the shipped 32 px base scores the same held-out 0.320 (dense 0.641)
from fp16 weights as from its fp32 ones, 0.280 (0.623) from bf16 ones. Unpacking reads only safetensors and
JSON (tar members that are regular files inside the destination; nothing is unpickled or imported).
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import shutil
import tarfile
import tempfile

import torch
from safetensors.torch import load_file, save_file

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PART_BYTES = 15 * 1024 * 1024  # under the 16 MiB a returned file may hold


def cast_weights(folder: str, dtype: torch.dtype) -> None:
    """Every floating tensor of every `*.safetensors` under `folder` cast to `dtype`, in place."""
    for path in glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True):
        tensors = {name: value.to(dtype) if value.is_floating_point() else value
                   for name, value in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})


def pack(source: str, out_dir: str, dtype: str = "fp32", part_bytes: int = PART_BYTES) -> list[str]:
    """`source` as a gzipped tar split into `out_dir/<name>.tar.gz.part-NNN` of at most `part_bytes` each."""
    name = os.path.basename(os.path.normpath(source))
    with tempfile.TemporaryDirectory() as staging:
        copy = os.path.join(staging, name)
        shutil.copytree(source, copy)
        if dtype != "fp32":
            cast_weights(copy, DTYPES[dtype])
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            tar.add(copy, arcname=name)
    data = archive.getvalue()
    os.makedirs(out_dir, exist_ok=True)
    parts = []
    for index, start in enumerate(range(0, len(data), part_bytes)):
        parts.append(os.path.join(out_dir, f"{name}.tar.gz.part-{index:03d}"))
        with open(parts[-1], "wb") as handle:
            handle.write(data[start:start + part_bytes])
    return parts


def unpack(destination: str, parts: list[str]) -> str:
    """The parts (in name order) joined and extracted as the folder `destination`; returns it."""
    if os.path.exists(destination):
        raise SystemExit(f"unpack: {destination} exists; remove it first")
    data = b"".join(open(part, "rb").read() for part in sorted(parts))
    with tempfile.TemporaryDirectory() as staging, tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            outside = member.name.startswith("/") or ".." in member.name.split("/")
            if outside or not (member.isfile() or member.isdir()):
                raise SystemExit(f"unpack: {member.name!r} is not a plain file or folder inside the archive")
            if member.isfile() and not member.name.endswith((".json", ".safetensors", ".txt")):
                raise SystemExit(f"unpack: {member.name!r}: only JSON, safetensors and text files are expected")
        tar.extractall(staging, members=members, filter="data")
        (top,) = os.listdir(staging)
        shutil.move(os.path.join(staging, top), destination)
    return destination


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack", help="SOURCE folder -> OUT_DIR/<name>.tar.gz.part-NNN")
    packing.add_argument("source")
    packing.add_argument("out_dir")
    packing.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="cast the floating weights first")
    unpacking = verbs.add_parser("unpack", help="PARTS... -> the folder DESTINATION")
    unpacking.add_argument("destination")
    unpacking.add_argument("parts", nargs="+")
    opts = parser.parse_args()
    if opts.verb == "pack":
        parts = pack(opts.source, opts.out_dir, opts.dtype)
        print(f"packed {opts.source} ({opts.dtype}) into {len(parts)} part(s): "
              f"{sum(os.path.getsize(p) for p in parts) / 1e6:.1f} MB")
    else:
        print(f"unpacked {len(opts.parts)} part(s) into {unpack(opts.destination, opts.parts)}")


if __name__ == "__main__":
    main()
