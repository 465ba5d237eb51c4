"""bench/checkpoint_parts.py: a pipeline folder through size-limited parts and back."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
import torch
from safetensors.torch import load_file

from miles.tasks.shapes import PRETRAINED_SD3


def test_the_shipped_base_comes_back_from_its_parts_rounded_to_fp16(tmp_path, bench_script):
    with bench_script("checkpoint_parts") as parts_module:
        pack, unpack = parts_module.pack, parts_module.unpack
    parts = pack(PRETRAINED_SD3, str(tmp_path / "out"), dtype="fp16", part_bytes=1 << 20)
    assert len(parts) > 1 and all(os.path.getsize(part) <= 1 << 20 for part in parts)
    back = unpack(str(tmp_path / "base"), list(reversed(parts)))  # joined in name order whatever the shell gave
    original = load_file(os.path.join(PRETRAINED_SD3, "transformer", "diffusion_pytorch_model.safetensors"))
    restored = load_file(os.path.join(back, "transformer", "diffusion_pytorch_model.safetensors"))
    assert original.keys() == restored.keys()
    for name, value in original.items():
        assert restored[name].dtype == torch.float16 and torch.equal(restored[name], value.to(torch.float16))
    for folder, _, files in os.walk(PRETRAINED_SD3):
        for name in files:
            if name.endswith(".json"):
                relative = os.path.relpath(os.path.join(folder, name), PRETRAINED_SD3)
                assert open(os.path.join(back, relative)).read() == open(os.path.join(folder, name)).read()


def test_an_archive_with_a_path_outside_or_an_unexpected_file_is_refused(tmp_path, bench_script):
    with bench_script("checkpoint_parts") as parts_module:
        unpack = parts_module.unpack
    for member in ("base/../escape.json", "base/pickled.bin"):
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            info = tarfile.TarInfo(member)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
        part = tmp_path / "bad.tar.gz.part-000"
        part.write_bytes(archive.getvalue())
        with pytest.raises(SystemExit, match="unpack"):
            unpack(str(tmp_path / "base"), [str(part)])
        assert not (tmp_path / "base").exists() and not (tmp_path / "escape.json").exists()
