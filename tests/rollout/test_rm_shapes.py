"""`--rm-type shapes`: the shapes task's scorer as a built-in reward, fed by the prompt row's metadata."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.config.flags import BUILTIN_REWARD_OUTPUTS
from miles.rollout.rm_hub import batched_async_rm, reward_value
from miles.tasks.shapes.render import render
from miles.tasks.shapes.spec import all_scenes
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


def _sample(scene, pixels: np.ndarray, index: int = 0) -> Sample:
    return Sample(prompt=scene.prompt(), index=index, image=torch.from_numpy(pixels), metadata=scene.to_metadata())


def test_renders_score_one_and_a_blank_zero():
    scenes = all_scenes()[::50]
    samples = [_sample(scene, render(scene, 32, 0), i) for i, scene in enumerate(scenes)]
    samples.append(_sample(scenes[0], np.full((32, 32, 3), 255, np.uint8), len(samples)))
    args = hook_args(rm_type="shapes", reward_key="shapes", eval_reward_key="shapes_correct")
    rewards = asyncio.run(batched_async_rm(args, samples))
    assert rewards[:-1] == [{"shapes": 1.0, "shapes_correct": 1.0}] * len(scenes)
    assert rewards[-1] == {"shapes": 0.0, "shapes_correct": 0.0}
    assert tuple(rewards[0]) == BUILTIN_REWARD_OUTPUTS["shapes"]  # the keys the command-line rules know
    assert reward_value(args, rewards[0]) == 1.0 and reward_value(args, rewards[-1], evaluation=True) == 0.0


def test_metadata_that_is_no_scene_names_the_sample():
    scene = all_scenes()[0]
    sample = Sample(prompt="a red circle", index=3, image=torch.from_numpy(render(scene, 32, 0)), metadata={"id": 1})
    with pytest.raises(MilesUserError, match=r"--rm-type shapes: sample 3 .*'tag'"):
        asyncio.run(batched_async_rm(hook_args(rm_type="shapes", reward_key="shapes"), [sample]))
