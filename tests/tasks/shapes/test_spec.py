"""Prompts, metadata and the train / held-out split of the shapes task."""

from __future__ import annotations

import json

import pytest

from miles.tasks.shapes.data import write_prompt_files, write_sft_data
from miles.tasks.shapes.render import render
from miles.tasks.shapes.spec import TAGS, all_scenes, scene_from_metadata, split_scenes


def test_prompts_are_distinct_and_metadata_round_trips():
    scenes = all_scenes()
    assert len({s.prompt() for s in scenes}) == len(scenes)
    assert {s.tag for s in scenes} == set(TAGS)
    for scene in scenes:
        assert scene_from_metadata(json.loads(json.dumps(scene.to_metadata()))) == scene
    assert scenes[0].prompt() == "a red circle"
    position = next(s for s in scenes if s.tag == "position")
    assert " of " in position.prompt() or " above " in position.prompt() or " below " in position.prompt()


def test_split_is_disjoint_seeded_and_covers_every_tag():
    train, heldout = split_scenes(seed=0)
    assert not {s.prompt() for s in train} & {s.prompt() for s in heldout}
    assert len(train) + len(heldout) == len(all_scenes())
    assert {s.tag for s in heldout} == set(TAGS) == {s.tag for s in train}
    assert split_scenes(seed=0) == (train, heldout) and split_scenes(seed=1) != (train, heldout)


@pytest.mark.parametrize("metadata, message", [
    ({"tag": "nope", "objects": []}, "'tag'"),
    ({"tag": "single", "objects": []}, "non-empty"),
    ({"tag": "single", "objects": [{"color": "pink", "shape": "circle"}]}, "color"),
    ({"tag": "counting", "objects": [{"color": "red", "shape": "circle", "count": 5}]}, "count"),
    ({"tag": "single", "objects": [{"color": "red", "shape": "circle"}], "relation": "above"}, "relation"),
])
def test_bad_metadata_says_what_is_wrong(metadata, message):
    with pytest.raises(ValueError, match=message):
        scene_from_metadata(metadata)


def test_render_is_deterministic():
    scene = all_scenes()[100]
    assert (render(scene, 32, 3) == render(scene, 32, 3)).all()
    assert not (render(scene, 32, 3) == render(scene, 32, 4)).all()


def test_prompt_files_hold_no_heldout_scene_in_train(tmp_path):
    train_path, heldout_path = write_prompt_files(str(tmp_path))
    train = [json.loads(line) for line in open(train_path)]
    heldout = [json.loads(line) for line in open(heldout_path)]
    assert not {r["input"] for r in train} & {r["input"] for r in heldout}
    _, heldout_scenes = split_scenes(seed=0)
    assert {r["input"] for r in heldout} <= {s.prompt() for s in heldout_scenes}
    assert {r["metadata"]["tag"] for r in heldout} == set(TAGS)
    sft = write_sft_data(str(tmp_path), size=32, images_per_prompt=1)
    rows = [json.loads(line) for line in open(sft)]
    assert len(rows) == len(train) and (tmp_path / rows[0]["image"]).exists()
