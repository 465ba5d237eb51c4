"""bench/bench_e2e.py's --miles-modes entries: a mode, then flags of its own (a variant measured beside it)."""

import argparse
import os

import pytest


@pytest.fixture(scope="module")
def bench_e2e(bench_script):
    with bench_script("bench_e2e") as module:
        yield module


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


def test_a_plain_loop_runs_in_a_process_of_its_own(bench_e2e):
    """Its device memory is given back when it ends, before the framework's launch measured after it."""
    assert bench_e2e.in_child_process(os.getpid) != os.getpid()


def test_a_launchs_folder_is_named_in_characters_a_device_call_brings_back(bench_e2e):
    name = bench_e2e.launch_folder(True, "compiled-rollout-gradient:--rollout-prefetch=off", 0)
    assert name == "miles-lora-compiled-rollout-gradient_--rollout-prefetch_off-0"


def test_a_launchs_console_and_metrics_are_kept_where_asked(bench_e2e, tmp_path):
    out = tmp_path / "work" / "miles-full-compiled-0"
    out.mkdir(parents=True)
    (out / "console.log").write_text("error: trainer rank 0 of 1 ran out of GPU memory\n")
    (out / "checkpoint.bin").write_bytes(b"0" * 64)  # what stays in the work directory
    bench_e2e.keep_logs(str(out), str(tmp_path / "logs"))
    kept = tmp_path / "logs" / "miles-full-compiled-0"
    assert sorted(p.name for p in kept.iterdir()) == ["console.log"]  # no metrics yet: the launch failed first
    assert "out of GPU memory" in (kept / "console.log").read_text()
    bench_e2e.keep_logs(str(out), None)  # not asked: nothing to do
