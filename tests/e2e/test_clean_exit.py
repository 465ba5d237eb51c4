"""A run ended by SIGTERM or SIGKILL leaves nothing behind: real Ray, a real engine process and router, tiny
SD3 on CPU.

The driver is signalled once the engine is up and the loop runs; afterwards no process of the run (found by the
MILES_RUN_ID every one of them carries) remains. After SIGTERM no shared-memory file of theirs remains either and
the driver's last words are one line; after SIGKILL (no cleanup runs at all) the processes are gone within 20 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.testing.processes import run_processes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def start_run(tiny_checkpoint, tmp_path) -> tuple[subprocess.Popen, Path]:
    """A long tiny run in the background, its stderr in a file; returns (driver, stderr path)."""
    from miles.testing.make_prompts import write_prompts

    prompts = write_prompts(str(tmp_path / "prompts.jsonl"), count=8)
    out = tmp_path / "run"
    argv = [
        "--hf-checkpoint", tiny_checkpoint("sd3"), "--diffusion-model-family", "sd3", "--prompt-data", prompts,
        "--rm-type", "brightness", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--num-gpus-per-node", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-microgroup-size", "4", "--diffusion-num-steps", "4", "--diffusion-height", "32",
        "--diffusion-width", "32", "--diffusion-guidance-scale", "1.0", "--diffusion-forward-dtype", "fp32",
        "--micro-batch-size", "4", "--num-rollout", "1000", "--output-dir", str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        driver = subprocess.Popen([sys.executable, str(REPO / "train_diffusion.py"), *argv], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    return driver, stderr_path


def wait_for_line(driver: subprocess.Popen, stderr_path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in stderr_path.read_text():
        assert driver.poll() is None, f"the run ended early:\n{stderr_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the run did not log {text!r} within {timeout}s"
        time.sleep(0.2)


def assert_engine_router_and_trainer_up(processes: dict[int, str]) -> None:
    commands = " ".join(processes.values())
    assert "-m miles.engine" in commands and "-m miles.router" in commands and "TrainRayActor" in commands


def test_sigterm_stops_engines_router_and_workers_with_one_line(tiny_checkpoint, tmp_path):
    driver, stderr_path = start_run(tiny_checkpoint, tmp_path)
    try:
        wait_for_line(driver, stderr_path, "rollout 0 |")  # engine and router up, the loop past its 1st rollout
        before = run_processes(driver.pid)
        assert_engine_router_and_trainer_up(before)
        lines_before = len(stderr_path.read_text().splitlines())
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    after = stderr_path.read_text().splitlines()[lines_before:]
    final = "error: stopped by SIGTERM; the run's engines, router and workers were shut down"
    # Log lines of work that was already under way may still arrive; after them, exactly one line, no traceback.
    assert after[-1] == final and final not in after[:-1], "\n".join(after)
    assert not any(word in line for line in after[:-1] for word in ("Traceback", "ERROR", "Unhandled error")), after
    assert run_processes(driver.pid) == {}, f"processes outlived the run: {run_processes(driver.pid)}"
    shm = os.listdir("/dev/shm")
    assert [name for name in shm if any(name.startswith(f"torch_{pid}_") for pid in before)] == []


def test_sigkill_of_the_driver_leaves_no_process(tiny_checkpoint, tmp_path):
    """SIGKILL runs no cleanup: Ray's processes share the driver's fate, and the router and the engine end
    because their parent did (miles.utils.parent_death)."""
    driver, stderr_path = start_run(tiny_checkpoint, tmp_path)
    try:
        wait_for_line(driver, stderr_path, "started:")  # engine, router and trainer up
        assert_engine_router_and_trainer_up(run_processes(driver.pid))
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 20
    while run_processes(driver.pid) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling other processes' exit: there is no event to wait on
    left = run_processes(driver.pid)
    for pid in left:  # a failed test must not leave them running either
        os.kill(pid, signal.SIGKILL)
    assert left == {}, f"processes outlived the driver by 20s: {left}"
