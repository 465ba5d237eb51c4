"""What a `shapes` prompt asks for: the palette, the shapes, the four prompt kinds and the prompt splits.

A prompt describes one scene. Its metadata (the prompt row's `metadata`, which reaches the reward as
`sample.metadata`) is the structured description the scorer checks:

    {"tag": "position",
     "objects": [{"color": "red", "shape": "circle", "count": 1}, {"color": "blue", "shape": "square", "count": 1}],
     "relation": "left of"}

- `single`: one object ("a red circle");
- `counting`: two to four objects of one kind ("three blue squares");
- `two_object`: two different objects ("a red circle and a green triangle");
- `position`: two different objects and where the first lies relative to the second
  ("a red circle left of a blue square").

Every prompt of the task is enumerated by `all_prompts()` (in a fixed order); `split_prompts` deals them into a
train and a held-out set by a seeded permutation, so a held-out prompt is a scene never trained on, made of
colours, shapes and relations that are.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

# RGB of each colour as the renderer paints it; the scorer classifies pixels by the nearest of these.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 30),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single", "counting", "two_object", "position")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4


@dataclass(frozen=True)
class ObjectGroup:
    """`count` objects of one colour and shape."""

    color: str
    shape: str
    count: int = 1

    def phrase(self) -> str:
        noun = self.shape if self.count == 1 else self.shape + "s"
        return f"{COUNT_WORDS[self.count]} {self.color} {noun}"

    def to_json(self) -> dict[str, Any]:
        return {"color": self.color, "shape": self.shape, "count": self.count}


@dataclass(frozen=True)
class Scene:
    """What one prompt asks for; `relation` (position prompts) places objects[0] relative to objects[1]."""

    tag: str
    objects: tuple[ObjectGroup, ...]
    relation: str | None = None

    def prompt(self) -> str:
        if self.tag == "position":
            return f"{self.objects[0].phrase()} {self.relation} {self.objects[1].phrase()}"
        return " and ".join(group.phrase() for group in self.objects)

    def to_metadata(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"tag": self.tag, "objects": [group.to_json() for group in self.objects]}
        if self.relation is not None:
            metadata["relation"] = self.relation
        return metadata

    @property
    def num_objects(self) -> int:
        return sum(group.count for group in self.objects)


def scene_from_metadata(metadata: Any) -> Scene:
    """The scene a prompt row's metadata describes; ValueError says what is malformed."""
    if not isinstance(metadata, dict):
        raise ValueError(f"shapes metadata must be an object, got {type(metadata).__name__}")
    tag, objects, relation = metadata.get("tag"), metadata.get("objects"), metadata.get("relation")
    if tag not in TAGS:
        raise ValueError(f"shapes metadata: 'tag' must be one of {TAGS}, got {tag!r}")
    if not isinstance(objects, list) or not objects:
        raise ValueError(f"shapes metadata: 'objects' must be a non-empty list, got {objects!r}")
    groups = []
    for item in objects:
        if not isinstance(item, dict):
            raise ValueError(f"shapes metadata: each object must be a map, got {item!r}")
        color, shape, count = item.get("color"), item.get("shape"), item.get("count", 1)
        if color not in PALETTE or shape not in SHAPES:
            raise ValueError(f"shapes metadata: object {item!r} needs a color of {tuple(PALETTE)} and a shape of {SHAPES}")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
            raise ValueError(f"shapes metadata: object {item!r} needs a count from 1 to {MAX_COUNT}")
        groups.append(ObjectGroup(color, shape, count))
    if (relation is None) != (tag != "position"):
        raise ValueError(f"shapes metadata: a 'relation' of {RELATIONS} goes with tag 'position' (and only there)")
    if relation is not None and (relation not in RELATIONS or len(groups) != 2):
        raise ValueError(f"shapes metadata: relation {relation!r} needs two objects and one of {RELATIONS}")
    if sum(group.count for group in groups) > MAX_COUNT:
        raise ValueError(f"shapes metadata: at most {MAX_COUNT} objects in a scene")
    return Scene(tag, tuple(groups), relation)


def all_scenes() -> list[Scene]:
    """Every scene of the task, in a fixed order (single, counting, two_object, position)."""
    kinds = [ObjectGroup(color, shape) for color in PALETTE for shape in SHAPES]
    scenes = [Scene("single", (kind,)) for kind in kinds]
    scenes += [Scene("counting", (ObjectGroup(k.color, k.shape, n),)) for k in kinds for n in range(2, MAX_COUNT + 1)]
    # Two different colours, so that the scorer can tell which object is which.
    pairs = [(a, b) for a, b in itertools.permutations(kinds, 2) if a.color != b.color]
    scenes += [Scene("two_object", (a, b)) for a, b in pairs if (a.color, a.shape) < (b.color, b.shape)]
    scenes += [Scene("position", (a, b), relation) for a, b in pairs for relation in RELATIONS]
    return scenes


def split_scenes(heldout_fraction: float = 0.2, seed: int = 0) -> tuple[list[Scene], list[Scene]]:
    """(train, held-out): a seeded permutation of `all_scenes()` per tag, the first `heldout_fraction` of each
    tag held out (so both splits have every tag)."""
    train: list[Scene] = []
    heldout: list[Scene] = []
    rng = random.Random(seed)
    for tag in TAGS:
        scenes = [scene for scene in all_scenes() if scene.tag == tag]
        rng.shuffle(scenes)
        cut = max(1, round(heldout_fraction * len(scenes)))
        heldout += scenes[:cut]
        train += scenes[cut:]
    return train, heldout
