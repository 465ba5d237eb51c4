"""OCR reward on text rendered with PIL (docs/algorithms.md §10, invariant 20). The OCR model loads once."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.rm_hub.ocr import normalize_text, ocr_reward_from_text, ocr_target
from miles.testing.config import hook_args
from miles.types import Sample

DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def _render(text: str, frames: int = 1) -> torch.Tensor:
    font = ImageFont.truetype(DEJAVU, 40) if os.path.exists(DEJAVU) else ImageFont.load_default(size=40)
    image = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(image).text((16, 24), text, fill="black", font=font)
    pixels = torch.from_numpy(np.asarray(image).copy())
    return pixels[None].repeat(frames, 1, 1, 1)


def test_rules_without_the_engine():
    assert ocr_target('a sign that says "Hello World" in red') == "Hello World"
    assert ocr_target("no quotes here") is None
    assert ocr_target('only "one quote') is None
    assert normalize_text(" He llo\tW ") == "hellow"
    assert ocr_reward_from_text('"hello"', "helo") == pytest.approx(0.8)
    assert ocr_reward_from_text('"Hello"', "xxhello world") == 1.0  # substring
    assert ocr_reward_from_text('"Hello World"', "helloworld") == 1.0  # space- and case-insensitive
    assert ocr_reward_from_text('"ab"', "zzzzzzzz") == 0.0  # capped at len(target)
    assert ocr_reward_from_text('"abc"', "") == 0.0  # nothing detected
    assert ocr_reward_from_text('"abc"', None) == 0.0  # engine raised
    assert ocr_reward_from_text('"  "', "anything") == 0.0  # empty normalised target


def test_ocr_reward_on_rendered_text(caplog):
    args = hook_args(rm_type="ocr", custom_rm_path=None, group_rm=False, ocr_num_workers=1)
    samples = [
        Sample(prompt='a poster that says "miles"', index=0, image=_render("miles")),
        Sample(prompt='a poster that says "planet"', index=1, image=_render("plane")),  # one letter missing
        Sample(prompt="a poster with no quoted text", index=2, image=_render("miles")),
        Sample(prompt='a video titled "miles"', index=3, image=_render("miles", frames=3)),
        Sample(prompt='a blank page saying "hello"', index=4, image=torch.full((1, 64, 64, 3), 255, dtype=torch.uint8)),
    ]
    with caplog.at_level("WARNING", logger="miles.rollout.rm_hub.ocr"):
        rewards = asyncio.run(batched_async_rm(args, samples))
    assert rewards[0] == 1.0
    assert rewards[1] == pytest.approx(1 - 1 / 6)  # Levenshtein("plane", "planet") = 1
    assert rewards[2] == 0.0
    assert "no quoted target" in caplog.text
    assert rewards[3] == 1.0
    assert rewards[4] == 0.0

