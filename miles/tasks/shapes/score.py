"""The GenEval-style scorer: find the objects in an image and check them against the prompt's scene.

Detection (`detect_objects`): a pixel that blends palette colour c with the white background by a
coverage α lies on the segment from white to c; so each pixel's membership in c is its position along that
segment, `α = clip((white − p)·(white − c) / |white − c|², 0, 1)`, and it belongs to the colour whose segment
it lies closest to (at most `MAX_RESIDUAL` RGB units off it) when that α is at least `MIN_MEMBERSHIP`. The
4-connected components of each colour with at least `MIN_AREA` of the image (in membership) are the objects.
A component's shape is read from its membership mass against its extent (Σ over columns of the column's largest membership,
the same over rows), which sub-pixel edges do not disturb: a square fills its box (fill ≥ `SQUARE_FILL`), a
circle π/4 of it, an upward triangle half of it with its centroid a sixth of its height below the box centre
(fill ≤ `TRIANGLE_FILL` or that drop ≥ `TRIANGLE_DROP`); a component more than twice as wide as high (or the
reverse) is `blob`, no shape.

Scoring (`score_scene`):
- `correct` (0/1, GenEval's rule): every requested group found with its exact count (colour and shape), no
  other object in the image, and for a position prompt the first object's centre at least `RELATION_MARGIN`
  of the side before the second's along the relation's axis.
- `dense` ([0, 1], for training): per group, half for the count of objects of its colour and half for the count
  of its colour and shape (each `1 − |found − wanted| / wanted`, floored at 0); for a position prompt, the
  signed centre offset along the axis mapped linearly from 0 (a quarter side the wrong way) to 1 (a quarter
  side the right way); the mean of those, divided by 1 + the number of objects of colours the prompt did not
  ask for. The renderer's images score 1 on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from miles.tasks.shapes.spec import BACKGROUND, PALETTE, Scene

MIN_MEMBERSHIP = 0.3
MAX_RESIDUAL = 80.0  # RGB units off the white-to-colour segment
MIN_AREA = 0.015  # of the image area (half the smallest object), the smallest component that counts as one
SQUARE_FILL, TRIANGLE_FILL, TRIANGLE_DROP = 0.9, 0.62, 0.09
MAX_ASPECT = 2.0
RELATION_MARGIN = 0.05  # of the side: how clearly "left of" must hold for `correct`
RELATION_RAMP = 0.25  # of the side: the dense relation score goes from 0 to 1 over ±this offset

_COLORS = tuple(PALETTE)
_COLOR_RGB = np.array([PALETTE[c] for c in _COLORS], dtype=np.float32)
_WHITE = np.array(BACKGROUND, dtype=np.float32)
_TOWARDS = _WHITE - _COLOR_RGB  # [C, 3]: white minus each colour


@dataclass(frozen=True)
class DetectedObject:
    color: str
    shape: str  # circle, square, triangle or blob
    x: float  # centroid, in pixels
    y: float
    area: float  # membership mass, in pixels


@dataclass(frozen=True)
class SceneScore:
    correct: float  # 0.0 or 1.0
    dense: float
    strays: int = 0  # objects in colours the prompt did not ask for
    correct_but_strays: float = 0.0  # `correct` with those objects ignored (a diagnostic, not a reward)


def label_components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean mask: labels 1..n (0 outside), by propagating the smallest pixel
    index over each component until it settles (numpy only; at most one pass per pixel of a component's
    diameter)."""
    height, width = mask.shape
    big = height * width
    labels = np.where(mask, np.arange(big).reshape(height, width), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        neighbours = np.minimum.reduce([padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1],
                                        padded[1:-1, :-2], padded[1:-1, 2:]])
        updated = np.where(mask, neighbours, big)
        if np.array_equal(updated, labels):
            break
        labels = updated
    roots = np.unique(labels[mask])
    remap = np.zeros(big + 1, dtype=np.int64)
    remap[roots] = np.arange(1, len(roots) + 1)
    return remap[labels], len(roots)


def classify_shape(membership: np.ndarray) -> str:
    """The shape of one component, from its membership map (zero outside it)."""
    rows, columns = membership.max(axis=1), membership.max(axis=0)
    height, width = float(rows.sum()), float(columns.sum())
    if max(height, width) > MAX_ASPECT * min(height, width):
        return "blob"
    mass = float(membership.sum())
    fill = mass / (height * width)
    ys = np.arange(membership.shape[0]) + 0.5
    occupied = np.nonzero(rows)[0]
    box_centre = (occupied.min() + occupied.max() + 1) / 2.0
    drop = (float((membership.sum(axis=1) * ys).sum()) / mass - box_centre) / height
    if fill <= TRIANGLE_FILL or drop >= TRIANGLE_DROP:
        return "triangle"
    if fill >= SQUARE_FILL:
        return "square"
    return "circle"


def detect_objects(image: np.ndarray) -> list[DetectedObject]:
    """The objects of an RGB uint8 [H, W, 3] image, largest first."""
    away = _WHITE - image.astype(np.float32)  # [H, W, 3]
    memberships = np.clip(away @ _TOWARDS.T / (_TOWARDS**2).sum(axis=-1), 0.0, 1.0)  # [H, W, C]
    residuals = np.linalg.norm(away[:, :, None, :] - memberships[..., None] * _TOWARDS, axis=-1)
    nearest = residuals.argmin(axis=-1)
    belongs = residuals.min(axis=-1) <= MAX_RESIDUAL
    min_area = MIN_AREA * image.shape[0] * image.shape[1]
    found: list[DetectedObject] = []
    for index, color in enumerate(_COLORS):
        mask = belongs & (nearest == index) & (memberships[:, :, index] >= MIN_MEMBERSHIP)
        labels, count = label_components(mask)
        for label in range(1, count + 1):
            membership = np.where(labels == label, memberships[:, :, index], 0.0)
            area = float(membership.sum())
            if area < min_area:
                continue
            ys, xs = np.nonzero(membership)
            weights = membership[ys, xs]
            found.append(DetectedObject(color, classify_shape(membership), float((xs * weights).sum() / area) + 0.5,
                                        float((ys * weights).sum() / area) + 0.5, area))
    return sorted(found, key=lambda obj: -obj.area)


def _count_score(found: int, wanted: int) -> float:
    return max(0.0, 1.0 - abs(found - wanted) / wanted)


def _pick(objects: list[DetectedObject], color: str, shape: str) -> DetectedObject | None:
    """The largest object of the colour and shape, else the largest of the colour."""
    exact = [o for o in objects if o.color == color and o.shape == shape]
    same_color = [o for o in objects if o.color == color]
    return (exact or same_color or [None])[0]


def relation_offset(first: DetectedObject, second: DetectedObject, relation: str) -> float:
    """How far (pixels) `first` lies in the relation's direction from `second`: positive when it holds."""
    return {"left of": second.x - first.x, "right of": first.x - second.x,
            "above": second.y - first.y, "below": first.y - second.y}[relation]


def score_scene(scene: Scene, image: np.ndarray) -> SceneScore:
    objects = detect_objects(image)
    size = float(max(image.shape[0], image.shape[1]))
    parts: list[float] = []
    correct = True
    for group in scene.objects:
        of_color = [o for o in objects if o.color == group.color]
        exact = [o for o in of_color if o.shape == group.shape]
        parts.append(0.5 * _count_score(len(of_color), group.count) + 0.5 * _count_score(len(exact), group.count))
        correct &= len(exact) == group.count
    requested = {group.color for group in scene.objects}
    strays = sum(1 for o in objects if o.color not in requested)
    counted = correct and len(objects) - strays == scene.num_objects
    correct &= len(objects) == scene.num_objects
    if scene.relation is not None:
        first = _pick(objects, scene.objects[0].color, scene.objects[0].shape)
        second = _pick(objects, scene.objects[1].color, scene.objects[1].shape)
        if first is None or second is None:
            parts.append(0.0)
            correct = counted = False
        else:
            offset = relation_offset(first, second, scene.relation) / size
            parts.append(float(np.clip(0.5 + offset / (2 * RELATION_RAMP), 0.0, 1.0)))
            correct &= offset >= RELATION_MARGIN
            counted &= offset >= RELATION_MARGIN
    return SceneScore(correct=float(correct), dense=float(np.mean(parts)) / (1 + strays), strays=strays,
                      correct_but_strays=float(counted))
