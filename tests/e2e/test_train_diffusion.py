"""End-to-end runs of train_diffusion.py on CPU: real Ray, real engine processes, real HTTP, tiny SD3.

Each test runs the entry point in a subprocess (as a user would) and reads the metrics JSONL it writes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint) -> str:
    return tiny_checkpoint("sd3")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    from miles.testing.make_prompts import write_prompts

    return write_prompts(str(tmp_path_factory.mktemp("data") / "prompts.jsonl"), count=8)


def base_flags(sd3: str, prompts: str, out: Path) -> list[str]:
    """A tiny CPU Flow-GRPO run that a random model learns from within a few rollouts."""
    return [
        "--hf-checkpoint", sd3, "--diffusion-model-family", "sd3", "--prompt-data", prompts,
        "--rm-type", "brightness",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--rollout-microgroup-size", "4",
        "--diffusion-num-steps", "4", "--diffusion-height", "32", "--diffusion-width", "32",
        "--diffusion-guidance-scale", "1.0", "--diffusion-noise-level", "0.9", "--diffusion-forward-dtype", "fp32",
        "--loss-type", "policy_loss", "--diffusion-clip-range", "1e-2", "--lr", "2e-2", "--micro-batch-size", "4",
        "--output-dir", str(out),
    ]


def run_env(ray_address: str | None = None) -> dict[str, str]:
    """`ray_address`: join that Ray cluster (RAY_ADDRESS) instead of starting one."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for inherited in ("RAY_ADDRESS", "MILES_API_KEY_FILE", "MILES_RUN_FOLDER"):  # each run makes its own
        env.pop(inherited, None)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def run(argv: list[str], timeout: float = 600, ray_address: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *argv], capture_output=True,
                            text=True, cwd=REPO, env={**run_env(ray_address), **(env or {})}, timeout=timeout)
    assert result.returncode == 0, f"train_diffusion.py failed ({result.returncode}):\n{result.stderr[-6000:]}"
    return result


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


def test_flow_grpo_reward_rises(sd3, prompts, tmp_path, private_temp_root):
    # one seed: tests/e2e/test_shapes_learning.py measures learning on a task whose outputs can be checked
    out, seed = tmp_path / "run", 1
    run([*base_flags(sd3, prompts, out), "--num-rollout", "15", "--seed", str(seed), "--rollout-seed", str(seed),
         "--colocate"], env={"TMPDIR": private_temp_root})
    # the run's folders (its key file's, its Ray instance's) went with it
    assert not [p.name for p in Path(private_temp_root).iterdir() if p.name.startswith("miles-")]
    records = metrics(out)
    rewards = series(records, "rollout/reward_mean")
    assert len(rewards) == 15
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # The tiny random VAE decodes nearly gray images, so rewards spread little (std ~0.003 within a rollout);
    # "clearly above" means several within-rollout standard deviations.
    spread = series(records, "rollout/reward_std")[0]
    assert last > first + max(0.01, 3 * spread), f"reward did not rise: {rewards}"
    assert (out / "reward_curve.png").exists() and (out / "samples.png").exists()
    # the start-up is accounted: the trainer's part split into laps, the engine's model load beside it
    laps = {k: v for k, v in records[0].items() if k.startswith("perf/startup/trainer_init/")}
    assert {"spawn", "process_group", "load", "adapters", "shard", "resume", "other"} <= {
        k[len("perf/startup/trainer_init/"):-len("_time")] for k in laps}
    assert records[0]["perf/startup/trainer_init/load_time"] > 0 and records[0]["perf/engine_load_s"] > 0
    assert records[0]["perf/startup/engines_launch_time"] >= 0  # asking for the engines' processes: its own part
    # each weight push's seconds split into its parts (bench_e2e prints them)
    sync = [r for r in records if "weight_sync/seconds" in r]
    assert len(sync) == 15 and all(0 < r["weight_sync/engine_apply_seconds"] and 0 <= r["weight_sync/gather_seconds"]
                                   and r["weight_sync/engine_apply_seconds"] < r["weight_sync/seconds"] for r in sync)


@pytest.fixture
def private_temp_root():
    """A short TMPDIR for one run (Ray's socket paths live under it), removed afterwards."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="mk-", dir="/tmp")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def key_holders(key: str, roots: list[Path]) -> tuple[int, list[tuple[str, str]]]:
    """How many files under `roots` were read, and (path, mode) of each that holds `key`."""
    import stat

    holders, files = [], 0
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                files += 1
                if key.encode() in path.read_bytes():
                    holders.append((str(path), oct(stat.S_IMODE(path.stat().st_mode))))
    return files, holders


def test_alignment_probe_is_exact_and_the_key_lands_only_in_0600_files(sd3, prompts, tmp_path, private_temp_root):
    """Also: every file the run writes (its output folder, its private run folder with Ray's session and logs)
    is read for the run's key; only files of mode 0600 may hold it (docs/security.md). The key comes in a key file
    (MILES_API_KEY_FILE) and is in no process's environment: every process of the run reads it from there."""
    import os
    import secrets
    import stat

    key = secrets.token_hex(32)
    key_file = Path(private_temp_root) / "my_key"
    key_file.touch(mode=0o600)
    key_file.write_text(key)
    out = tmp_path / "probe"
    env = {**run_env(), "TMPDIR": private_temp_root, "MILES_API_KEY_FILE": str(key_file),
           "MILES_KEEP_RAY_TEMP": "1"}  # Ray's session stays to be read
    env.pop("MILES_API_KEY")
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *base_flags(sd3, prompts, out),
                             "--num-rollout", "2", "--debug-skip-optimizer-step", "--diffusion-debug-mode",
                             "--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "1",
                             "--sglang-max-batch-size", "4"], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert key_file.exists() and os.environ.get("MILES_API_KEY") != key
    records = metrics(out)
    assert series(records, "train/log_prob_mean_abs_diff") == [0.0, 0.0]
    assert series(records, "train/model_output_mean_abs_diff") == [0.0, 0.0]

    assert key not in result.stdout + result.stderr
    folders = [p for p in Path(private_temp_root).iterdir() if p.name.startswith("miles-")]
    ray_folders = [p for p in folders if p.name.startswith("miles-ray-")]
    assert len(ray_folders) == 1  # the run's Ray folder (the key came in a file of the user's: no run folder needed)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in folders), [(p, oct(p.stat().st_mode)) for p in folders]
    assert list(ray_folders[0].glob("r/session_*/logs/*.log")), "Ray did not use the run's private folder"
    files, holders = key_holders(key, [Path(private_temp_root), out])
    assert files > 20 and all(mode == "0o600" for _, mode in holders), holders
    assert (str(key_file), "0o600") in holders  # the search finds the key where it is


def test_nft_reward_rises(sd3, prompts, tmp_path):
    out = tmp_path / "nft"
    flags = base_flags(sd3, prompts, out)
    run([*flags, "--num-rollout", "12", "--loss-type", "nft", "--diffusion-sde-type", "ode",
         "--diffusion-noise-level", "0", "--use-ema", "--ema-rollout-policy", "ema", "--globalize-reward-std",
         "--lr", "1e-2"])
    records = metrics(out)
    rewards = series(records, "rollout/reward_mean")
    spread = series(records, "rollout/reward_std")[0]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + max(0.01, 3 * spread), f"reward did not rise: {rewards}"
    assert series(records, "train/ema_num_updates")[-1] == 12.0


def test_sft_loss_falls(sd3, tmp_path):
    from PIL import Image

    data = tmp_path / "sft"
    data.mkdir()
    rows = []
    for i in range(4):
        Image.new("RGB", (40, 40), (60 * i, 255 - 60 * i, 128)).save(data / f"img{i}.png")
        rows.append(json.dumps({"input": f"a flat color {i}", "image": f"img{i}.png"}))
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "sft-run"
    run(["--hf-checkpoint", sd3, "--diffusion-model-family", "sd3", "--prompt-data", str(data / "train.jsonl"),
         "--train-only", "--loss-type", "sft_loss", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
         "--rollout-batch-size", "4", "--global-batch-size", "4", "--num-rollout", "30",
         "--diffusion-height", "32", "--diffusion-width", "32", "--diffusion-forward-dtype", "fp32",
         "--lr", "1e-3", "--micro-batch-size", "4", "--output-dir", str(out), "--export-interval", "20"])
    losses = series(metrics(out), "train/loss")
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, f"loss did not fall: {losses}"
    # --export-interval 20: after rollout 19 and after the last one, a full fine-tune as a pipeline folder
    assert sorted(os.listdir(out / "export")) == ["iter_0000019", "iter_0000029"]
    assert [r["rollout_id"] for r in metrics(out) if "perf/export_time" in r] == [19, 29]  # timed, not unaccounted
    from diffusers import DiffusionPipeline

    exported = DiffusionPipeline.from_pretrained(str(out / "export" / "iter_0000029"))
    assert type(exported).__name__ == "StableDiffusion3Pipeline"


RESUME_KEYS = ("rollout/reward_mean", "train/loss", "train/grad_norm")


@pytest.fixture(scope="module")
def uninterrupted(sd3, prompts, tmp_path_factory) -> tuple[list[str], list[dict]]:
    """(flags, metrics) of a deterministic 4-rollout run: what every resumed run must reproduce."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    flags = [*base_flags(sd3, prompts, folder / "unused"), "--deterministic-mode", "--num-rollout", "4"]
    run([*_with_output(flags, folder / "full"), "--save", str(folder / "ckpt"), "--save-interval", "2"])
    return flags, metrics(folder / "full")


def by_rollout(records: list[dict], key: str) -> dict[int, float]:
    return {r["rollout_id"]: r[key] for r in records if key in r}


def test_resume_matches_uninterrupted(uninterrupted, tmp_path):
    flags, full = uninterrupted
    part = tmp_path / "part"
    run([*_with_output(flags, part), "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
         "--num-rollout", "2"])
    run([*_with_output(flags, part), "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
         "--load", str(tmp_path / "ckpt")])
    for key in RESUME_KEYS:
        assert series(metrics(part), key) == series(full, key), key


def test_a_killed_trainer_rank_ends_the_run_in_one_line_and_load_resumes_it_exactly(uninterrupted, tmp_path):
    """SIGKILL of the trainer's process once rollout 1 is checkpointed: exit status 3, one line, no process left;
    `--load` then continues from the last checkpoint and gives the uninterrupted run's numbers."""
    from miles.backends.fsdp_utils.checkpoint import read_latest_iteration
    from miles.testing.processes import run_processes

    flags, full = uninterrupted
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "1"]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        driver = subprocess.Popen([sys.executable, str(REPO / "train_diffusion.py"),
                                   *_with_output(flags, tmp_path / "killed"), *save],
                                  cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while ((read_latest_iteration(str(ckpt)) if ckpt.is_dir() else None) or 0) < 1:
            assert driver.poll() is None, f"the run ended early:\n{stderr_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "no checkpoint of rollout 1 within 300s"
            time.sleep(0.05)  # the pointer file is the only sign of a finished save
        ranks = [pid for pid, command in run_processes(driver.pid).items() if command.startswith("ray::TrainRayActor")]
        assert len(ranks) == 1, run_processes(driver.pid)
        os.kill(ranks[0], signal.SIGKILL)
        assert driver.wait(timeout=120) == 3, stderr_path.read_text()[-4000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    lines = stderr_path.read_text().splitlines()
    assert re.fullmatch(rf"error: trainer rank 0 of 1 died during \w+\(\) \(its process was killed, ran out of memory "
                        rf"or crashed\); the run is stopped; rerun with --load {ckpt} to resume from its last "
                        rf"checkpoint", lines[-1]), lines[-20:]
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-60:])
    assert run_processes(driver.pid) == {}

    resumed = tmp_path / "resumed"
    last_saved = read_latest_iteration(str(ckpt))
    assert last_saved < 3, "the kill came after the last rollout: nothing left to resume"
    run([*_with_output(flags, resumed), *save, "--load", str(ckpt)])
    for key in RESUME_KEYS:
        expected = {rollout: value for rollout, value in by_rollout(full, key).items() if rollout > last_saved}
        assert by_rollout(metrics(resumed), key) == expected, key


def _with_output(flags: list[str], out: Path) -> list[str]:
    index = flags.index("--output-dir")
    return [*flags[:index], "--output-dir", str(out), *flags[index + 2 :]]


def test_colocate_two_trainer_ranks_one_engine(sd3, prompts, tmp_path):
    out = tmp_path / "colocate"
    flags = base_flags(sd3, prompts, out)
    index = flags.index("--actor-num-gpus-per-node")
    flags[index + 1] = "2"
    run([*flags, "--num-rollout", "2", "--colocate", "--num-gpus-per-node", "2", "--rollout-num-gpus-per-engine",
         "2"])
    records = metrics(out)
    assert len(series(records, "train/loss")) == 2


def test_sequence_parallel_engine_run_matches_one_process_engines(sd3, prompts, tmp_path):
    """One 2-process sequence-parallel engine (--sglang-ulysses-degree 2, CFG on) against two one-process engines
    on the same 2 colocated slots: the engine is bitwise equal to one process on CPU, so the rollouts and the
    training they feed are the same."""
    runs = {"sp": ["--rollout-num-gpus-per-engine", "2", "--sglang-ulysses-degree", "2"],
            "single": ["--rollout-num-gpus-per-engine", "1"]}
    records = {}
    for name, engine_flags in runs.items():
        out = tmp_path / name
        flags = base_flags(sd3, prompts, out)
        flags[flags.index("--actor-num-gpus-per-node") + 1] = "2"
        flags[flags.index("--num-gpus-per-node") + 1] = "2"
        flags[flags.index("--diffusion-guidance-scale") + 1] = "3.0"
        run([*flags, "--num-rollout", "2", "--colocate", *engine_flags])
        records[name] = metrics(out)
    engine_log = (tmp_path / "sp" / "engine_logs" / "engine0.log").read_text()
    assert "2-process sequence-parallel engine" in engine_log
    assert len(series(records["sp"], "train/loss")) == 2
    assert series(records["sp"], "rollout/reward_mean") == series(records["single"], "rollout/reward_mean")
    for a, b in zip(series(records["sp"], "train/loss"), series(records["single"], "train/loss"), strict=True):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b))


def test_engine_killed_mid_rollout_is_restarted(sd3, prompts, tmp_path):
    out = tmp_path / "ft"
    run([*base_flags(sd3, prompts, out), "--num-rollout", "3", "--use-fault-tolerance",
         "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "5",
         "--miles-router-health-check-failure-threshold", "1", "--sglang-crash-after-requests", "6"])
    records = metrics(out)
    assert series(records, "rollout/num_samples") == [16.0, 16.0, 16.0]
    assert sum(series(records, "rollout/num_retries")) >= 1


@pytest.mark.parametrize("fault_tolerance", [False, True])
def test_an_engine_that_dies_while_the_trainer_trains(sd3, prompts, tmp_path, fault_tolerance):
    """The engine dies right after answering rollout 0's last request (4 requests of 4 samples), so it is gone
    while the trainer trains and the weight sync finds it: restarted under --use-fault-tolerance, otherwise the
    run ends in one line naming it (exit 3, a part died), not a urllib traceback."""
    out = tmp_path / "died"
    flags = [*base_flags(sd3, prompts, out), "--num-rollout", "2", "--sglang-crash-after-answers", "4",
             "--rollout-health-check-interval", "3600"]  # the weight sync, not the watcher, must find it
    if fault_tolerance:
        result = run([*flags, "--use-fault-tolerance"])
        assert series(metrics(out), "rollout/num_samples") == [16.0, 16.0]
        assert "died before or during the weight sync; restarting it" in result.stderr
        return
    result = subprocess.run([sys.executable, str(REPO / "train_diffusion.py"), *flags], capture_output=True,
                            text=True, cwd=REPO, env=run_env(), timeout=600)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 3, result.stderr[-3000:]
    assert last.startswith("error: rollout engine 0 (http://127.0.0.1:") and "engine0.log" in last, last
    assert "died before or during the weight sync" in last and last.endswith(
        "--use-fault-tolerance restarts dead engines"), last


def test_hybrid_sharded_trainer_with_its_own_engine_matches_one_rank(sd3, prompts, tmp_path):
    """Issue 9's topology scaled down to CPU: 2 trainer ranks with --dp-replicate-size 2 (HSDP), the engine on
    a slot of its own (no --colocate), against one trainer rank on the same data."""
    one, hsdp = tmp_path / "one", tmp_path / "hsdp"
    run([*base_flags(sd3, prompts, one), "--num-rollout", "3"])
    flags = base_flags(sd3, prompts, hsdp)
    flags[flags.index("--actor-num-gpus-per-node") + 1] = "2"
    flags[flags.index("--num-gpus-per-node") + 1] = "3"
    run([*flags, "--num-rollout", "3", "--rollout-num-gpus", "1", "--dp-replicate-size", "2"])
    single, sharded = metrics(one), metrics(hsdp)
    # Same initial weights and seeds: the first rollout is identical; after that the two-rank gradient reduction
    # adds in another order, so the weights agree to fp32 rounding, not bitwise.
    assert series(sharded, "rollout/reward_mean")[0] == series(single, "rollout/reward_mean")[0]
    for a, b in zip(series(sharded, "rollout/reward_mean"), series(single, "rollout/reward_mean")):
        assert abs(a - b) < 1e-5
    for a, b in zip(series(sharded, "train/grad_norm"), series(single, "train/grad_norm")):
        assert abs(a - b) < 1e-2 * b


def test_rollout_gradient_steps_as_the_replay_does(sd3, prompts, tmp_path):
    """--diffusion-rollout-gradient (LoRA): the engine takes each sample's gradient during the rollout and the
    trainer replays nothing, yet every rollout's gradient is the replayed clipped loss's (fp32 rounding apart);
    the gradient reaches the trainer through its shared buffer. With the trainer on the host (the default for
    one colocated rank) it sees no GPU, gradient and factors cross by shared-memory files and the colocated run
    takes no turns; `--rollout-gradient-trainer device` keeps it beside the engine (on the CPU the two differ
    only in those turns and the optimizer's fused kernel). On the host the engine takes the optimizer step on its
    own adapter too (`--rollout-gradient-engine-step auto`) and no weight push follows; the trainer checked the
    engine's checksum of the same step, and `off` (the trainer's fused AdamW and a push) trains alike. The host
    run sends each next rollout while the trainer trains (`--rollout-prefetch`, on there by default): the same
    run without it is the same bit for bit."""
    replay, fused, host, pushed = (tmp_path / name for name in ("replay", "fused", "host", "pushed"))
    lora = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8", "--colocate", "--num-rollout", "3"]
    run([*base_flags(sd3, prompts, replay), *lora, "--lora-ipc-weight-sync"])
    result = run([*base_flags(sd3, prompts, fused), *lora, "--diffusion-rollout-gradient",
                  "--rollout-gradient-trainer", "device"])
    assert "warning" not in result.stderr.lower()
    result = run([*base_flags(sd3, prompts, host), *lora, "--diffusion-rollout-gradient"])
    assert "warning" not in result.stderr.lower() and "1 trainer rank(s) on the host" in result.stderr
    run([*base_flags(sd3, prompts, pushed), *lora, "--diffusion-rollout-gradient",
         "--rollout-gradient-engine-step", "off"])
    a, b, c, e = metrics(replay), metrics(fused), metrics(host), metrics(pushed)
    first = [series(records, "rollout/reward_mean")[0] for records in (a, b, c, e)]
    assert first[0] == first[1] == first[2] == first[3]
    for x, y, z, w in zip(*(series(r, "rollout/reward_mean") for r in (a, b, c, e)), strict=True):
        assert abs(x - y) < 1e-5 and abs(x - z) < 1e-5 and abs(x - w) < 1e-5
    norms_replay, norms_fused, norms_host, norms_pushed = (series(r, "train/grad_norm") for r in (a, b, c, e))
    assert len(norms_fused) == 3 and all(n > 0 for n in norms_fused)
    for x, y, z, w in zip(norms_replay, norms_fused, norms_host, norms_pushed, strict=True):
        # the fused AdamW and the mirrored one round otherwise
        assert abs(x - y) < 1e-3 * x and abs(y - z) < 1e-3 * y and abs(z - w) < 1e-3 * z
    for records in (b, c, e):
        assert series(records, "train/rollout_train_log_prob_abs_diff") == [0.0] * 3
        # the colocated engine added its sum into the trainer's shared buffer (gradient_fetch.py), not in a body
        assert series(records, "perf/policy_gradient_engines_by_reference") == [1.0] * 3
        # the fetch's seconds split: the engine's wait for its worker thread and its sum, inside the fetch
        for fetch, wait, total in zip(*(series(records, f"perf/policy_gradient_{key}") for key in (
                "fetch_s", "engine_wait_s", "engine_sum_s")), strict=True):
            assert total > 0 and wait >= 0 and wait + total < fetch
    for records in (b, e):
        assert series(records, "weight_sync/ipc_engines") == [1.0] * 3
    # the engine stepped each time (its moments zero at the first step, as the trainer's) and nothing was pushed
    assert series(c, "train/engine_stepped") == series(c, "weight_sync/engine_stepped") == [1.0] * 3
    assert not any("weight_sync/ipc_engines" in r for r in c)
    assert all(value > 0 for value in series(c, "perf/policy_gradient_engine_step_s"))
    assert any("perf/release_time" in r for r in b)  # a CPU run keeps the turns
    assert not any(key in r for r in c for key in ("perf/release_time", "perf/onload_time", "perf/offload_time"))

    # rollouts 1 and 2 were encoded on the engine while the trainer trained and waited there for its weights
    waits = series(c, "rollout/engine_weights_wait_seconds")
    assert waits[0] == 0.0 and all(wait > 0 for wait in waits[1:])
    assert series(b, "rollout/engine_weights_wait_seconds") == [0.0] * 3  # colocated on the device: no prefetch
    # ... and stopped after its first rollout and resumed: the resumed engine has no moments, so the trainer steps
    # alone, pushes the weights and sends its moments, and the engine takes the next step again
    unfetched, checkpoints = tmp_path / "host_no_prefetch", tmp_path / "ckpt"
    no_prefetch = [*base_flags(sd3, prompts, unfetched), *lora, "--diffusion-rollout-gradient", "--rollout-prefetch",
                   "off", "--save", str(checkpoints), "--save-interval", "1"]
    run([*no_prefetch, "--num-rollout", "1"])
    run([*no_prefetch, "--load", str(checkpoints)])
    d = metrics(unfetched)
    assert series(d, "rollout/engine_weights_wait_seconds") == [0.0] * 3
    assert series(d, "train/engine_stepped") == [1.0, 0.0, 1.0]
    for key in ("rollout/reward_mean", "train/grad_norm", "train/loss"):
        assert series(c, key) == series(d, key), key


@pytest.mark.gpu
def test_on_a_gpu_a_trainer_on_the_host_leaves_the_device_to_the_engine(sd3, prompts, tmp_path):
    """`--rollout-gradient-trainer host` with the engine on a GPU: the run trains, the engine reports its GPU
    memory and the trainer none (its process sees no GPU), the gradient crosses by shared memory and the engine
    steps its own adapter."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("an engine on a GPU")
    out = tmp_path / "host"
    run([*base_flags(sd3, prompts, out), "--use-lora", "--lora-rank", "4", "--lora-alpha", "8", "--colocate",
         "--num-rollout", "2", "--diffusion-rollout-gradient", "--rollout-gradient-trainer", "host"])
    records = metrics(out)
    assert len(series(records, "train/grad_norm")) == 2 and all(n > 0 for n in series(records, "train/grad_norm"))
    assert any("perf/engine_peak_reserved_gib" in r for r in records)
    assert not any(key.startswith("perf/train_peak") for r in records for key in r)
    assert series(records, "perf/policy_gradient_engines_by_reference") == [1.0] * 2
    # the engine took each optimizer step on the GPU with the bits the trainer's took on the host (it checked)
    assert series(records, "train/engine_stepped") == [1.0] * 2

def test_overlapped_rollout_learns_one_step_off_policy(sd3, prompts, tmp_path):
    """--overlap-rollout (engines of their own): rollout k+1 is generated while rollout k trains, so every
    rollout after the first is one weight version old, the ratio is taken against the engine's log-probs, and the
    reward still rises."""
    out = tmp_path / "overlap"
    flags = [f for f in base_flags(sd3, prompts, out)]
    flags[flags.index("--lr") + 1] = "1e-2"
    flags[flags.index("--diffusion-clip-range") + 1] = "0.2"
    run([*flags, "--num-rollout", "16", "--seed", "1", "--rollout-seed", "1", "--overlap-rollout"])
    records = metrics(out)
    assert series(records, "rollout/staleness") == [0.0] + [1.0] * 15
    assert all("perf/overlap_wait_time" in r for r in records)
    rewards = series(records, "rollout/reward_mean")
    spread = series(records, "rollout/reward_std")[0]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + max(0.01, 3 * spread), f"reward did not rise: {rewards}"
