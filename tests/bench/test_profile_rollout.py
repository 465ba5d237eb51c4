"""bench/profile_rollout.py --rollout-gradient: the engine's runner, given random LoRA factors, takes every
sample's gradient during a synchronised rollout, and the profiled step's kernel table accounts for its time."""

import argparse

import pytest

from miles.engine.model_runner import ModelRunner
from miles.engine.server_args import ServerArgs


@pytest.fixture(scope="module")
def profile_rollout(bench_script):
    with bench_script("profile_rollout") as module:
        yield module


def test_a_rollout_gradient_rollout_keeps_each_samples_gradient_and_profiles_a_step(profile_rollout, tiny_checkpoint,
                                                                                    capsys):
    args = ServerArgs(model_path=tiny_checkpoint("sd3"), model_family="sd3", device="cpu", dtype="fp32",
                      generator_device="cpu", max_batch_size=8, rollout_gradient_tile=2)
    runner = ModelRunner(args)
    layers = profile_rollout.push_random_lora(runner, rank=4)
    assert layers == len(runner.rollout_gradients.layers) > 0
    opts = argparse.Namespace(num_images=4, samples_per_request=2, steps=2, cfg=3.5, height=32, width=32,
                              rollout_gradient=2)
    timer = profile_rollout.Timer(runner.device)
    profile_rollout.one_rollout(runner, opts, timer, profile_step=1)

    kept = runner.rollout_gradients.gradients
    assert sorted(kept) == [1000, 1001, 1002, 1003]  # request i's sample b under seed 1000 + i + b
    assert all(g.abs().sum() > 0 for g in kept.values())
    phases = {name for name, _ in timer.rows}
    assert {"step 0", "step 1", "start (encode, initial latents)", "finish (decode + pack)"} <= phases
    out = capsys.readouterr().out
    shares = [float(line.split("|")[3].strip().rstrip("%")) for line in out.splitlines()
              if line.startswith("| ") and line.rstrip().endswith("% |")]
    assert shares and abs(sum(shares) - 100.0) < 0.5
    assert "slowest kernels" in out

    profile_rollout.one_rollout(runner, opts, profile_rollout.Timer(runner.device))  # the same seeds again: fine
    assert sorted(runner.rollout_gradients.gradients) == [1000, 1001, 1002, 1003]


def test_inductor_settings_take_the_type_of_the_setting_and_refuse_unknown_keys(profile_rollout):
    settings = profile_rollout.inductor_settings(["coordinate_descent_tuning=True", "triton.cudagraphs=false",
                                                  "max_autotune_gemm_backends=ATEN"])
    assert settings == {"coordinate_descent_tuning": True, "triton.cudagraphs": False,
                        "max_autotune_gemm_backends": "ATEN"}
    for bad, said in (("no_such_knob=1", "has no 'no_such_knob'"), ("coordinate_descent_tuning", "KEY=VALUE"),
                      ("coordinate_descent_tuning=yes", "True or False")):
        with pytest.raises(SystemExit, match=said):
            profile_rollout.inductor_settings([bad])


def test_idle_gaps_are_the_device_intervals_no_kernel_covers_and_name_the_host_calls_inside_them(profile_rollout):
    kernels = [(0.0, 10.0), (5.0, 30.0), (100.0, 110.0), (115.0, 200.0), (260.0, 300.0)]
    host = [("cudaStreamSynchronize", 30.0, 100.0), ("aten::linear", 90.0, 120.0), ("launch", 240.0, 262.0)]
    span, busy, gaps, by_name = profile_rollout.idle_gaps(kernels, host, min_gap=20.0)
    assert span == 300.0
    assert busy == 30.0 + 10.0 + 85.0 + 40.0  # overlapping kernels counted once
    assert gaps == [(30.0, 100.0), (200.0, 260.0)]  # the 5 µs gap is under the threshold
    assert by_name == {"cudaStreamSynchronize": 70.0, "aten::linear": 10.0, "launch": 20.0}
    assert profile_rollout.idle_gaps([], host) == (0.0, 0.0, [], {})
