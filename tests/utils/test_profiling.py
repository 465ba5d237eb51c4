import os

import pytest
import torch

from miles.utils.profiling import profile_train_step, profiled_rollouts


def test_only_the_listed_rollouts_are_profiled(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_PROFILE_TRAIN_DIR", str(tmp_path))
    monkeypatch.setenv("MILES_PROFILE_TRAIN_ROLLOUTS", "1,3")
    assert profiled_rollouts() == {1, 3}
    for rollout_id in range(4):
        with profile_train_step(rollout_id, rank=0, device=torch.device("cpu")):
            (torch.randn(64, 64) @ torch.randn(64, 64)).sum()
    assert sorted(os.listdir(tmp_path)) == ["train_rollout1_rank0.txt", "train_rollout3_rank0.txt"]
    text = (tmp_path / "train_rollout3_rank0.txt").read_text()
    assert text.startswith("rollout 3, rank 0: wall ")
    assert "niceness" in text and "aten::mm" in text


def test_unset_directory_profiles_nothing(monkeypatch):
    monkeypatch.delenv("MILES_PROFILE_TRAIN_DIR", raising=False)
    assert profiled_rollouts() == set()


def test_bad_rollout_list_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("MILES_PROFILE_TRAIN_DIR", str(tmp_path))
    monkeypatch.setenv("MILES_PROFILE_TRAIN_ROLLOUTS", "two")
    with pytest.raises(ValueError, match="MILES_PROFILE_TRAIN_ROLLOUTS"):
        profiled_rollouts()


def test_fsdp_scopes_get_their_own_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_PROFILE_TRAIN_DIR", str(tmp_path))
    monkeypatch.setenv("MILES_PROFILE_TRAIN_ROLLOUTS", "0")
    with profile_train_step(0, rank=0, device=torch.device("cpu")):
        for _ in range(3):
            with torch.profiler.record_function("FSDP::all_gather"):
                (torch.randn(64, 64) @ torch.randn(64, 64)).sum()
    text = (tmp_path / "train_rollout0_rank0.txt").read_text()
    table = text.split("## FSDP2's scopes", 1)[1]
    assert [line.split()[:2] for line in table.strip().splitlines()[1:]] == [["FSDP::all_gather", "3"]]
