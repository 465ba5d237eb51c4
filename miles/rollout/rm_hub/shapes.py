"""`shapes`: the GenEval-style scorer of the synthetic `shapes` task (miles/tasks/shapes, docs/shapes.md).

Each sample's metadata is the scene its prompt row describes (`{"tag", "objects", "relation"?}`, written by
`python -m miles.tasks.shapes.data`). The reward is a dict of two components:

- `shapes`: the dense partial score in [0, 1] (counts, colours, shapes, the relation), what training uses
  (`--reward-key shapes`);
- `shapes_correct`: GenEval's 0/1 (every object with its exact count, nothing else, the relation holding), the
  held-out score (`--eval-reward-key shapes_correct`).

A video is scored on its first frame. The scorer runs in the rollout process (numpy, about a millisecond per
32 px image).
"""

from __future__ import annotations

from typing import Sequence

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.builtin import frames_uint8
from miles.tasks.shapes.score import score_scene
from miles.tasks.shapes.spec import Scene, scene_from_metadata
from miles.types import Sample
from miles.utils.errors import MilesUserError


def scene_of(metadata) -> Scene:
    """The scene a prompt row's metadata describes; a ValueError says what is malformed and how to write such rows
    (the preflight checks the first rows of each prompt file with this)."""
    try:
        return scene_from_metadata(metadata)
    except ValueError as err:
        raise ValueError(f"{err}; write the prompts with `python -m miles.tasks.shapes.data`") from None


async def shapes_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[dict[str, float]]:
    """`reward_config` unused: the scene comes with each sample."""
    rewards = []
    for sample in samples:
        try:
            scene = scene_of(sample.metadata)
        except ValueError as err:
            raise MilesUserError(f"--rm-type shapes: sample {sample.index} (prompt {sample.prompt[:60]!r}): "
                                 f"{err}") from None
        score = score_scene(scene, frames_uint8(sample)[0])
        rewards.append({"shapes": score.dense, "shapes_correct": score.correct})
    return rewards
