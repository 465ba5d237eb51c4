"""Prompt files (JSONL, text, GenEval metadata) and their errors, epochs, seeded shuffling, the buffer, resume of
the position, custom sources."""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest
import torch

from miles.config.sections import HookArgs, run_config_of
from miles.testing.config import hook_args
from miles.rollout.data_source import (
    RolloutDataSourceWithBuffer,
    build_data_source,
    compute_num_rollout,
    load_prompt_data,
    num_rollout_of,
    prompt_file_format,
)
from miles.utils.errors import MilesUserError


def _write_prompts(tmp_path, count: int = 5, name: str = "prompts.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"input": f"prompt {i}", "metadata": {"id": i}}) + "\n" for i in range(count)))
    return str(path)


def _args(prompt_data, **overrides) -> HookArgs:
    values = dict(prompt_data=prompt_data, input_key="input", metadata_key="metadata", n_samples_per_prompt=2,
                  rollout_seed=42, buffer_filter_path=None, data_source_path=None,
                  disable_rollout_global_dataset=False, num_rollout=None, num_epoch=None, rollout_batch_size=2)
    values.update(overrides)
    return hook_args(**values)


def _ids(groups) -> list[int]:
    return [group[0].metadata["id"] for group in groups]


def test_reads_prompts_metadata_and_line_numbers(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a cat", "meta": {"rm_type": "ocr"}}\n\n{"text": "a dog"}\n')
    rows = load_prompt_data(str(path), "text", "meta")
    assert [(r.prompt, r.metadata, r.line) for r in rows] == [("a cat", {"rm_type": "ocr"}, 1), ("a dog", {}, 3)]


@pytest.mark.parametrize(
    "second_line, message",
    [
        ('{"input": "a dog"', "not valid JSON"),
        ('["a dog"]', "expected a JSON object, got list"),
        ('{"prompt": "a dog"}', "no key 'input' \\(--input-key\\)"),
        ('{"input": "   "}', "empty prompt"),
        ('{"input": 3}', "'input' must be a string, got int"),
        ('{"input": "a dog", "metadata": [1]}', "'metadata' \\(--metadata-key\\) must be a JSON object"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, second_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a cat"}\n' + second_line + "\n")
    with pytest.raises(MilesUserError, match=f"bad.jsonl:2: {message}"):
        load_prompt_data(str(path), "input", "metadata")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(MilesUserError, match="does not exist"):
        load_prompt_data(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(MilesUserError, match="holds no prompts"):
        load_prompt_data(str(tmp_path / "empty.jsonl"))
    with pytest.raises(MilesUserError, match="--prompt-data is required"):
        RolloutDataSourceWithBuffer(_args(None))


def test_groups_epochs_and_seeded_shuffle(tmp_path):
    source = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5)))
    batches = [source.get_samples(2) for _ in range(5)]  # 10 prompts = 2 epochs
    for batch in batches:
        assert [len(group) for group in batch] == [2, 2]
        assert [s.index for group in batch for s in group] == [0, 1, 2, 3]
        assert batch[0][0].metadata is not batch[0][1].metadata  # each sample owns its metadata
    group_indices = [group[0].group_index for batch in batches for group in batch]
    assert group_indices == list(range(10))
    order = [i for batch in batches for i in _ids(batch)]
    first_epoch, second_epoch = order[:5], order[5:]
    assert sorted(first_epoch) == sorted(second_epoch) == [0, 1, 2, 3, 4]
    assert first_epoch != [0, 1, 2, 3, 4] or second_epoch != [0, 1, 2, 3, 4]  # shuffled
    assert first_epoch != second_epoch  # a new permutation per epoch
    assert source.epoch == 1
    again = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5)))
    assert [i for _ in range(5) for i in _ids(again.get_samples(2))] == order  # same seed, same order
    other = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5), rollout_seed=7))
    assert [i for _ in range(5) for i in _ids(other.get_samples(2))] != order
    unshuffled = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5), no_rollout_shuffle=True))
    assert _ids(unshuffled.get_samples(3)) == [0, 1, 2]


def test_resume_continues_the_same_sequence(tmp_path):
    path = _write_prompts(tmp_path, 5)
    reference = RolloutDataSourceWithBuffer(_args(path))
    expected = [_ids(reference.get_samples(2)) for _ in range(6)]
    first = RolloutDataSourceWithBuffer(_args(path))
    seen = [_ids(first.get_samples(2)) for _ in range(3)]  # stops mid-epoch 1
    state = first.state_dict()
    assert state["epoch"] == 1 and state["offset"] == 1 and state["group_counter"] == 6
    resumed = RolloutDataSourceWithBuffer(_args(path))
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    rest = [resumed.get_samples(2) for _ in range(3)]
    assert seen + [_ids(batch) for batch in rest] == expected
    assert rest[0][0][0].group_index == 6


def test_buffer_is_served_first(tmp_path):
    source = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5)))
    partial = source.get_samples(2)
    source.add_samples([partial[1]])
    batch = source.get_samples(2)
    assert batch[0] is partial[1]  # the buffered group comes back first, re-indexed
    assert [s.index for s in batch[0]] == [0, 1]
    assert batch[1][0].group_index == 2
    assert source.buffer == []
    with pytest.raises(MilesUserError, match="list of groups"):
        source.add_samples([[]])


BUFFER_FILTERS = """
    SEEN = []

    def newest(args, rollout_id, buffer, num_groups):
        SEEN.append((rollout_id, len(buffer), num_groups))
        return buffer[-1:]

    def too_many(args, rollout_id, buffer, num_groups):
        return buffer * 5

    def three_args(args, buffer, num_groups):
        return buffer
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"user_data_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_buffer_filter_hook(tmp_path, user_module):
    module = user_module(BUFFER_FILTERS)
    source = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5), buffer_filter_path=f"{module}.newest"))
    groups = source.get_samples(2)
    source.add_samples(groups)
    batch = source.get_samples(2, rollout_id=7)
    assert batch[0] is groups[1] and source.buffer == [groups[0]]
    assert __import__(module).SEEN == [(7, 2, 2)]
    bad = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5), buffer_filter_path=f"{module}.too_many"))
    bad.add_samples(bad.get_samples(1))
    with pytest.raises(MilesUserError, match="at most 2 groups"):
        bad.get_samples(2)
    with pytest.raises(MilesUserError, match="--buffer-filter-path .* must accept 4 positional"):
        RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5), buffer_filter_path=f"{module}.three_args"))


def test_disable_global_dataset_serves_only_the_buffer(tmp_path):
    source = RolloutDataSourceWithBuffer(_args(None, disable_rollout_global_dataset=True))
    assert source.get_samples(2) == []
    feeder = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 5)))
    source.add_samples(feeder.get_samples(1))
    assert len(source.get_samples(2)) == 1


CUSTOM_SOURCE = """
    from miles.types import Sample

    class Counting:
        def __init__(self, args):
            self.args, self.position = args, 0
        def get_samples(self, num_groups):
            groups = [[Sample(prompt=f"generated {self.position + g}", group_index=self.position + g)]
                      for g in range(num_groups)]
            self.position += num_groups
            return groups
        def add_samples(self, groups):
            pass
        def state_dict(self):
            return {"position": self.position}
        def load_state_dict(self, state):
            self.position = state["position"]

    class Incomplete:
        def __init__(self, args):
            pass
        def get_samples(self, num_groups):
            return []
"""


def test_custom_data_source_class(user_module):
    module = user_module(CUSTOM_SOURCE)
    source = build_data_source(_args(None, data_source_path=f"{module}.Counting", disable_rollout_global_dataset=True))
    assert [g[0].prompt for g in source.get_samples(2)] == ["generated 0", "generated 1"]
    with pytest.raises(MilesUserError, match=r"--data-source-path .*missing method\(s\) \['add_samples', 'state_dict', 'load_state_dict'\]"):
        build_data_source(_args(None, data_source_path=f"{module}.Incomplete"))
    with pytest.raises(MilesUserError, match="--data-source-path"):
        build_data_source(_args(None, data_source_path=f"{module}.Nope"))


def test_num_rollout_derivation(tmp_path):
    assert compute_num_rollout(None, 3, 10, 4) == 8  # ceil(30 / 4)
    assert compute_num_rollout(5, 3, 10, 4) == 5  # --num-rollout wins
    assert compute_num_rollout(None, None, 10, 4) == 3  # one epoch
    path = _write_prompts(tmp_path, 5)
    assert num_rollout_of(run_config_of(_args(path, num_epoch=2, rollout_batch_size=4)).data) == 3
    with pytest.raises(MilesUserError, match="set --num-rollout"):
        num_rollout_of(run_config_of(_args(None, disable_rollout_global_dataset=True)).data)


# ---- other prompt formats: flow_grpo's text files and GenEval metadata --------------------------------------
GENEVAL_ROWS = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}],
     "prompt": "a photo of two cats"},
]


def test_text_files_hold_one_prompt_per_line(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a red fox in the snow\n\n   \n  a sign that says \"miles\"  \r\nlast line without newline")
    assert prompt_file_format(str(path)) == "txt"
    rows = load_prompt_data(str(path))
    assert [(r.prompt, r.metadata, r.line) for r in rows] == [
        ("a red fox in the snow", {}, 1), ('a sign that says "miles"', {}, 4), ("last line without newline", {}, 5)]
    source = RolloutDataSourceWithBuffer(_args(str(path), no_rollout_shuffle=True))
    assert [group[0].prompt for group in source.get_samples(2)] == ["a red fox in the snow", 'a sign that says "miles"']
    (tmp_path / "latin1.txt").write_bytes("a cat\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(MilesUserError, match=r"latin1.txt:2: not UTF-8 text \(byte 4 of the line\)"):
        load_prompt_data(str(tmp_path / "latin1.txt"))


def test_geneval_metadata_rows_put_everything_but_the_prompt_in_the_metadata(tmp_path):
    path = tmp_path / "train_metadata.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GENEVAL_ROWS))
    assert prompt_file_format(str(path)) == "geneval"
    rows = load_prompt_data(str(path))
    assert [r.prompt for r in rows] == ["a photo of a bench", "a photo of two cats"]
    assert rows[1].metadata == {"tag": "counting", "include": [{"class": "cat", "count": 2}],
                                "exclude": [{"class": "cat", "count": 3}]}
    source = RolloutDataSourceWithBuffer(_args(str(path), no_rollout_shuffle=True))
    group = source.get_samples(1)[0]
    assert [s.metadata["tag"] for s in group] == ["single_object"] * 2
    group[0].metadata["include"].append("changed")  # each sample owns its metadata
    assert group[1].metadata["include"] == [{"class": "bench", "count": 1}]

    from miles.rollout.rm_hub.geneval import check_geneval_metadata

    check_geneval_metadata(group[1])  # what --rm-type geneval sends to its scorer


def test_geneval_rows_are_recognised_by_content_and_checked_by_line(tmp_path):
    renamed = tmp_path / "geneval.jsonl"
    renamed.write_text("".join(json.dumps(row) + "\n" for row in GENEVAL_ROWS))
    assert prompt_file_format(str(renamed)) == "geneval"
    assert prompt_file_format(str(renamed), input_key="prompt") == "geneval"  # tag/include are kept either way
    assert load_prompt_data(str(renamed), input_key="prompt")[0].metadata["tag"] == "single_object"
    ordinary = tmp_path / "prompts.jsonl"
    ordinary.write_text('{"input": "a cat", "tag": "t", "include": [], "prompt": "unused"}\n')
    assert prompt_file_format(str(ordinary)) == "jsonl"  # it has --input-key: the JSONL format wins

    named = tmp_path / "test_metadata.jsonl"
    named.write_text(json.dumps(GENEVAL_ROWS[0]) + "\n\n" + '{"tag": "colors", "include": []}\n')
    with pytest.raises(MilesUserError) as info:
        load_prompt_data(str(named))
    assert str(info.value) == (f"--prompt-data {named}:3: no key 'prompt' (read as GenEval metadata, by the file "
                               "name *_metadata.jsonl); keys are ['include', 'tag']")
    named.write_text(json.dumps(GENEVAL_ROWS[0]) + "\n" + json.dumps({**GENEVAL_ROWS[1], "prompt": " "}) + "\n")
    with pytest.raises(MilesUserError, match="test_metadata.jsonl:2: empty prompt under 'prompt'"):
        load_prompt_data(str(named))
    named.write_text("[1, 2]\n")
    with pytest.raises(MilesUserError, match="test_metadata.jsonl:1: expected a JSON object, got list"):
        load_prompt_data(str(named))


def _png(path, size=(12, 8)) -> None:
    from PIL import Image

    Image.new("RGB", size, (200, 30, 40)).save(path)


def test_rows_carry_an_input_image_relative_to_the_prompt_file(tmp_path):
    (tmp_path / "images").mkdir()
    _png(tmp_path / "images" / "cat.png")
    absolute = tmp_path / "dog.png"
    _png(absolute)
    path = tmp_path / "edits.jsonl"
    path.write_text('{"input": "make it red", "image": "images/cat.png"}\n'
                    f'{{"input": "add a hat", "image": "{absolute}"}}\n')
    rows = load_prompt_data(str(path))
    assert [row.image for row in rows] == [str(tmp_path / "images" / "cat.png"), str(absolute)]
    groups = RolloutDataSourceWithBuffer(_args(str(path), no_rollout_shuffle=True)).get_samples(2)
    assert [sample.input_image for sample in groups[0]] == [rows[0].image] * 2


def test_an_undecodable_image_past_the_preflight_rows_is_skipped_with_a_counted_warning(tmp_path, caplog):
    _png(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    path = tmp_path / "edits.jsonl"
    path.write_text("".join(json.dumps({"input": f"p{i}", "image": "broken.png" if i == 2 else "ok.png"}) + "\n"
                            for i in range(4)))
    source = RolloutDataSourceWithBuffer(_args(str(path), no_rollout_shuffle=True))
    groups = source.get_samples(3) + source.get_samples(3)  # two passes over the file: the bad row twice
    assert [group[0].prompt for group in groups] == ["p0", "p1", "p3", "p0", "p1", "p3"]
    warnings = [r.getMessage() for r in caplog.records if "skipping the row" in r.getMessage()]
    assert len(warnings) == 1 and "edits.jsonl:3: input image" in warnings[0] and "1 of 4 rows" in warnings[0]
    path.write_text(json.dumps({"input": "p", "image": "broken.png"}) + "\n")
    with pytest.raises(MilesUserError, match="no row's input image decodes"):
        RolloutDataSourceWithBuffer(_args(str(path))).get_samples(1)


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"input": "a", "image": "missing.png"}', "edits.jsonl:2: input image 'missing.png' does not exist"),
        ('{"input": "a", "image": 3}', "edits.jsonl:2: 'image' must be the path of an image file, got 3"),
        ('{"input": "a", "image": ""}', "edits.jsonl:2: 'image' must be the path"),
    ],
)
def test_a_bad_input_image_names_the_file_and_line(tmp_path, row, message):
    _png(tmp_path / "ok.png")
    path = tmp_path / "edits.jsonl"
    path.write_text('{"input": "a", "image": "ok.png"}\n' + row + "\n")
    with pytest.raises(MilesUserError, match=message):
        load_prompt_data(str(path))


def test_condition_images_are_read_as_rgb_at_the_output_size(tmp_path):
    from PIL import Image

    from miles.rollout.condition_image import check_image_file, load_condition_image

    Image.new("L", (12, 8), 77).save(tmp_path / "grey.png")
    image = load_condition_image(str(tmp_path / "grey.png"), 16, 24)
    assert (image.height, image.width) == (16, 24) and image.to_tensor().shape == (16, 24, 3)
    assert torch.all(image.to_tensor() == 77)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(MilesUserError, match="p.jsonl:3: input image .*broken.png' cannot be read as an image"):
        check_image_file(str(tmp_path / "broken.png"), "--prompt-data p.jsonl:3")


def test_a_file_mixing_rows_with_and_without_an_input_image_is_refused(tmp_path):
    _png(tmp_path / "ok.png")
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"input": "a"}\n\n{"input": "b", "image": "ok.png"}\n')
    with pytest.raises(MilesUserError, match="mixed.jsonl:3: line 3 has an input image .* and line 1 has none"):
        load_prompt_data(str(path))
    path.write_text('{"input": "b", "image": "ok.png"}\n{"input": "a"}\n')
    with pytest.raises(MilesUserError, match="mixed.jsonl:2: line 1 has an input image .* and line 2 has none"):
        load_prompt_data(str(path))


SUBCLASSED_SOURCE = """
    from miles.rollout.data_source import RolloutDataSourceWithBuffer

    class Shouting(RolloutDataSourceWithBuffer):
        def __init__(self, args):
            super().__init__(args)
            self.seen_batch = args.rollout_batch_size
        def get_samples(self, num_groups, rollout_id=None):
            groups = super().get_samples(num_groups, rollout_id=rollout_id)
            for group in groups:
                for sample in group:
                    sample.prompt = sample.prompt.upper()
            return groups
"""


def test_a_subclass_of_the_default_source_is_built_with_args_and_keeps_its_behaviour(tmp_path, user_module):
    module = user_module(SUBCLASSED_SOURCE)
    args = _args(_write_prompts(tmp_path, 3), data_source_path=f"{module}.Shouting", no_rollout_shuffle=True,
                 rollout_batch_size=2)
    source = build_data_source(run_config_of(args))
    assert source.seen_batch == 2 and source.config is run_config_of(args)  # args in, the typed config kept
    plain = RolloutDataSourceWithBuffer(_args(_write_prompts(tmp_path, 3), no_rollout_shuffle=True))
    assert [g[0].prompt for g in source.get_samples(2)] == [g[0].prompt.upper() for g in plain.get_samples(2)]
