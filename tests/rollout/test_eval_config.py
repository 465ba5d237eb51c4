"""Eval datasets from --eval-prompt-data pairs and --eval-config (YAML / JSON)."""

from __future__ import annotations

import json

import pytest

from miles.config.rollout_sections import EvalSetsConfig
from miles.rollout.eval_config import EvalDataset, build_eval_datasets
from miles.testing.config import trainer_config
from miles.utils.errors import MilesUserError


def _args(**overrides) -> EvalSetsConfig:
    values = dict(eval_prompt_data=None, eval_config=None, eval_input_key=None, input_key="input",
                  metadata_key="metadata", n_samples_per_eval_prompt=2, diffusion_eval_num_steps=None,
                  diffusion_num_steps=10, eval_reward_key=None, reward_key="ocr", rm_type="ocr")
    values.update(overrides)
    return trainer_config(**values).eval_sets


@pytest.fixture
def prompt_files(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"input": f"{name} prompt", "text": f"{name} text"}) + "\n")
    return tmp_path


def test_no_eval_configured():
    assert build_eval_datasets(_args()) == []


def test_name_path_pairs_take_the_flag_defaults(prompt_files):
    args = _args(eval_prompt_data=["first", str(prompt_files / "a.jsonl"), "second", str(prompt_files / "b.jsonl")],
                 diffusion_eval_num_steps=40, eval_reward_key="aesthetic")
    datasets = build_eval_datasets(args)
    assert datasets == [
        EvalDataset("first", str(prompt_files / "a.jsonl"), "input", "metadata", 2, 40, "aesthetic", None),
        EvalDataset("second", str(prompt_files / "b.jsonl"), "input", "metadata", 2, 40, "aesthetic", None),
    ]
    assert [row.prompt for row in datasets[0].load_prompts()] == ["a prompt"]
    assert build_eval_datasets(_args(eval_prompt_data=["x", str(prompt_files / "a.jsonl")]))[0].num_steps == 10


def test_yaml_config_overrides_pairs(prompt_files):
    config = prompt_files / "eval.yaml"
    config.write_text(
        "eval:\n"
        "  defaults:\n"
        "    n_samples_per_eval_prompt: 4\n"
        "  datasets:\n"
        "    - name: ocr_test\n"
        "      path: a.jsonl\n"  # relative to the config's folder
        "      input_key: text\n"
        "      num_steps: 40\n"
        "    - name: pick\n"
        f"      path: {prompt_files / 'b.jsonl'}\n"
        "      reward_key: pickscore\n"
        "      rm_type: pickscore\n"
        "      n_samples_per_eval_prompt: 1\n"
    )
    args = _args(eval_config=str(config), eval_prompt_data=["ignored", "nowhere.jsonl"])
    first, second = build_eval_datasets(args)
    assert (first.name, first.input_key, first.num_steps, first.n_samples_per_eval_prompt) == ("ocr_test", "text", 40, 4)
    assert first.path == str(prompt_files / "a.jsonl")
    assert [row.prompt for row in first.load_prompts()] == ["a text"]
    assert (second.reward_key, second.rm_type, second.n_samples_per_eval_prompt, second.num_steps) == ("pickscore", "pickscore", 1, 10)


def test_json_config(prompt_files):
    config = prompt_files / "eval.json"
    config.write_text(json.dumps({"datasets": [{"name": "j", "path": "b.jsonl"}]}))
    (dataset,) = build_eval_datasets(_args(eval_config=str(config)))
    assert dataset.name == "j" and dataset.reward_key == "ocr"


@pytest.mark.parametrize(
    "text, message",
    [
        ("datasets: []\n", "non-empty 'datasets' list"),
        ("datasets:\n  - name: x\n", "needs 'name' and 'path'"),
        ("datasets:\n  - name: x\n    path: a.jsonl\n    num_step: 3\n", r"datasets\[0\]: unknown keys \['num_step'\]"),
        ("datasets:\n  - name: x\n    path: missing.jsonl\n", "file .*missing.jsonl.* does not exist"),
        ("datasets:\n  - {name: x, path: a.jsonl}\n  - {name: x, path: b.jsonl}\n", "duplicate dataset names"),
        ("datasets:\n  - {name: x, path: a.jsonl, num_steps: 0}\n", "must be >= 1"),
        ("datasets: [unclosed\n", "cannot parse"),
    ],
)
def test_config_errors(prompt_files, text, message):
    config = prompt_files / "eval.yaml"
    config.write_text(text)
    with pytest.raises(MilesUserError, match=message) as error:
        build_eval_datasets(_args(eval_config=str(config)))
    assert "--eval-config" in str(error.value)


def test_pair_errors(prompt_files):
    with pytest.raises(MilesUserError, match="NAME PATH pairs"):
        build_eval_datasets(_args(eval_prompt_data=["only_a_name"]))
    with pytest.raises(MilesUserError, match="does not exist"):
        build_eval_datasets(_args(eval_prompt_data=["x", str(prompt_files / "nope.jsonl")]))
    with pytest.raises(MilesUserError, match="does not exist"):
        build_eval_datasets(_args(eval_config=str(prompt_files / "nope.yaml")))


def test_scalar_reward_uses_the_dataset_reward_key(prompt_files):
    (dataset,) = build_eval_datasets(_args(eval_prompt_data=["x", str(prompt_files / "a.jsonl")], eval_reward_key="ocr"))
    assert dataset.scalar_reward({"ocr": 0.5, "aesthetic": 3.0}) == 0.5
    assert dataset.scalar_reward(0.25) == 0.25
    (no_key,) = build_eval_datasets(_args(eval_prompt_data=["x", str(prompt_files / "a.jsonl")], reward_key=None))
    with pytest.raises(MilesUserError, match="eval dataset 'x': the reward is a dict"):
        no_key.scalar_reward({"ocr": 0.5})
