"""A run's life as a user sees it, on CPU with real Ray, engines and HTTP (tiny SD3): two runs started at once on
one machine both finish (each owns its Ray), the console says started / evaluated / saved / exported /
finished and no warning, the exports are readable by the group, and a finished run asked to continue says so in
one line before Ray starts.

The two runs are started once for the module; the tests read what they left.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NUM_ROLLOUT = 2


def run_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)  # each run starts its own Ray
    return env


def run_flags(sd3: str, prompts: str, folder: Path) -> list[str]:
    return [
        "--hf-checkpoint", sd3, "--diffusion-model-family", "sd3", "--prompt-data", prompts,
        "--eval-prompt-data", "val", prompts, "--n-samples-per-eval-prompt", "1",
        "--rm-type", "brightness", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--num-gpus-per-node", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-microgroup-size", "2", "--diffusion-num-steps", "2", "--diffusion-height", "32",
        "--diffusion-width", "32", "--diffusion-guidance-scale", "1.0", "--diffusion-forward-dtype", "fp32",
        "--micro-batch-size", "4", "--colocate", "--num-rollout", str(NUM_ROLLOUT),
        "--output-dir", str(folder / "out"), "--save", str(folder / "ckpt"), "--load", str(folder / "ckpt"),
        "--save-interval", "1", "--export-interval", str(NUM_ROLLOUT),
    ]


def start(flags: list[str], folder: Path) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(REPO / "train_diffusion.py"), *flags], cwd=REPO, env=run_env(),
                            stdout=open(folder / "stdout.txt", "w"), stderr=open(folder / "stderr.txt", "w"))


@pytest.fixture(scope="module")
def two_runs(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[list[str], Path, int]]:
    """Two runs started at the same moment on this machine: name -> (flags, folder, exit status)."""
    from miles.testing.make_prompts import write_prompts

    root = tmp_path_factory.mktemp("two-runs")
    prompts = write_prompts(str(root / "prompts.jsonl"), count=4)
    flags = {name: run_flags(tiny_checkpoint("sd3"), prompts, root / name) for name in ("a", "b")}
    drivers = {name: start(flags[name], root / name) for name in flags}
    results = {}
    for name, driver in drivers.items():
        try:
            status = driver.wait(timeout=600)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        results[name] = (flags[name], root / name, status)
    return results


def stderr_of(folder: Path) -> str:
    return (folder / "stderr.txt").read_text()


def test_two_runs_started_at_once_both_finish(two_runs):
    for name, (_, folder, status) in two_runs.items():
        assert status == 0, f"run {name} failed ({status}):\n{stderr_of(folder)[-6000:]}"
        lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
        assert len([line for line in lines if '"rollout/reward_mean"' in line]) == NUM_ROLLOUT


def test_the_console_tells_the_story_and_warns_of_nothing(two_runs):
    _, folder, status = two_runs["a"]
    assert status == 0
    text = stderr_of(folder)
    ckpt, export = folder / "ckpt", folder / "out" / "export"
    expected = [
        r"INFO miles: started: sd3 from \S+ on cpu, 1 trainer rank\(s\), 1 engine\(s\) colocated; per rollout 2 "
        r"prompts x 2 samples = 4 trajectories, 8 train pairs, 1 optimizer step\(s\); rollouts 0\.\.1 of 2",
        r"evaluated val before rollout 0: reward_mean=[\d.]+ reward_std=[\d.e-]+ over 4 samples; grid \S+val\.png",
        rf"saved the checkpoint of rollout 0: {ckpt}/iter_0000000",
        rf"saved the checkpoint of rollout 1: {ckpt}/iter_0000001",
        rf"exported the policy of rollout 1 for inference: {export}/iter_0000001",
        r"evaluated val before rollout 2: ",
        r"rollout 2 \| eval/val/reward_mean=[\d.]+",  # the eval after the last rollout reaches the console
        rf"finished: rollouts 0\.\.1 of 2 in \d+ s; reward_mean [\d.]+ -> [\d.]+; last checkpoint "
        rf"{ckpt}/iter_0000001; metrics, curves and samples in {folder / 'out'}",
    ]
    for pattern in expected:
        assert re.search(pattern, text), f"{pattern!r} not in the console:\n{text[-6000:]}"
    assert "(no metrics)" not in text and "{'rollout/" not in text  # no raw metrics dict per rollout
    noisy = [line for line in text.splitlines() if re.search(r"warn|WARN|Traceback", line)]
    assert noisy == [], "a clean run printed warnings:\n" + "\n".join(noisy)


def test_exports_and_pictures_are_readable_by_the_group(two_runs):
    _, folder, status = two_runs["a"]
    assert status == 0
    files = [p for p in (folder / "out" / "export").rglob("*") if p.is_file()]
    assert files
    private = [str(p) for p in files if not os.stat(p).st_mode & stat.S_IRGRP]
    assert private == []
    for picture in ("samples.png", "reward_curve.png"):
        assert (folder / "out" / picture).is_file()


def test_a_finished_run_asked_to_continue_says_so_before_ray_starts(two_runs):
    flags, folder, status = two_runs["b"]
    assert status == 0
    began = time.monotonic()
    again = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *flags], cwd=REPO, env=run_env(),
                           capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - began
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        f"--load {folder / 'ckpt'}: checkpoint at rollout {NUM_ROLLOUT} ({folder / 'ckpt' / 'iter_0000001'}), "
        f"--num-rollout {NUM_ROLLOUT}: nothing to train (raise --num-rollout to continue)"]
    assert "Ray" not in again.stderr and seconds < 60, (seconds, again.stderr[-3000:])
