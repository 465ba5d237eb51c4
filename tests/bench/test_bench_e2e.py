"""bench/bench_e2e.py's --miles-modes entries: a mode, then flags of its own (a variant measured beside it)."""

import argparse
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_e2e.py")


@pytest.fixture(scope="module")
def bench_e2e():
    sys.path.insert(0, os.path.dirname(BENCH))  # as a script it imports bench/plain_loop.py from its own folder
    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_e2e", None)
    sys.path.remove(os.path.dirname(BENCH))


def test_a_mode_variant_adds_its_flags_after_the_modes_own(bench_e2e):
    assert bench_e2e.split_mode("compiled") == ("compiled", [])
    mode = "compiled-rollout-gradient:--sglang-attention-backend=_native_cudnn:--rollout-gradient-tile=16"
    assert bench_e2e.split_mode(mode) == ("compiled-rollout-gradient", ["--sglang-attention-backend", "_native_cudnn",
                                                                        "--rollout-gradient-tile", "16"])
    opts = argparse.Namespace(prompts=2, samples=2, steps=2, trained_steps=0, height=32, width=32, guidance=4.5,
                              noise_level=0.7, device="cpu", micro_batch_size=2, iterations=1, extra_flags=["--seed", "3"])
    flags = bench_e2e.miles_flags(opts, "ckpt", "prompts.txt", "out", lora=True, mode=mode)
    assert flags[-6:] == ["--sglang-attention-backend", "_native_cudnn", "--rollout-gradient-tile", "16", "--seed", "3"]
    assert "--diffusion-rollout-gradient" in flags and "--sglang-enable-torch-compile" in flags


def test_a_variant_flag_without_dashes_is_refused(bench_e2e):
    with pytest.raises(SystemExit, match="expected --FLAG"):
        bench_e2e.split_mode("compiled:sglang-attention-backend=x")
