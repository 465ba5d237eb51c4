"""Wall-clock time to a target held-out score on the `shapes` task (docs/shapes.md), one table.

    python bench/bench_learning.py --device cpu                        # the shipped 32 px model: a smoke test
    python bench/bench_learning.py --device cuda --methods nft,flow_grpo_window,flow_grpo,plain --prompts 16 \
        --group 8 --micro-batch-size 32 --lr 5e-5 --nft-lr 1e-4 --noise-level 1.0 --target-gain 0.15 \
        --max-rollouts 60 --eval-interval 2 --eval-samples 4 --max-seconds 100 \
        --window 2 --window-range 0,8                                           # bench/RESULTS.md's GPU table
    python bench/bench_learning.py --device cuda --size large --checkpoint DIR ...  # 128 px, pretrained if missing
    timeout 560 python bench/bench_learning.py --device cuda --size large --checkpoint /tmp/shapes-large \
        --pretrain-only; python bench/checkpoint_parts.py pack /tmp/shapes-large $OUT --dtype fp16
        # the 128 px base alone (≈ 520 s on an H100): a call of its own; the device forgets it between calls, so
        # it comes back in parts, is unpacked here into .shapes-large and carried to the methods' call
    python bench/bench_learning.py --device cuda --size large --checkpoint .shapes-large --methods nft,flow_grpo,plain \
        --prompts 16 --group 8 --micro-batch-size 32 --lr 5e-5 --nft-lr 1e-4 --noise-level 1.0 --target-gain 0.15 \
        --max-rollouts 60 --eval-interval 2 --eval-samples 4 --max-seconds 140 --keep-logs $OUT/logs
        # the 128 px table (bench/RESULTS.md, twenty-sixth session), with the framework's logs
    python bench/bench_learning.py --device cuda --diagnose-start     # the base's score by eval path, then exit

Methods, each from the same pretrained base with the same batch (P prompts × G samples per rollout):
- `flow_grpo`: `train_diffusion.py` with every step an SDE step (on CUDA the documented fast command:
  `--fsdp-torch-compile --sglang-enable-torch-compile`, exactly on-policy);
- `flow_grpo_window`: the same with `--window` SDE steps per prompt group inside `--window-range` (the
  `sde_window` strategy; the defaults, one step at step 0 or 1, are the CI learning test's Flow-GRPO);
- `nft`: DiffusionNFT (ODE rollouts with the EMA, `--loss-type nft`);
- `plain`: a single-process Flow-GRPO loop over the same pipeline (the diffusers modules, the math of
  `miles.diffusion.sde` / `losses`, AdamW; on CUDA bf16 and each transformer block `.compile()`d, as
  diffusers' regional-compilation docs show), evaluated with `miles.tasks.shapes.evaluate` at the same seeds as
  the framework's eval.

Each run evaluates the held-out set every `--eval-interval` rollouts; a method's time to target is the
wall-clock from its launch (start-up included) to the end of the first eval at or above `--target`, and its
training time the same without the evals. A run stops at the first eval at or above the target (the bench sends
`train_diffusion.py` SIGTERM, which it ends cleanly on), after `--max-rollouts`, or after `--max-seconds`; one
that never reaches the target shows its best score. Rows are printed as they finish and kept in `--rows-jsonl`
when given.

A second table says where each method's seconds went: its start-up (the framework's `perf/startup_time`; the plain
loop's model load), its first rollout (compiling), then the means over the rollouts after the first of the
rollout, the train step, the rest of an iteration (the framework's weight sync, release and resume) and one eval.
`--keep-logs DIR` keeps each framework run's console and metrics there (`<method>-console.log`,
`<method>-metrics.jsonl`) for the phases inside those.

`--diagnose-start` scores the base, before any training, along each path a start can be measured on: the
one-process `miles.tasks.shapes.evaluate` (the plain loop's eval) and `train_diffusion.py`'s eval (`--debug-rollout-only`,
its eval before the first rollout), each in fp32 and bf16 with the noise drawn on the CPU and on the device, and on
a GPU the framework once more in bf16 without the exactness group (`--rollout-patch-group none`: its CUDA kernels
are what the CPU cannot run). On one H100 (bench/RESULTS.md) each path read the same score as the others on each
switch, and only where the noise is drawn moved it (0.34–0.36 on CPU noise, 0.44–0.46 on CUDA noise, 25 prompts
× 2): the plain loop's eval therefore draws its noise on the device, as the framework's does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from miles.tasks.shapes import PRETRAINED_SD3  # noqa: E402
from miles.tasks.shapes.pretrain import SIZES as PRETRAIN_SIZES  # noqa: E402

METHODS = ("flow_grpo", "flow_grpo_window", "nft", "plain")
CORRECT = "eval/heldout/reward/shapes_correct_mean"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=("small", "large"), default="small",
                        help="small: the shipped 32 px base; large: 128 px through an 8x VAE, 6 blocks of width 128 "
                             "(pretrained into --checkpoint when missing)")
    parser.add_argument("--checkpoint", default=None, help="the base model (default: the shipped small one)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--target", type=float, default=0.3, help="held-out shapes_correct to reach")
    parser.add_argument("--target-gain", type=float, default=None,
                        help="instead of --target: this much above the method's own first eval (the base)")
    parser.add_argument("--max-rollouts", type=int, default=12)
    parser.add_argument("--eval-interval", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps")
    parser.add_argument("--window", type=int, default=1, help="SDE steps of flow_grpo_window")
    parser.add_argument("--window-range", default="0,2", help="lo,hi: where flow_grpo_window's steps may start")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--nft-lr", type=float, default=3e-4)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--clip-range", type=float, default=1e-3)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=None, help="stop a method after this much wall time")
    parser.add_argument("--rows-jsonl", default=None)
    parser.add_argument("--keep-logs", default=None, help="copy each framework run's console and metrics here")
    parser.add_argument("--pretrain-only", action="store_true",
                        help="pretrain the --size large base into --checkpoint (unless there) and exit")
    parser.add_argument("--diagnose-start", action="store_true",
                        help="score the base along every eval path (dtype, noise device, one process or the "
                        "framework) and exit")
    return parser.parse_args()


def image_size(opts) -> int:
    return PRETRAIN_SIZES["wide" if opts.size == "small" else "large"].image_size


# The 128 px base: the shipped base's recipe (scripts/shapes_gpu_pretrain.sh) at the `large` size.
LARGE_PRETRAIN = ["--size", "large", "--images-per-scene", "32", "--render-workers", "8", "--vae-steps", "2000",
                  "--vae-batch-size", "64", "--vae-lr", "5e-4", "--vae-grad-clip", "1.0", "--dit-steps", "1000000",
                  "--batch-size", "256", "--dit-lr", "7e-4", "--lr-schedule", "cosine", "--warmup", "0.03",
                  "--max-seconds", "360", "--threads", "4"]


def ensure_checkpoint(opts) -> str:
    if opts.checkpoint is None and opts.size == "small":
        return PRETRAINED_SD3
    # absolute: the same folder for every process of a run, whatever directory it starts in
    path = os.path.abspath(opts.checkpoint or os.path.join(tempfile.gettempdir(), "shapes-large"))
    if not os.path.exists(os.path.join(path, "model_index.json")):
        print(f"pretraining the {opts.size} model into {path}", flush=True)
        command = [sys.executable, "-m", "miles.tasks.shapes.pretrain", "--out", path, *LARGE_PRETRAIN,
                   "--device", opts.device]
        # a `timeout` signals the whole process group: the pretraining saves what its denoiser learned on SIGTERM
        # (pretrain.py), so this process waits for that save instead of ending before it (a handler, not SIG_IGN,
        # which the child would inherit)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            subprocess.run(command, check=True, cwd=REPO_ROOT)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return path


def framework_flags(opts, method: str, checkpoint: str, data: str, out: str) -> list[str]:
    size = str(image_size(opts))
    flags = [
        "--hf-checkpoint", checkpoint, "--diffusion-model-family", "sd3", "--prompt-data", f"{data}/train.jsonl",
        "--rm-type", "shapes", "--reward-key", "shapes", "--eval-reward-key", "shapes_correct",
        "--eval-prompt-data", "heldout", f"{data}/heldout.jsonl", "--eval-interval", str(opts.eval_interval),
        "--n-samples-per-eval-prompt", str(opts.eval_samples),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--colocate",
        "--rollout-batch-size", str(opts.prompts), "--n-samples-per-prompt", str(opts.group),
        "--global-batch-size", str(opts.prompts * opts.group), "--rollout-microgroup-size", str(opts.group),
        "--micro-batch-size", str(opts.micro_batch_size), "--num-rollout", str(opts.max_rollouts),
        "--diffusion-num-steps", str(opts.steps), "--diffusion-height", size, "--diffusion-width", size,
        "--diffusion-guidance-scale", "1.0", "--diffusion-generator-device", opts.device,
        "--seed", "1", "--rollout-seed", "42", "--output-dir", out,
    ]
    if opts.device == "cpu":
        flags += ["--diffusion-forward-dtype", "fp32"]
    if method in ("flow_grpo", "flow_grpo_window"):
        flags += ["--loss-type", "policy_loss", "--diffusion-noise-level", str(opts.noise_level),
                  "--diffusion-clip-range", str(opts.clip_range), "--lr", str(opts.lr)]
        if opts.device == "cuda":
            flags += ["--fsdp-torch-compile", "--sglang-enable-torch-compile"]
    if method == "flow_grpo_window":
        flags += ["--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window",
                  "--diffusion-num-sde-steps", str(opts.window), "--diffusion-sde-window-range", opts.window_range]
    if method == "nft":
        flags += ["--loss-type", "nft", "--diffusion-sde-type", "ode", "--diffusion-noise-level", "0", "--use-ema",
                  "--ema-rollout-policy", "ema", "--globalize-reward-std", "--lr", str(opts.nft_lr)]
    return flags


def run_framework(opts, method: str, checkpoint: str, data: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-learning-{method}-")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if opts.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    started = time.time()
    log = open(os.path.join(out, "console.log"), "w")
    process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "train_diffusion.py"),
                                *framework_flags(opts, method, checkpoint, data, out)],
                               cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics, evals, stopped = os.path.join(out, "metrics.jsonl"), [], False
    while process.poll() is None:
        time.sleep(1.0)
        evals = read_evals(metrics, started)
        over_time = opts.max_seconds is not None and time.time() - started > opts.max_seconds
        if not stopped and ((evals and evals[-1][1] >= target_of(opts, evals)) or over_time):
            process.send_signal(signal.SIGTERM)  # the run ends cleanly (miles/ray/shutdown.py)
            stopped = True
    log.close()
    evals = read_evals(metrics, started)
    if opts.keep_logs:
        os.makedirs(opts.keep_logs, exist_ok=True)
        for name in ("console.log", "metrics.jsonl"):
            if os.path.exists(os.path.join(out, name)):
                shutil.copyfile(os.path.join(out, name), os.path.join(opts.keep_logs, f"{method}-{name}"))
    if process.returncode != 0 and not (stopped and evals):
        tail = open(os.path.join(out, "console.log")).read()[-4000:]
        raise SystemExit(f"{method}: train_diffusion.py failed ({process.returncode}):\n{tail}")
    return summarise(opts, method, evals, framework_seconds(metrics))


def framework_seconds(metrics: str) -> dict:
    """The run's phases from its metrics JSONL, in the shape `seconds_summary` makes of the plain loop's."""
    records = [json.loads(line) for line in open(metrics) if line.strip().endswith("}")] \
        if os.path.exists(metrics) else []
    iterations, evals = [], []
    for record in records:
        perf = {key[len("perf/"):-len("_time")]: value for key, value in record.items()
                if key.startswith("perf/") and key.endswith("_time") and "startup" not in key}
        if "iteration" not in perf:
            continue  # the record of the eval after the last iteration
        rollout, train, evaluate = perf.get("rollout", 0.0), perf.get("train", 0.0), perf.get("eval", 0.0)
        iterations.append({"rollout": rollout, "train": train,
                           "other": perf["iteration"] - rollout - train - evaluate})
        evals += [evaluate] if evaluate else []
    startup = records[0].get("perf/startup_time", 0.0) if records else 0.0
    return seconds_summary(startup, iterations, evals)


def seconds_summary(startup: float, iterations: list[dict], evals: list[float]) -> dict:
    """iterations: each one's rollout, train and other seconds, its eval left out; evals: each eval's seconds.
    The first iteration compiles, so the steady means are over the ones after it."""
    def mean(values):
        return sum(values) / len(values) if values else float("nan")

    first, steady = (iterations or [{}])[0], iterations[1:]
    return {"startup": startup, "first_iteration": sum(first.values()),
            **{part: mean([p[part] for p in steady]) for part in ("rollout", "train", "other")},
            "eval": mean(evals)}


def read_evals(metrics: str, started: float) -> list[tuple[int, float, float, float]]:
    if not os.path.exists(metrics):
        return []
    evals, eval_seconds = [], 0.0
    for line in open(metrics):
        if not line.strip().endswith("}"):
            continue  # a line still being written
        record = json.loads(line)
        eval_seconds += record.get("perf/eval_time", 0.0)
        if CORRECT in record:
            evals.append((record["rollout_id"], record[CORRECT], record["time"] - started, eval_seconds))
    return evals


def target_of(opts, evals) -> float:
    return opts.target if opts.target_gain is None else evals[0][1] + opts.target_gain - 1e-9


def summarise(opts, method: str, evals: list[tuple[int, float, float, float]], seconds: dict) -> dict:
    """evals: (rollout, score, seconds since launch at the end of that eval, eval seconds so far); seconds:
    `seconds_summary`'s phases."""
    row = {"method": method, "start": evals[0][1], "best": max(e[1] for e in evals), "target": target_of(opts, evals),
           "rollouts": None, "wall_s": None, "train_s": None,
           # the held-out curve, so a run stopped by --max-seconds still shows how far it got
           "curve": [(rollout, round(score, 3), round(wall, 1)) for rollout, score, wall, _ in evals],
           "seconds": {part: round(value, 3) for part, value in seconds.items()}}
    for rollout, score, wall, eval_seconds in evals:
        if score >= target_of(opts, evals):
            row.update(rollouts=rollout, wall_s=wall, train_s=wall - eval_seconds)
            break
    print(json.dumps(row), flush=True)
    return row


def run_plain(opts, checkpoint: str, data: str) -> dict:
    """Flow-GRPO in this process: every step an SDE step, the dense reward, per-group advantages, one AdamW step
    per rollout on the clipped loss (the framework's defaults: grad clip 1, advantage clip 5)."""
    from miles.diffusion.losses import policy_loss
    from miles.models.base import GenerationShape
    from miles.diffusion.sde import build_sde_backend
    from miles.tasks.shapes.evaluate import heldout_score, load_pipeline, read_scenes
    from miles.tasks.shapes.score import score_scene

    started = time.time()
    device, size = opts.device, image_size(opts)
    family, pipe = load_pipeline(checkpoint)
    pipe.to(device)
    transformer = pipe.transformer
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    if device == "cuda":  # diffusers' regional compilation: each repeated block on its own
        torch._dynamo.config.recompile_limit = 64  # sampling, training and eval shapes each compile once
        for block in transformer.transformer_blocks:
            block.compile()
    latent_shape = family.latent_sample_shape(pipe, GenerationShape(size, size))
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=opts.lr)
    sde = build_sde_backend("sde", opts.noise_level, False)
    pipe.scheduler.set_timesteps(opts.steps, device=device)
    sigmas = pipe.scheduler.sigmas.float().to(device)
    train_scenes, heldout = read_scenes(f"{data}/train.jsonl"), read_scenes(f"{data}/heldout.jsonl")
    order, walk = random.Random(42), []
    batch = opts.prompts * opts.group
    evals, eval_seconds = [], 0.0
    iterations, eval_times, startup = [], [], None  # seconds_summary's phases

    def finish() -> dict:
        return summarise(opts, "plain", evals, seconds_summary(startup or 0.0, iterations, eval_times))

    def velocity(x, sigma, embeds, pooled):
        with autocast:
            return transformer(hidden_states=x, timestep=(1000 * sigma).expand(len(x)), encoder_hidden_states=embeds,
                               pooled_projections=pooled, return_dict=False)[0].float()

    def evaluate(rollout: int) -> None:
        nonlocal eval_seconds, startup
        begin = time.time()
        startup = startup if startup is not None else begin - started
        # the noise drawn where the framework's eval draws it (--diffusion-generator-device): on one base both
        # evals then score the same images (`--diagnose-start`: CPU and CUDA noise read 0.36 and 0.44 there)
        score = heldout_score(family, pipe, heldout, num_steps=opts.steps, samples_per_prompt=opts.eval_samples,
                              size=size, generator_device=device).correct
        eval_seconds += time.time() - begin
        evals.append((rollout, score, time.time() - started, eval_seconds))
        eval_times.append(time.time() - begin)

    for rollout in range(opts.max_rollouts):
        if rollout % opts.eval_interval == 0:
            evaluate(rollout)
            over_time = opts.max_seconds is not None and time.time() - started > opts.max_seconds
            if evals[-1][1] >= target_of(opts, evals) or over_time:
                return finish()
        iterations.append({"rollout": 0.0, "train": 0.0, "other": 0.0})
        begin = time.time()
        groups = []
        for _ in range(opts.prompts):
            walk = walk or order.sample(train_scenes, len(train_scenes))
            groups.append(walk.pop())
        prompts = [prompt for prompt, _ in groups for _ in range(opts.group)]
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False,
                                                      max_sequence_length=pipe.tokenizer_3.model_max_length,
                                                      device=device)
            generators = [torch.Generator(device).manual_seed(1000 * rollout + b) for b in range(batch)]
            x = torch.stack([torch.randn(latent_shape, generator=g, device=device) for g in generators])
            trajectory, log_probs = [x], []
            for k in range(opts.steps):
                out = sde.sample(x, velocity(x, sigmas[k], embeds, pooled), sigmas[k].expand(batch),
                                 sigmas[k + 1].expand(batch), sigmas[1].expand(batch), generators)
                x = out.next_latents
                trajectory.append(x)
                log_probs.append(out.log_prob)
            images = family.decode(pipe, x, None)[:, 0].cpu().numpy()
        rewards = torch.tensor([score_scene(groups[b // opts.group][1], images[b]).dense for b in range(batch)],
                               dtype=torch.float64).view(opts.prompts, opts.group)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
        advantages = advantages.float().to(device)
        iterations[-1]["rollout"] = time.time() - begin
        begin = time.time()
        optimizer.zero_grad(set_to_none=True)
        for k in range(opts.steps):
            for start in range(0, batch, opts.micro_batch_size):
                rows = slice(start, start + opts.micro_batch_size)
                xs = trajectory[k][rows]
                v = velocity(xs, sigmas[k], embeds[rows], pooled[rows])
                new = sde.log_prob(xs, v, trajectory[k + 1][rows], sigmas[k].expand(len(xs)),
                                   sigmas[k + 1].expand(len(xs)), sigmas[1].expand(len(xs))).log_prob
                loss, _ = policy_loss(new, log_probs[k][rows], advantages[rows], opts.clip_range, 5.0)
                (loss.sum() / (batch * opts.steps)).backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()  # the step's kernels counted in its own phase
        iterations[-1]["train"] = time.time() - begin
    evaluate(opts.max_rollouts)
    return finish()


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """`flags` with `name`'s value replaced, or the flag appended."""
    if name in flags:
        flags = list(flags)
        flags[flags.index(name) + 1] = value
        return flags
    return [*flags, name, value]


def diagnose_start(opts, checkpoint: str, data: str) -> None:
    """The base's held-out score along each eval path, one table."""
    from miles.models.common import parse_dtype
    from miles.tasks.shapes.evaluate import heldout_score, load_pipeline, read_scenes

    heldout, size = read_scenes(f"{data}/heldout.jsonl"), image_size(opts)
    noise_devices = list(dict.fromkeys(["cpu", opts.device]))
    rows = []
    for dtype in ("fp32", "bf16"):
        family, pipe = load_pipeline(checkpoint, parse_dtype(dtype))
        pipe.to(opts.device)
        for noise in noise_devices:
            score = heldout_score(family, pipe, heldout, num_steps=opts.steps, samples_per_prompt=opts.eval_samples,
                                  size=size, dtype=parse_dtype(dtype), generator_device=noise)
            rows.append(("miles.tasks.shapes.evaluate", dtype, noise, score.correct, score.dense))
            print(rows[-1], flush=True)
        del pipe
    # the framework along the same grid, then bf16 on the device's noise without the exactness group (its CUDA
    # kernels are the one part of that path the CPU cannot run)
    variants = [(dtype, noise, "batch_invariant") for dtype in ("fp32", "bf16") for noise in noise_devices]
    if opts.device != "cpu":
        variants.append(("bf16", opts.device, "none"))
    for dtype, noise, group in variants:
        out = tempfile.mkdtemp(prefix=f"bench-learning-start-{dtype}-{noise}-{group}-")
        flags = framework_flags(opts, "nft", checkpoint, data, out)
        flags = with_flag(with_flag(with_flag(with_flag(flags, "--num-rollout", "1"), "--diffusion-forward-dtype",
                                              dtype), "--diffusion-generator-device", noise),
                          "--rollout-patch-group", group) + ["--debug-rollout-only"]  # eval, no training
        env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "train_diffusion.py"), *flags],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] \
            if done.returncode == 0 else []
        scores = [r for r in records if CORRECT in r]
        if not scores:
            raise SystemExit(f"train_diffusion.py --debug-rollout-only failed ({done.returncode}):\n"
                             f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        rows.append((f"train_diffusion.py (patch group {group})", dtype, noise, scores[0][CORRECT],
                     scores[0].get(CORRECT.replace("shapes_correct", "shapes"), float("nan"))))
        print(rows[-1], flush=True)
    print(f"\nthe base's held-out score by eval path ({opts.device}, {len(heldout)} prompts x {opts.eval_samples} "
          f"samples, {opts.steps} steps)")
    print("| path | forward dtype | noise drawn on | 0/1 correct | dense |")
    print("|---|---|---|---|---|")
    for path, dtype, noise, correct, dense in rows:
        print(f"| {path} | {dtype} | {noise} | {correct:.3f} | {dense:.3f} |")


def main() -> None:
    opts = parse_args()
    from miles.tasks.shapes.data import write_prompt_files

    checkpoint = ensure_checkpoint(opts)
    if opts.pretrain_only:
        print(f"the base is in {checkpoint}")
        return
    data = tempfile.mkdtemp(prefix="bench-learning-data-")
    write_prompt_files(data)
    if opts.diagnose_start:
        return diagnose_start(opts, checkpoint, data)
    rows = []
    for method in [m.strip() for m in opts.methods.split(",") if m.strip()]:
        if method not in METHODS:
            raise SystemExit(f"--methods: unknown method {method!r}; known: {', '.join(METHODS)}")
        row = run_plain(opts, checkpoint, data) if method == "plain" else run_framework(opts, method, checkpoint, data)
        rows.append(row)
        if opts.rows_jsonl:
            with open(opts.rows_jsonl, "a") as f:
                f.write(json.dumps({**row, "size": opts.size, "device": opts.device}) + "\n")
    goal = f"{opts.target}" if opts.target_gain is None else f"its first eval + {opts.target_gain}"
    print(f"\ntime to held-out shapes_correct >= {goal} ({opts.size}, {opts.device}, "
          f"{opts.prompts}x{opts.group} samples per rollout, {opts.steps} steps)")
    print("| method | start | target | best | rollouts to target | wall s (with start-up) | train s (no eval) "
          "| last eval (rollout, s) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        reached = row["rollouts"] is not None
        cells = [f"{row['rollouts']}" if reached else "not reached",
                 f"{row['wall_s']:.1f}" if reached else "–", f"{row['train_s']:.1f}" if reached else "–",
                 f"{row['curve'][-1][0]}, {row['curve'][-1][2]:.1f}"]
        print(f"| {row['method']} | {row['start']:.3f} | {row['target']:.3f} | {row['best']:.3f} | "
              + " | ".join(cells) + " |")
    print("\nwhere the seconds went: start-up, the first iteration (compiling), then means over the iterations "
          "after it (other: weight sync, release, resume) and over the evals")
    print("| method | start-up s | first iteration s | rollout s | train s | other s | s / iteration | eval s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        seconds = row["seconds"]
        steady = seconds["rollout"] + seconds["train"] + seconds["other"]
        print(f"| {row['method']} | " + " | ".join(f"{value:.2f}" for value in (
            seconds["startup"], seconds["first_iteration"], seconds["rollout"], seconds["train"], seconds["other"],
            steady, seconds["eval"])) + " |")


if __name__ == "__main__":
    main()
