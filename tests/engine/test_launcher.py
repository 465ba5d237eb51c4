"""The engine process's environment (miles/engine/launcher.py)."""

from miles.engine.launcher import ENGINE_CUDA_ALLOC_CONF, engine_environment
from miles.utils.auth import API_KEY_ENV


def test_engines_grow_their_allocator_segments_by_default():
    env = engine_environment({"PATH": "/bin"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == ENGINE_CUDA_ALLOC_CONF == "expandable_segments:True"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1" and env["PATH"] == "/bin"


def test_the_runs_own_allocator_setting_and_the_callers_entries_win():
    env = engine_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512", "HF_HUB_OFFLINE": "0"},
                             env={"CUDA_VISIBLE_DEVICES": "1"}, api_key="k" * 32)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert env["HF_HUB_OFFLINE"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "1" and env[API_KEY_ENV] == "k" * 32
    assert engine_environment({}, env={"PYTORCH_CUDA_ALLOC_CONF": ""})["PYTORCH_CUDA_ALLOC_CONF"] == ""
