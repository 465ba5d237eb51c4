"""bench/bench_learning.py's pretraining under a `timeout`: the signal reaches the whole process group, and the
base the denoiser had learned is saved before the bench exits (an H100 call lost its 128 px pretraining to the
timeout seconds before the save)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# bench_learning's ensure_checkpoint with a recipe small enough for the CPU: the 32 px size, a few VAE steps, and
# a denoiser that would train for hours
_SCRIPT = textwrap.dedent("""
    import argparse, sys
    sys.path.insert(0, {bench!r})
    import bench_learning
    bench_learning.LARGE_PRETRAIN = ["--size", "small", "--images-per-scene", "1", "--vae-steps", "2",
                                     "--batch-size", "4", "--dit-steps", "1000000"]
    print("saved in", bench_learning.ensure_checkpoint(argparse.Namespace(checkpoint={out!r}, size="large",
                                                                          device="cpu")), flush=True)
""")


@pytest.mark.timeout(240)
def test_a_timeout_during_the_pretraining_saves_the_base_and_the_bench_waits_for_it(tmp_path):
    out = str(tmp_path / "base")
    script = _SCRIPT.format(bench=os.path.join(REPO, "bench"), out=out)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "denoiser step 1/" in line:
            os.killpg(process.pid, signal.SIGTERM)  # what `timeout` does
            break
    lines += process.stdout.readlines()
    assert process.wait() == 0, "".join(lines)
    log = "".join(lines)
    assert "by SIGTERM" in log and f"saved in {out}" in log
    assert os.path.exists(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))


def test_the_seconds_table_reads_the_framework_phases_and_leaves_the_compiling_iteration_out(tmp_path, bench_script):
    records = [  # an eval before rollouts 0 and 2, the final eval's record after the last iteration
        {"rollout_id": 0, "perf/startup_time": 30.0, "perf/eval_time": 4.0, "perf/rollout_time": 9.0,
         "perf/train_time": 20.0, "perf/weight_sync_time": 0.5, "perf/iteration_time": 34.0},
        {"rollout_id": 1, "perf/rollout_time": 1.0, "perf/train_time": 2.0, "perf/weight_sync_time": 0.25,
         "perf/iteration_time": 3.5},
        {"rollout_id": 2, "perf/eval_time": 2.0, "perf/rollout_time": 3.0, "perf/train_time": 4.0,
         "perf/iteration_time": 9.5},
        {"rollout_id": 3, "eval/heldout/reward/shapes_correct_mean": 0.5},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"rollout_id": 4, "perf/')  # a line in writing
    with bench_script("bench_learning") as bench_learning:  # loaded as the other bench tests load their script
        seconds = bench_learning.framework_seconds(str(metrics))
    assert seconds == {"startup": 30.0, "first_iteration": 30.0, "rollout": 2.0, "train": 3.0, "other": 0.5,
                       "eval": 3.0}
