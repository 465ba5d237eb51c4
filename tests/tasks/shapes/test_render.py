"""The renderer's stray-object option: off by default, and when on, the clean render plus one object the
prompt did not ask for, which the scorer penalises."""

from __future__ import annotations

import numpy as np

from miles.tasks.shapes.render import STRAY_RADIUS, place_objects, place_stray, render
from miles.tasks.shapes.score import detect_objects, score_scene
from miles.tasks.shapes.spec import all_scenes, split_scenes


def test_the_default_render_has_no_stray():
    for scene in all_scenes()[::37]:
        assert np.array_equal(render(scene, 32, 3), render(scene, 32, 3, stray=False))


def test_a_stray_is_one_small_object_of_an_unrequested_colour_beside_the_clean_scene():
    for scene in all_scenes()[::11]:
        placed = place_objects(scene, 32, 5)
        stray = place_stray(scene, placed, 32, 5)
        if stray is None:
            continue
        assert stray.color not in {group.color for group in scene.objects}
        assert STRAY_RADIUS[0] * 32 <= stray.radius <= STRAY_RADIUS[1] * 32
        clean, dirty = render(scene, 32, 5), render(scene, 32, 5, stray=True)
        assert np.array_equal(render(scene, 32, 5, stray=True), dirty)  # deterministic
        changed = np.any(clean != dirty, axis=-1)
        assert changed.any()
        ys, xs = np.nonzero(changed)  # only around the stray: the scene's own objects are where they were
        assert np.all(np.hypot(xs + 0.5 - stray.x, ys + 0.5 - stray.y) <= stray.radius * 1.5 + 1)
        found = detect_objects(dirty)
        assert len(found) == scene.num_objects + 1 and sum(o.color == stray.color for o in found) == 1


def test_the_scorer_gives_one_to_clean_renders_and_less_to_renders_with_a_stray():
    train, _ = split_scenes(seed=0)
    placed = 0
    for index, scene in enumerate(train[::3]):
        clean = score_scene(scene, render(scene, 32, index))
        assert (clean.correct, clean.dense, clean.strays) == (1.0, 1.0, 0)
        if place_stray(scene, place_objects(scene, 32, index), 32, index) is None:
            continue
        placed += 1
        score = score_scene(scene, render(scene, 32, index, stray=True))
        assert score.correct == 0.0 and score.dense == 0.5  # the dense score divided by 1 + one stray
        assert score.strays == 1 and score.correct_but_strays == 1.0
    assert placed >= 0.95 * len(train[::3])  # a stray finds room in nearly every scene
