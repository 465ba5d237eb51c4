"""Files are loaded without running code from them, and a bad file is one line naming it (miles.utils.safe_load)."""

from __future__ import annotations

import argparse

import torch

from miles.types import Sample
from miles.testing.payloads import RunsCode, one_line_error
from miles.utils.safe_load import load_plain, plain_value_problem, save_plain


def test_load_plain_refuses_code_and_names_the_file(tmp_path):
    marker, path = tmp_path / "ran", str(tmp_path / "data.pt")
    torch.save({"x": torch.ones(2), "payload": RunsCode(str(marker))}, path)
    message = one_line_error(load_plain, path, "--some-flag")
    assert message.startswith(f"--some-flag: refusing to load {path} with weights_only=True: it holds io.open")
    assert not marker.exists()


def test_load_plain_damaged_and_missing_files(tmp_path):
    path = str(tmp_path / "data.pt")
    torch.save({"x": torch.arange(1000)}, path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:200])
    assert one_line_error(load_plain, path, "--flag").startswith(f"--flag: {path} is truncated or corrupt (")
    open(path, "wb").write(b"not a torch file")
    assert "is truncated or corrupt" in one_line_error(load_plain, path, "--flag")
    assert one_line_error(load_plain, str(tmp_path / "absent.pt"), "--flag").endswith("absent.pt does not exist")


def test_plain_value_problem_names_the_first_unloadable_value():
    plain = {"a": [1, 2.0, "s", None, True, (torch.zeros(1), b"x")], "b": {3: torch.float32}}
    assert plain_value_problem(plain) is None
    assert plain_value_problem({"a": [1, argparse.Namespace()]}) == ".a[1]: an object of type argparse.Namespace"
    assert plain_value_problem({"a": {(1, 2): 3}}) == ".a: a key of type tuple"


def test_save_plain_refuses_before_writing(tmp_path):
    path = tmp_path / "out.pt"
    message = one_line_error(save_plain, {"state": {"obj": argparse.Namespace()}}, str(path), "--flag")
    assert "it would hold state.obj: an object of type argparse.Namespace" in message and not path.exists()


def test_samples_round_trip_as_plain_records(tmp_path):
    sample = Sample(prompt="a cat", index=3, metadata={"rm_type": "brightness"}, image=torch.zeros(1, 2, 2, 3),
                    latents={0: torch.ones(2), 1: torch.zeros(2)}, reward={"score": 0.5}, sde_step_indices=[0, 1])
    path = str(tmp_path / "rollout.pt")
    save_plain({"rollout_id": 0, "samples": [sample.to_record()]}, path, "--save-debug-rollout-data")
    record = load_plain(path, "--load-debug-rollout-data")["samples"][0]
    back = Sample.from_record(record, "here")
    assert back.prompt == "a cat" and back.metadata == {"rm_type": "brightness"} and back.reward == {"score": 0.5}
    assert torch.equal(back.latents[1], torch.zeros(2)) and back.sde_step_indices == [0, 1]
    assert "not a Sample record (unknown keys ['bogus']" in one_line_error(Sample.from_record, {**record, "bogus": 1}, "f:0")


def test_load_debug_rollout_data_refuses_pickled_objects(tmp_path):
    from miles.ray.rollout_manager import RolloutManager
    from miles.testing.config import trainer_config

    marker, template = tmp_path / "ran", str(tmp_path / "rollout_{rollout_id}.pt")
    torch.save({"rollout_id": 0, "samples": [RunsCode(str(marker))]}, template.format(rollout_id=0))
    manager = argparse.Namespace(config=trainer_config(load_debug_rollout_data=template))
    message = one_line_error(RolloutManager._load_debug_rollout, manager, 0)
    assert message.startswith("--load-debug-rollout-data: refusing to load") and not marker.exists()
    save_plain({"rollout_id": 0, "samples": [Sample(prompt="p").to_record()]}, template.format(rollout_id=0), "t")
    assert [s.prompt for s in RolloutManager._load_debug_rollout(manager, 0)] == ["p"]
