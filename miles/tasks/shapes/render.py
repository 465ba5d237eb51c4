"""The renderer: a scene drawn procedurally, flat colours on white, deterministic in (scene, size, seed).

Objects are placed by rejection sampling so that no two touch (the scorer counts connected components of one
colour), with radii of 12–17 % of the image side; position prompts put the first object at least
`RELATION_OFFSET` of the side before the second along the relation's axis. Edges are anti-aliased by
4×4 supersampling. Circles, axis-aligned squares and upward triangles fill 79 %, 100 % and 50 % of their
bounding boxes, the feature the scorer tells them apart by.

`render(..., stray=True)` adds one small **stray object** the prompt did not ask for: a colour none of the
scene's groups has, any shape, radius `STRAY_RADIUS` of the side, placed apart from the others (the scene's
objects stay where the clean render puts them). It is the controlled flaw of the pretraining data
(miles/tasks/shapes/pretrain.py, docs/shapes.md); the default is off, so the scorer's tests and the SFT data
are clean.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from miles.tasks.shapes.spec import BACKGROUND, PALETTE, SHAPES, Scene

MIN_RADIUS, MAX_RADIUS = 0.12, 0.17  # of the image side
RELATION_OFFSET = 0.35  # of the image side, between the two centres along the relation's axis
GAP = 0.06  # of the image side, between two objects' bounding circles
SUPERSAMPLE = 4
SQUARE_HALF_SIDE = 0.9  # of the radius: a square and a circle of one radius look the same size
STRAY_RADIUS = (0.10, 0.12)  # of the image side: a stray is smaller than a requested object, still an object
STRAY_GAP = 0.10  # of the image side, between the stray's bounding circle and any other object's


@dataclass(frozen=True)
class PlacedObject:
    color: str
    shape: str
    x: float  # centre, in pixels
    y: float
    radius: float


def _relation_ok(first: PlacedObject, second: PlacedObject, relation: str, size: int) -> bool:
    offset = RELATION_OFFSET * size
    dx, dy = second.x - first.x, second.y - first.y
    return {"left of": dx >= offset, "right of": -dx >= offset, "above": dy >= offset, "below": -dy >= offset}[relation]


def place_objects(scene: Scene, size: int, seed: int, max_tries: int = 10_000) -> list[PlacedObject]:
    """Positions and radii for every object of the scene (group order, then count)."""
    rng = random.Random(f"shapes:{seed}:{scene.prompt()}:{size}")
    wanted = [(group.color, group.shape) for group in scene.objects for _ in range(group.count)]
    for _ in range(max_tries):
        placed: list[PlacedObject] = []
        for color, shape in wanted:
            radius = rng.uniform(MIN_RADIUS, MAX_RADIUS) * size
            candidate = PlacedObject(color, shape, rng.uniform(radius + 1, size - radius - 1),
                                     rng.uniform(radius + 1, size - radius - 1), radius)
            if any(np.hypot(candidate.x - o.x, candidate.y - o.y) < candidate.radius + o.radius + GAP * size
                   for o in placed):
                break
            placed.append(candidate)
        else:
            if scene.relation is None or _relation_ok(placed[0], placed[1], scene.relation, size):
                return placed
    raise RuntimeError(f"could not place {scene.prompt()!r} in {size} px after {max_tries} tries")


def place_stray(scene: Scene, placed: list[PlacedObject], size: int, seed: int,
                max_tries: int = 10_000) -> PlacedObject | None:
    """A stray object for the scene, apart from `placed`: a colour the scene does not ask for (every scene
    leaves at least two), any shape; None when no spot is free (rare: the test of the renderer counts it)."""
    rng = random.Random(f"shapes-stray:{seed}:{scene.prompt()}:{size}")
    requested = {group.color for group in scene.objects}
    colors = [color for color in PALETTE if color not in requested]
    color, shape = rng.choice(colors), rng.choice(SHAPES)
    for _ in range(max_tries):
        radius = rng.uniform(*STRAY_RADIUS) * size
        candidate = PlacedObject(color, shape, rng.uniform(radius + 1, size - radius - 1),
                                 rng.uniform(radius + 1, size - radius - 1), radius)
        if all(np.hypot(candidate.x - o.x, candidate.y - o.y) >= candidate.radius + o.radius + STRAY_GAP * size
               for o in placed):
            return candidate
    return None


def _coverage(obj: PlacedObject, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    if obj.shape == "circle":
        return (xs - obj.x) ** 2 + (ys - obj.y) ** 2 <= obj.radius**2
    if obj.shape == "square":
        half = SQUARE_HALF_SIDE * obj.radius
        return (np.abs(xs - obj.x) <= half) & (np.abs(ys - obj.y) <= half)
    if obj.shape == "triangle":  # apex up, base down, inscribed in the radius' square
        top, bottom = obj.y - obj.radius, obj.y + obj.radius
        depth = (ys - top) / (2 * obj.radius)  # 0 at the apex, 1 at the base
        return (ys >= top) & (ys <= bottom) & (np.abs(xs - obj.x) <= depth * obj.radius)
    raise ValueError(f"unknown shape {obj.shape!r}")


def draw(objects: list[PlacedObject], size: int) -> np.ndarray:
    """RGB uint8 [size, size, 3]."""
    fine = size * SUPERSAMPLE
    coordinates = (np.arange(fine) + 0.5) / SUPERSAMPLE
    xs, ys = np.meshgrid(coordinates, coordinates)
    canvas = np.empty((fine, fine, 3), dtype=np.float32)
    canvas[:] = BACKGROUND
    for obj in objects:
        canvas[_coverage(obj, xs, ys)] = PALETTE[obj.color]
    pooled = canvas.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE, 3).mean(axis=(1, 3))
    return np.round(pooled).astype(np.uint8)


def render(scene: Scene, size: int = 32, seed: int = 0, stray: bool = False) -> np.ndarray:
    """The scene as RGB uint8 [size, size, 3]; the same (scene, size, seed, stray) gives the same pixels. With
    `stray`, the same image plus one stray object (`place_stray`) where there is room."""
    placed = place_objects(scene, size, seed)
    extra = place_stray(scene, placed, size, seed) if stray else None
    return draw(placed + ([extra] if extra is not None else []), size)
