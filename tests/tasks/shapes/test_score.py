"""The scorer on the renderer's own images (correct: 1) and on corrupted ones (lower)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.tasks.shapes.render import PlacedObject, draw, render
from miles.tasks.shapes.score import detect_objects, label_components, score_scene
from miles.tasks.shapes.spec import BACKGROUND, PALETTE, ObjectGroup, Scene, all_scenes


def some_scenes() -> list[Scene]:
    scenes = all_scenes()
    return scenes[:60] + scenes[60::23]  # every single and counting scene, a spread of the others


@pytest.mark.parametrize("size", [32, 64])
def test_every_render_scores_one(size):
    for scene in some_scenes():
        for seed in range(2):
            score = score_scene(scene, render(scene, size, seed))
            assert (score.correct, score.dense) == (1.0, 1.0), (scene.prompt(), seed, detect_objects(render(scene, size, seed)))


def test_shapes_are_told_apart_at_the_smallest_radius():
    for shape in ("circle", "square", "triangle"):
        for offset in np.linspace(0, 1, 5):
            image = draw([PlacedObject("blue", shape, 10.3 + offset, 12.7 + offset, 0.12 * 32)], 32)
            assert [o.shape for o in detect_objects(image)] == [shape], (shape, offset)


def test_a_blank_image_scores_zero():
    scene = Scene("single", (ObjectGroup("red", "circle"),))
    blank = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    assert score_scene(scene, blank).correct == 0.0 and score_scene(scene, blank).dense == 0.0


def test_a_missing_object_costs_correct_and_part_of_dense():
    scene = Scene("counting", (ObjectGroup("green", "square", 3),))
    objects = [PlacedObject("green", "square", x, 16.0, 4.5) for x in (6.0, 16.0, 26.0)]
    assert score_scene(scene, draw(objects, 32)).correct == 1.0
    two = score_scene(scene, draw(objects[:2], 32))
    assert two.correct == 0.0 and two.dense == pytest.approx(2 / 3)


def test_wrong_colour_wrong_shape_and_extras_are_penalised():
    scene = Scene("single", (ObjectGroup("red", "circle"),))
    right = [PlacedObject("red", "circle", 16.0, 16.0, 5.0)]
    assert score_scene(scene, draw(right, 32)).dense == 1.0
    wrong_shape = score_scene(scene, draw([PlacedObject("red", "square", 16.0, 16.0, 5.0)], 32))
    wrong_colour = score_scene(scene, draw([PlacedObject("blue", "circle", 16.0, 16.0, 5.0)], 32))
    extra = score_scene(scene, draw(right + [PlacedObject("yellow", "triangle", 5.0, 5.0, 4.0)], 32))
    assert wrong_shape.correct == wrong_colour.correct == extra.correct == 0.0
    assert wrong_shape.dense == 0.5 and wrong_colour.dense == 0.0 and extra.dense == 0.5


def test_a_swapped_relation_fails():
    scene = Scene("position", (ObjectGroup("red", "circle"), ObjectGroup("blue", "square")), "left of")
    left = [PlacedObject("red", "circle", 7.0, 16.0, 4.5), PlacedObject("blue", "square", 25.0, 16.0, 4.5)]
    swapped = [PlacedObject("red", "circle", 25.0, 16.0, 4.5), PlacedObject("blue", "square", 7.0, 16.0, 4.5)]
    assert score_scene(scene, draw(left, 32)).correct == 1.0
    wrong = score_scene(scene, draw(swapped, 32))
    assert wrong.correct == 0.0 and wrong.dense == pytest.approx(2 / 3)  # the two objects right, the relation 0


def test_noise_and_blur_lower_the_score():
    rng = np.random.default_rng(0)
    scenes = some_scenes()[::4]
    clean = np.mean([score_scene(s, render(s, 32, 1)).dense for s in scenes])
    noisy = np.mean([score_scene(s, np.clip(render(s, 32, 1) + rng.normal(0, 90, (32, 32, 3)), 0, 255)
                                 .astype(np.uint8)).dense for s in scenes])
    assert clean == 1.0 and noisy < 0.8


def test_components_are_four_connected():
    mask = np.zeros((5, 5), dtype=bool)
    mask[0, 0] = mask[1, 1] = True  # diagonal: two components
    mask[3, 1:4] = True
    labels, count = label_components(mask)
    assert count == 3 and labels[0, 0] != labels[1, 1] and len(set(labels[3, 1:4])) == 1


def test_palette_colours_are_far_apart():
    colours = np.array(list(PALETTE.values()) + [BACKGROUND], dtype=float)
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    assert distances[~np.eye(len(colours), dtype=bool)].min() > 100
