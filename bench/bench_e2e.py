"""End to end: one Flow-GRPO iteration, the plain in-process loop against `train_diffusion.py`, in one invocation.

    python bench/bench_e2e.py --device cuda --real-size                 # SD3.5-Medium, random weights, one GPU
    python bench/bench_e2e.py --device cpu                              # tiny SD3, a smoke test of the script

Both sides run the same iteration: P prompts × M samples, n steps of the SDE sampler with CFG (one doubled
batch), VAE decode, the built-in `brightness` reward, group-normalised advantages, then every trained step of
every sample as a train pair (Flow-GRPO clipped loss), micro-batches of `--micro-batch-size`, one optimizer step.

- plain: what a competent user writes in one process: the diffusers pipeline in bf16, the prompts batched, CFG
  as one doubled batch, LoRA through PEFT (or every parameter in fp32 with bf16 autocast), fused AdamW; the SDE
  step and log-prob formulas of `miles.diffusion.sde` (bench/plain_loop.py). In each `--plain-modes` mode:
  `compiled` (the reference every ratio is against: `.compile()` on each transformer block and on the VAE
  decoder, as diffusers' regional-compilation docs show), `eager`, and `fused` (LoRA only, an experiment, not a
  reference: each sample's gradient taken during the rollout into a per-sample copy of the adapter, so nothing is
  replayed; its MFU is against its own, smaller floor).
- miles: `train_diffusion.py` itself, as docs/quickstart.md shows it (`--colocate`, real Ray, an engine
  process, HTTP, weight sync), in each requested `--miles-modes` (`eager`; `compiled` adds
  `--fsdp-torch-compile --sglang-enable-torch-compile`, the documented GPU command, exact through the default
  `batch_invariant` group; `compiled-free` turns the group off and recomputes the old log-probs, the fast command
  before it was exact). A `-rollout-gradient` suffix (`compiled-rollout-gradient`, `eager-rollout-gradient`)
  adds `--diffusion-rollout-gradient` (LoRA: the engines take each sample's gradient during the rollout, nothing
  is replayed); `compiled-free-rollout-gradient` then only turns the group off, which exactness does not need
  when no trainer forward has to reproduce the engine's.

The floor (`--skip-floor` leaves it out): the iteration's FLOPs (one DiT forward counted by torch's FLOP counter)
at the dense matmul peak measured in the same call; each row's MFU is the floor over its seconds. A compiled mode is launched twice (`--compiled-launches`): the first launch fills the compile caches,
  the second is the one measured (time to the first iteration on a second launch).

Growth: `--sweep-images 16,32,64,128` and `--sweep-trained-steps 2,0` measure each point the same way (one table
each) and end with one growth table per setup (seconds per iteration, rollout images/s, train pairs/s).
`--rows-jsonl FILE` appends every row the moment it is measured, so a long sweep cut short keeps what it measured.
`--miles-modes ''` measures the plain loop alone (at each sweep point too). A mode may carry flags of its own,
`MODE:--FLAG=VALUE` (`compiled-rollout-gradient:--sglang-attention-backend=_native_cudnn`): a variant measured
beside its mode in the same call.

Prints one table per setup: steady-state seconds per iteration (mean over the iterations after the first), the
phase split (from the run's `perf/*_time` metrics), unaccounted time, peak GPU memory (device-wide, polled),
time to the first iteration and the ratio to the plain loop.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import plain_loop  # noqa: E402  (bench/plain_loop.py: the plain loops)
from miles.config.flags import all_flags  # noqa: E402

PHASES = ("rollout", "release", "onload", "train", "save", "resume", "weight_sync", "offload", "eval", "log")
LORA_TARGETS = None  # the family's defaults (miles.models.sd3.SD3_LORA_TARGETS)
# the perf/ metrics printed per iteration: the phases' times and the trainer's allocator counts (miles/utils/device_memory.py)
PRINTED = ("_time", "_cuda_mallocs", "_alloc_retries", "_parked_gib", "_compile_s", "_fetch_s", "_engine_wait_s",
           "_engine_sum_s", "_engine_step_s")
ROLLOUT_GRADIENT = "-rollout-gradient"  # a --miles-modes suffix: the mode plus --diffusion-rollout-gradient


# ---------------------------------------------------------------------------------------------------------
# peak device memory, polled from this process (covers every process on the GPU but this one)
# ---------------------------------------------------------------------------------------------------------
class PeakMemory:
    """The device's peak use while a launched run lives, less what this process holds when it starts (its own
    CUDA context and cache: the bench's, not the run's)."""

    def __init__(self, device: str):
        self.enabled = device == "cuda"
        self.peak = 0
        self.own = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)

    def __enter__(self):
        if self.enabled:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            self.own = total - free
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()

    @property
    def gib(self) -> float | None:
        return (self.peak - self.own) / (1 << 30) if self.enabled else None


# ---------------------------------------------------------------------------------------------------------
# the floor: the iteration's FLOPs at the device's measured peak
# ---------------------------------------------------------------------------------------------------------
def measured_peak_tflops(device: str) -> float:
    """The dense matmul rate this device reaches (bf16 on CUDA, fp32 on CPU), measured here: the floor's
    denominator is what the hardware does, not a datasheet."""
    size, dtype, repeats = (8192, torch.bfloat16, 20) if device == "cuda" else (1024, torch.float32, 5)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        plain_loop.sync(device)
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        plain_loop.sync(device)
        best = min(best, (time.perf_counter() - began) / repeats)
    return 2 * size**3 / best / 1e12


def forward_tflop_per_sequence(opts, checkpoint: str) -> float:
    """FLOPs of one DiT forward of one sequence at the run's geometry (torch's formulas: matmuls, attention)."""
    from diffusers import StableDiffusion3Pipeline
    from torch.utils.flop_counter import FlopCounterMode

    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    pipe = StableDiffusion3Pipeline.from_pretrained(checkpoint, torch_dtype=dtype).to(opts.device)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt("a photo", None, None, do_classifier_free_guidance=False,
                                                  device=opts.device)
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        config = pipe.transformer.config
        x = torch.randn(1, config.in_channels, opts.height // factor, opts.width // factor, device=opts.device,
                        dtype=dtype)
        counter = FlopCounterMode(display=False)
        with counter:
            pipe.transformer(hidden_states=x, timestep=torch.ones(1, device=opts.device), encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)
    del pipe
    gc.collect()
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    return counter.get_total_flops() / 1e12


def floor_inputs(opts, checkpoint: str) -> tuple[float, float]:
    """(TFLOP of one forward of one sequence, the measured dense peak in TFLOP/s)."""
    return forward_tflop_per_sequence(opts, checkpoint), measured_peak_tflops(opts.device)


def iteration_floor(opts, lora: bool, tflop: float, peak: float) -> dict:
    """Seconds of an iteration at the peak: the rollout's forwards, the trainer's forward and backward (LoRA: the
    input gradients only, ≈ 2 forwards; full: the weight gradients too, ≈ 3 forwards). VAE decode left out."""
    cfg = 2 if opts.guidance > 1 else 1
    images = opts.prompts * opts.samples
    pairs = images * (opts.trained_steps or opts.steps)
    rollout = images * cfg * opts.steps * tflop / peak
    train = pairs * cfg * (2 if lora else 3) * tflop / peak
    fused = rollout + pairs * cfg * tflop / peak  # no replay: the rollout's forwards plus one backward per pair
    return {"rollout": rollout, "train": train, "iteration": rollout + train, "fused": fused}


# ---------------------------------------------------------------------------------------------------------
# train_diffusion.py
# ---------------------------------------------------------------------------------------------------------
def miles_flags(opts, checkpoint: str, prompt_file: str, out: str, lora: bool, mode: str) -> list[str]:
    p, m, n = opts.prompts, opts.samples, opts.steps
    flags = [
        "--hf-checkpoint", checkpoint, "--diffusion-model-family", "sd3", "--prompt-data", prompt_file,
        "--rm-type", "brightness", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--num-gpus-per-node", "1", "--colocate",
        "--rollout-batch-size", str(p), "--n-samples-per-prompt", str(m), "--global-batch-size", str(p * m),
        "--rollout-microgroup-size", str(m),
        "--num-rollout", str(opts.iterations), "--diffusion-num-steps", str(n),
        "--diffusion-height", str(opts.height), "--diffusion-width", str(opts.width),
        "--diffusion-guidance-scale", str(opts.guidance), "--diffusion-noise-level", str(opts.noise_level),
        "--diffusion-forward-dtype", "bf16" if opts.device == "cuda" else "fp32",
        "--micro-batch-size", str(opts.micro_batch_size), "--lr", "1e-5", "--output-dir", out,
    ]
    if opts.trained_steps:
        flags += ["--diffusion-num-sde-steps", str(opts.trained_steps)]
    if lora:
        flags += ["--use-lora", "--lora-rank", "32", "--lora-alpha", "64"]
    mode, variant = split_mode(mode)
    no_replay = mode.endswith(ROLLOUT_GRADIENT)
    if no_replay:  # the engines take each sample's gradient, nothing is replayed (LoRA)
        flags += ["--diffusion-rollout-gradient"]
        mode = mode.removesuffix(ROLLOUT_GRADIENT)
    if mode == "compiled":  # docs/quickstart.md's GPU command
        flags += ["--fsdp-torch-compile", "--sglang-enable-torch-compile"]
    elif mode == "compiled-free":  # the compiled command before it was exact: free batching, ratio hidden by recompute
        flags += ["--fsdp-torch-compile", "--sglang-enable-torch-compile", "--rollout-patch-group", "none"]
        if not no_replay:  # without a replay there is no old log-prob to recompute: exact by construction
            flags += ["--diffusion-recompute-old-log-prob"]
    return flags + variant + list(opts.extra_flags)


def split_mode(mode: str) -> tuple[str, list[str]]:
    """`MODE[:--FLAG=VALUE...]`: a --miles-modes entry is a mode, then any train_diffusion.py flags of its own
    (a variant measured beside the mode in one call, e.g. `compiled-rollout-gradient:--sglang-attention-backend=
    _native_cudnn`). Returns the mode and its flags as argv items."""
    mode, *extras = mode.split(":")
    variant = []
    for extra in extras:
        flag, sep, value = extra.partition("=")
        if not flag.startswith("--"):
            raise SystemExit(f"--miles-modes: {extra!r} in {mode!r}: expected --FLAG or --FLAG=VALUE")
        variant += [flag, value] if sep else [flag]
    return mode, variant


def engine_graphs(out: str) -> int | None:
    """The most graphs any engine of a run says it compiled (its log's "graphs compiled" lines), None if none."""
    counts = []
    for path in glob.glob(os.path.join(out, "engine_logs", "*.log")):
        with open(path, errors="replace") as handle:
            counts += [int(m.group(1)) for m in re.finditer(r"(\d+) graphs compiled in this engine", handle.read())]
    return max(counts) if counts else None


def run_miles(opts, checkpoint: str, prompt_file: str, lora: bool, mode: str, workdir: str) -> dict:
    """The last launch's row; a compiled mode's earlier launches fill the compile caches, and --rows-jsonl gets
    each of their rows too (a call cut short in the last launch keeps the first's)."""
    launches = opts.compiled_launches if mode.startswith("compiled") else 1
    for launch in range(launches):
        out = os.path.join(workdir, launch_folder(lora, mode, launch))
        shutil.rmtree(out, ignore_errors=True)  # a reused --workdir: this launch's metrics only
        argv = [sys.executable, os.path.join(REPO_ROOT, "train_diffusion.py"),
                *miles_flags(opts, checkpoint, prompt_file, out, lora, mode)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        began = time.perf_counter()
        with PeakMemory(opts.device) as memory:
            result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "console.log"), "w") as handle:  # the trainer's and engines' lines, kept
            handle.write(result.stdout + result.stderr)
        keep_logs(out, opts.keep_logs)
        for line in (result.stdout + result.stderr).splitlines():  # what a colocated run chose (miles/ray/colocation.py)
            if "colocation: " in line:
                print(f"  miles {'lora' if lora else 'full'} {mode} launch {launch}: {line.rsplit('colocation: ', 1)[1]}",
                      flush=True)
        if result.returncode != 0:
            raise RuntimeError(f"train_diffusion.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        iterations = [r for r in records if "perf/iteration_time" in r]
        for r in iterations:
            print(f"  miles {'lora' if lora else 'full'} {mode} launch {launch} rollout {r['rollout_id']}: " +
                  " ".join(f"{k[5:]}={v:.2f}" for k, v in r.items() if k.startswith("perf/") and k.endswith(PRINTED)),
                  # the push's own split: gathering the weights, the engines' wait for their worker and their apply
                  " ".join(f"{k}={v:.3f}" for k, v in r.items()
                           if k.startswith("weight_sync/") and k.endswith(("seconds", "stepped"))),
                  flush=True)
        row = launch_row(iterations, memory.gib, wall, out)
        if launch < launches - 1:
            record_row(opts, lora, f"miles {mode}, launch {launch + 1} of {launches} (cold caches)", row)
    return row


def launch_folder(lora: bool, mode: str, launch: int) -> str:
    """A launch's folder name, its variant's flags in letters, digits, '.', '_' and '-' alone: a device call
    brings back no file under a folder named otherwise (a `--rollout-prefetch=off` variant's logs were left out)."""
    return f"miles-{'lora' if lora else 'full'}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', mode)}-{launch}"


def keep_logs(out: str, logs: str | None) -> None:
    """A launch's console and metrics (kilobytes) copied into `logs`/<its folder>, failed launches too: the run's
    own folder sits beside its checkpoint in the work directory, which a device call does not bring back."""
    if not logs:
        return
    kept = os.path.join(logs, os.path.basename(out))
    os.makedirs(kept, exist_ok=True)
    for name in ("console.log", "metrics.jsonl"):
        if os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(out, name), kept)


def launch_row(iterations: list[dict], peak_gib: float | None, wall: float, out: str) -> dict:
    """One launch's row from its per-iteration records: the steady iterations' means, its start-up and first
    iteration split into their parts."""
    steady = iterations[1:] or iterations
    mean = lambda key: sum(r.get(key, 0.0) for r in steady) / len(steady)  # noqa: E731
    return {
        "iteration": mean("perf/iteration_time"),
        "phases": {phase: mean(f"perf/{phase}_time") for phase in PHASES if any(f"perf/{phase}_time" in r for r in steady)},
        "unaccounted": mean("perf/unaccounted_time"),
        "peak_gib": peak_gib,
        "startup": iterations[0].get("perf/startup_time"),
        "engine_load": iterations[0].get("perf/engine_load_s"),
        "startup_parts": {key[len("perf/startup/"):-len("_time")]: value for key, value in iterations[0].items()
                          if key.startswith("perf/startup/")},
        "first_iteration": iterations[0]["perf/iteration_time"],
        "first_iteration_parts": {"rollout": iterations[0].get("perf/rollout_time", 0.0),
                                  "of which the engine compiling": iterations[0].get("rollout/engine_compile_seconds", 0.0),
                                  "engine graphs compiled (count)": engine_graphs(out) or 0,
                                  "train": iterations[0].get("perf/train_time", 0.0),
                                  "of which the trainer compiling": iterations[0].get("perf/train_compile_s", 0.0)},
        "clipfrac": mean("train/clipfrac"),
        "inside": {"engine request": mean("rollout/engine_request_seconds"),
                   # the engine's timers do not synchronise: device work its worker queued shows up where it
                   # next waits for the device, the prompt encoding of the next wave's requests
                   "of which prompt encoding (and waits for queued steps)": mean("rollout/engine_start_seconds"),
                   "denoise": mean("rollout/engine_denoise_seconds"),
                   "decode": mean("rollout/engine_decode_seconds"),
                   "packing the results": mean("rollout/engine_pack_seconds"),
                   "the rest (admission waits, scheduling, device work no timer waited for)": mean("rollout/engine_request_seconds") - sum(
                       mean(f"rollout/engine_{part}_seconds") for part in ("start", "denoise", "decode", "pack")),
                   "trainer step": mean("perf/train_time_s"),
                   "of which fetching the engines' gradient": mean("perf/policy_gradient_fetch_s"),
                   "trainer staging + micro-batching": mean("perf/train_prepare_s"),
                   "trainer cudaMalloc calls (count)": mean("perf/train_cuda_mallocs"),
                   "train phase outside the trainer's step (samples to the trainer's ranks, the answer back)":
                       mean("perf/train_time") - mean("perf/train_time_s")},
        "log_prob_diff": mean("train/rollout_train_log_prob_abs_diff"),
        "memory": {f"{side} {kind}": max(r.get(f"perf/{side}_peak_{kind}_gib", 0.0) for r in iterations)
                   for side in ("engine", "train") for kind in ("reserved", "allocated")
                   if any(f"perf/{side}_peak_{kind}_gib" in r for r in iterations)},
        "wall": wall,
    }


# ---------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------
def print_table(title: str, rows: dict[str, dict], floor: dict | None = None) -> None:
    """Rows side by side; ratios against the compiled plain loop (the strongest loop a user writes from the
    libraries' docs) and the eager one; MFU = the floor's seconds over the row's."""
    phases = []
    for row in rows.values():
        phases += [p for p in row["phases"] if p not in phases]
    print(f"\n### {title}\n")
    head = ["path", "s / iteration", *[f"{p} s" for p in phases], "unaccounted s", "peak GiB", "startup s",
            "first iteration s", "clipfrac", "log-prob diff", "MFU", "vs plain compiled", "vs plain eager"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    bases = [rows.get(f"plain {mode}", {}).get("iteration") for mode in ("compiled", "eager")]
    if floor:
        cells = ["floor (FLOPs at the measured peak)", f"{floor['iteration']:.2f}",
                 *[f"{floor[p]:.2f}" if p in floor else "–" for p in phases], *["–"] * 6, "100%", "–", "–"]
        print("| " + " | ".join(cells) + " |")
        if "plain fused" in rows:
            cells = ["floor without the replay (the fused loop's)", f"{floor['fused']:.2f}", *["–"] * len(phases),
                     *["–"] * 6, "100%", "–", "–"]
            print("| " + " | ".join(cells) + " |")
    for name, row in rows.items():
        cells = [name, f"{row['iteration']:.2f}", *[f"{row['phases'].get(p, 0.0):.2f}" for p in phases],
                 f"{row['unaccounted']:.2f}", "–" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}",
                 "–" if row.get("startup") is None else f"{row['startup']:.1f}", f"{row['first_iteration']:.1f}",
                 "–" if row.get("clipfrac") is None else f"{row['clipfrac']:.3f}",
                 "–" if row.get("log_prob_diff") is None else f"{row['log_prob_diff']:.2g}",
                 f"{100 * floor['fused' if name == 'plain fused' else 'iteration'] / row['iteration']:.0f}%"
                 if floor else "–",
                 *[f"{base / row['iteration']:.2f}x" if base else "–" for base in bases]]
        print("| " + " | ".join(cells) + " |")
    for name, row in rows.items():
        if row.get("inside"):
            print(f"{name}, inside the phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in row["inside"].items()))
        if row.get("memory"):  # each process's own peak, beside the device-wide one in the table
            print(f"{name}, its processes' peak memory (GiB): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row["memory"].items()))
        if row.get("startup_parts"):
            parts = {k: v for k, v in row["startup_parts"].items() if "/" not in k}
            laps = {k: v for k, v in row["startup_parts"].items() if "/" in k}  # e.g. trainer_init/load
            print(f"{name}, its start-up (s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
            if laps:
                print(f"{name}, inside its start-up parts (s): " + ", ".join(f"{k} {v:.2f}" for k, v in laps.items()))
            if row.get("engine_load") is not None:
                print(f"{name}, the slowest engine's model load, overlapped with trainer_init (s): "
                      f"{row['engine_load']:.2f}")
        if row.get("first_iteration_parts"):
            print(f"{name}, its first iteration (s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["first_iteration_parts"].items()))
    sys.stdout.flush()


def in_child_process(fn, *args):
    """`fn(*args)` in a fresh process, which gives all its device memory back when it ends: a plain loop (or the
    floor's model) measured in this process left memory held here, and the framework's launch after it ran with
    75 allocator retries per step, 24.4 s per iteration against 20.7 s alone (bench/RESULTS.md)."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a forked child would share this process's CUDA state
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def measure_setup(opts, checkpoint: str, prompt_file: str, lora: bool, workdir: str) -> dict[str, dict]:
    """One table's rows: the plain loop (unless --skip-plain), then each --miles-modes mode."""
    prompts = [f"a photo of object number {i} on a table" for i in range(opts.prompts)]
    os.makedirs(workdir, exist_ok=True)
    rows: dict[str, dict] = {}
    for mode in [] if opts.skip_plain else list(filter(None, opts.plain_modes.split(","))):
        if mode == "fused" and not lora:
            continue  # per-sample adapter copies: LoRA only
        rows[f"plain {mode}"] = in_child_process(plain_loop.run, opts, checkpoint, prompts, lora, mode)
        record_row(opts, lora, f"plain {mode}", rows[f"plain {mode}"])
    for mode in filter(None, opts.miles_modes.split(",")):  # --miles-modes '': the plain loop alone
        if split_mode(mode)[0].endswith(ROLLOUT_GRADIENT) and not lora:
            continue  # per-sample adapter copies: LoRA only
        rows[f"miles {mode}"] = run_miles(opts, checkpoint, prompt_file, lora, mode, workdir)
        record_row(opts, lora, f"miles {mode}", rows[f"miles {mode}"])
    return rows


def record_row(opts, lora: bool, path: str, row: dict) -> None:
    """--rows-jsonl: append the row as soon as it is measured, so a later launch that fails or runs out of time
    loses nothing measured before it."""
    if not opts.rows_jsonl:
        return
    record = {"setup": "lora" if lora else "full", "path": path, "prompts": opts.prompts, "samples": opts.samples,
              "trained_steps": opts.trained_steps or opts.steps, **row}
    with open(opts.rows_jsonl, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def sweep_points(opts) -> list[tuple[int, int]]:
    """(images per rollout, trained steps per sample; 0 = all) for --sweep-images and --sweep-trained-steps."""
    images = [int(v) for v in opts.sweep_images.split(",")] if opts.sweep_images else []
    steps = [int(v) for v in opts.sweep_trained_steps.split(",")] if opts.sweep_trained_steps else []
    points = [(n, opts.trained_steps) for n in images] + [(opts.prompts * opts.samples, t) for t in steps]
    for n, _ in points:
        if n % opts.samples:
            raise SystemExit(f"--sweep-images {n}: not a multiple of --samples {opts.samples}")
    return list(dict.fromkeys(points))


def print_growth(title: str, points: list[tuple[int, int, dict[str, dict]]], steps: int) -> None:
    """How an iteration grows with the rollout's size and the trained steps: one line per point and path."""
    print(f"\n### {title}: growth\n")
    print("| images | trained steps | pairs | path | s / iteration | rollout s | train s | images/s (rollout) "
          "| pairs/s (train) | vs plain (compiled if measured) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for images, trained, rows in points:
        pairs = images * (trained or steps)
        base = rows.get("plain compiled", rows.get("plain eager", {})).get("iteration")
        for name, row in rows.items():
            rollout, train = row["phases"].get("rollout", 0.0), row["phases"].get("train", 0.0)
            cells = [str(images), str(trained or steps), str(pairs), name, f"{row['iteration']:.2f}",
                     f"{rollout:.2f}", f"{train:.2f}", f"{images / rollout:.1f}" if rollout else "–",
                     f"{pairs / train:.1f}" if train else "–", f"{base / row['iteration']:.2f}x" if base else "–"]
            print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--real-size", action="store_true", help="SD3.5-Medium sizes (make_tiny --real-size)")
    parser.add_argument("--checkpoint", help="an existing pipeline folder (default: build one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trained-steps", type=int, default=0, help="trained steps per sample (0: all of them)")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--noise-level", type=float, default=all_flags()["diffusion_noise_level"].default)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--setups", default="lora,full", help="comma list of lora, full")
    parser.add_argument("--miles-modes", default="eager,compiled",
                        help="comma list of eager, compiled ('': the plain loop alone)")
    parser.add_argument("--plain-modes", default="compiled,eager",
                        help="comma list of the plain loop's modes: compiled (regional compilation as diffusers' docs "
                        "show: the reference every ratio is against), eager, fused (LoRA: each sample's gradient "
                        "taken during the rollout, no replay; an experiment, bench/plain_loop.py)")
    parser.add_argument("--fused-chunk", type=int, default=0,
                        help="samples per forward in the fused loop's rollout (0: --micro-batch-size)")
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--skip-floor", action="store_true", help="do not measure the FLOP floor")
    parser.add_argument("--compiled-launches", type=int, default=2,
                        help="launches per compiled mode, the last one measured (1: when the compile caches are warm)")
    parser.add_argument("--sweep-images", help="comma list of images per rollout (multiples of --samples), e.g. "
                        "16,32,64,128: each is measured as above and a growth table follows")
    parser.add_argument("--sweep-trained-steps", help="comma list of trained steps per sample (0: all), e.g. 2,0")
    parser.add_argument("--rows-jsonl", help="append every measured row to this file as soon as it is measured")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep-logs", metavar="DIR", help="copy each framework launch's console.log and "
                        "metrics.jsonl into DIR/<launch> (e.g. $OUT/logs on the device), failed launches too")
    parser.add_argument("extra_flags", nargs="*", help="after --: more train_diffusion.py flags")
    opts = parser.parse_args()
    pixels = 512 if opts.real_size else 32
    opts.height = opts.height or pixels
    opts.width = opts.width or pixels
    points = sweep_points(opts)
    workdir = opts.workdir or tempfile.mkdtemp(prefix="bench_e2e_")
    os.makedirs(workdir, exist_ok=True)
    checkpoint = opts.checkpoint
    if checkpoint is None:
        checkpoint = os.path.join(workdir, "sd35m" if opts.real_size else "tiny-sd3")
        if not os.path.exists(os.path.join(checkpoint, "model_index.json")):
            command = [sys.executable, "-m", "miles.testing.make_tiny", "--family", "sd3", "--out", checkpoint]
            if opts.real_size:
                command += ["--real-size", "--device", opts.device]
            subprocess.run(command, cwd=REPO_ROOT, check=True)
    most_prompts = max([opts.prompts] + [n // opts.samples for n, _ in points])
    prompt_file = os.path.join(workdir, "prompts.jsonl")
    with open(prompt_file, "w") as handle:
        for i in range(most_prompts * opts.iterations):
            handle.write(json.dumps({"input": f"a photo of object number {i} on a table"}) + "\n")
    print(f"device {torch.cuda.get_device_name() if opts.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{opts.prompts} prompts x {opts.samples} samples, {opts.steps} steps, {opts.height}x{opts.width}, "
          f"micro-batch {opts.micro_batch_size}, {opts.iterations} iterations", flush=True)
    tflop = peak = None
    if not opts.skip_floor:
        tflop, peak = in_child_process(floor_inputs, opts, checkpoint)
        print(f"floor: one DiT forward of one sequence is {tflop:.4g} TFLOP; measured dense peak {peak:.1f} TFLOP/s "
              f"({'bf16' if opts.device == 'cuda' else 'fp32'} matmul)", flush=True)
    for setup in opts.setups.split(","):
        lora = setup == "lora"
        title = "LoRA r32" if lora else "full fine-tune"
        if not points:
            floor = iteration_floor(opts, lora, tflop, peak) if tflop else None
            print_table(title, measure_setup(opts, checkpoint, prompt_file, lora, workdir), floor)
            continue
        measured = []
        for images, trained in points:
            point = argparse.Namespace(**{**vars(opts), "prompts": images // opts.samples, "trained_steps": trained})
            rows = measure_setup(point, checkpoint, prompt_file, lora,
                                 os.path.join(workdir, f"{images}-images-{trained or opts.steps}-steps"))
            floor = iteration_floor(point, lora, tflop, peak) if tflop else None
            print_table(f"{title}, {images} images, {trained or opts.steps} trained steps", rows, floor)
            measured.append((images, trained, rows))
        print_growth(title, measured, opts.steps)


if __name__ == "__main__":
    main()
