"""A run's life as a user sees it, on CPU with real Ray, engines and HTTP (tiny SD3 and LTX-Video): runs started
at once on one machine all finish (each owns its Ray), the console says started / evaluated / saved / exported /
finished and no warning, the exports are readable by the group, Ctrl-C leaves the pictures, a video family writes
MP4 files, and a finished run asked to continue says so in one line before Ray starts.

The runs are started once for the module, all at the same moment; the tests read what they left.
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
def runs(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[list[str], Path, int]]:
    """Three runs started at the same moment on this machine, each with its own Ray: "a" (SD3) and "b" (LTX-Video,
    a video family) run to the end, "c" gets SIGINT (Ctrl-C) once its first rollout is logged.
    name -> (flags, folder, exit status)."""
    import signal

    from miles.testing.make_prompts import write_prompts

    root = tmp_path_factory.mktemp("runs")
    prompts = write_prompts(str(root / "prompts.jsonl"), count=4)
    flags = {
        "a": run_flags(tiny_checkpoint("sd3"), prompts, root / "a"),
        "b": [*run_flags(tiny_checkpoint("ltx"), prompts, root / "b"), "--diffusion-model-family", "ltx",
              "--diffusion-output-num-frames", "9"],
        "c": [*run_flags(tiny_checkpoint("sd3"), prompts, root / "c"), "--num-rollout", "1000"],
    }
    drivers = {name: start(flags[name], root / name) for name in flags}
    results = {}
    try:
        deadline = time.monotonic() + 600
        while "rollout 0 |" not in stderr_of(root / "c"):
            assert drivers["c"].poll() is None, stderr_of(root / "c")[-4000:]
            assert time.monotonic() < deadline, "run c logged no rollout within 600 s"
            time.sleep(0.2)  # the log line is the only sign its loop runs
        drivers["c"].send_signal(signal.SIGINT)
        for name, driver in drivers.items():
            results[name] = (flags[name], root / name, driver.wait(timeout=600))
    finally:
        for driver in drivers.values():
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    return results


def stderr_of(folder: Path) -> str:
    return (folder / "stderr.txt").read_text()


def test_runs_started_at_once_all_finish(runs):
    for name in ("a", "b"):
        _, folder, status = runs[name]
        assert status == 0, f"run {name} failed ({status}):\n{stderr_of(folder)[-6000:]}"
        lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
        assert len([line for line in lines if '"rollout/reward_mean"' in line]) == NUM_ROLLOUT


def test_the_console_tells_the_story_and_warns_of_nothing(runs):
    _, folder, status = runs["a"]
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


def test_exports_and_pictures_are_readable_by_the_group(runs):
    _, folder, status = runs["a"]
    assert status == 0
    files = [p for p in (folder / "out" / "export").rglob("*") if p.is_file()]
    assert files
    private = [str(p) for p in files if not os.stat(p).st_mode & stat.S_IRGRP]
    assert private == []
    for picture in ("samples.png", "reward_curve.png"):
        assert (folder / "out" / picture).is_file()


def test_a_finished_run_asked_to_continue_says_so_before_ray_starts(runs):
    flags, folder, status = runs["b"]
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


def test_ctrl_c_mid_run_leaves_the_captioned_grid_and_the_curve(runs):
    """SIGINT once a rollout is logged: exit 130 after the cleanup, and the pictures are there."""
    import signal

    from PIL import Image

    from miles.logging.plots import CAPTION_LINE_PIXELS, MIN_TILE_PIXELS

    _, folder, status = runs["c"]
    assert status == 128 + signal.SIGINT, stderr_of(folder)[-4000:]
    assert stderr_of(folder).splitlines()[-1] == ("error: stopped by SIGINT; the run's engines, router and workers "
                                                 "were shut down")
    out = folder / "out"
    assert (out / "reward_curve.png").is_file() and (out / "samples" / "first_rollout.png").is_file()
    grid = Image.open(out / "samples.png").convert("L")
    first_caption = grid.crop((0, CAPTION_LINE_PIXELS + 2 + MIN_TILE_PIXELS, MIN_TILE_PIXELS, grid.height // 2))
    assert min(first_caption.getdata()) < 100  # the caption's text is drawn under the first tile


def test_a_video_family_writes_video_files(runs):
    av = pytest.importorskip("av")
    _, folder, status = runs["b"]
    assert status == 0, stderr_of(folder)[-4000:]
    videos = sorted((folder / "out" / "videos").glob("*.mp4"))
    assert [v.name for v in videos][:1] == [f"rollout_{NUM_ROLLOUT - 1:07d}_0.mp4"], videos
    with av.open(str(videos[0])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 9
