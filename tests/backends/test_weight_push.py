"""The `--check-weight-sync` comparison (miles/backends/fsdp_utils/weight_push.py)."""

from __future__ import annotations

import torch

from miles.backends.fsdp_utils.weight_push import tensors_held_otherwise
from miles.engine.weight_sync import tensor_checksum


def test_a_tensor_the_engine_keeps_in_fp32_matches_its_fp32_digest():
    """A bf16 engine holds most weights in bf16, but diffusers' `_keep_in_fp32_modules` in fp32."""
    weight, norm = torch.randn(4, 4), torch.randn(4)
    pushed = {"transformer.blocks.0.to_q.weight": weight, "transformer.blocks.0.norm2.weight": norm}
    expected = [{name: tensor_checksum(name.partition(".")[2], t.to(dtype)) for name, t in pushed.items()}
                for dtype in (torch.bfloat16, torch.float32)]
    held = {"transformer": {"blocks.0.to_q.weight": tensor_checksum("blocks.0.to_q.weight", weight.bfloat16()),
                            "blocks.0.norm2.weight": tensor_checksum("blocks.0.norm2.weight", norm)}}
    assert tensors_held_otherwise(held, expected) == []
    held["transformer"]["blocks.0.norm2.weight"] = tensor_checksum("blocks.0.norm2.weight", norm + 1)
    assert tensors_held_otherwise(held, expected) == ["transformer.blocks.0.norm2.weight"]
    del held["transformer"]["blocks.0.to_q.weight"]
    assert "transformer.blocks.0.to_q.weight" in tensors_held_otherwise(held, expected)
