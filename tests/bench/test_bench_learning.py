"""bench/bench_learning.py's pretraining under a `timeout`: the signal reaches the whole process group, and the
base the denoiser had learned is saved before the bench exits (an H100 call lost its 128 px pretraining to the
timeout seconds before the save)."""

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
