"""Where a LoRA train step's wall time goes between the host and the device, in one process.

    python bench/bench_train_host.py --device cuda --checkpoint SD35M --height 512 --width 512
    python bench/bench_train_host.py --device cuda --checkpoint SD35M --height 512 --width 512 --variants default,reduce-overhead

The engine (compiled, `batch_invariant`, tiles of the micro-batch) rolls out the prompts once; then for each
`--variants` entry a trainer is built as the documented command builds it (LoRA r32, `--fsdp-torch-compile`, the
group on, one optimizer step per rollout, lr 0 so every step replays the engine's own policy) and trains on that
rollout: two warm-up steps, then timed steps. `default` compiles the trainer's blocks as `train_diffusion.py`
does; `reduce-overhead` compiles them with `torch.compile(mode="reduce-overhead")` (CUDA graphs of each block's
forward and backward). Each timed step prints its wall time, the dispatching thread's CPU time, and the on-policy
probe (`rollout_train_log_prob_abs_diff`, clipfrac).

With `--diagnose` (first variant only), three more steps say where the host's time goes:
- `torch.cuda.set_sync_debug_mode("warn")`: every call site that makes the host wait for the device;
- cProfile of the dispatching thread: the functions by their own time;
- torch.profiler: the device's kernel time against the step's wall time, and the host operators (CUDA runtime
  calls included: a spinning `cudaStreamSynchronize` or a full launch queue shows up there) by their own time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import os
import pstats
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from bench_parity import PROMPTS, engine, rollout, sync  # noqa: E402
from miles.backends.fsdp_utils import parallelize  # noqa: E402
from miles.backends.fsdp_utils.actor import DiffusionTrainer  # noqa: E402
from miles.backends.fsdp_utils.spawn import free_port, init_distributed  # noqa: E402
from miles.models.common import build_train_pipeline_config  # noqa: E402
from miles.testing.config import trainer_config  # noqa: E402
from miles.utils.compile import compile_blocks  # noqa: E402

PROBE = ("train/rollout_train_log_prob_abs_diff", "train/clipfrac")


def build_trainer(opts, family, compile_mode: str | None) -> DiffusionTrainer:
    config = trainer_config(
        opts.checkpoint, use_lora=True, lora_rank=32, lora_alpha=64, lr=0.0, seed=0,
        rollout_batch_size=opts.prompts, n_samples_per_prompt=opts.samples,
        global_batch_size=opts.prompts * opts.samples, micro_batch_size=opts.micro_batch_size,
        rollout_patch_group=["batch_invariant"], diffusion_guidance_scale=opts.guidance,
        diffusion_num_steps=opts.steps, diffusion_forward_dtype=opts.dtype,
        diffusion_height=opts.height, diffusion_width=opts.width, fsdp_torch_compile=True,
    )
    # the trainer's blocks compiled in `compile_mode` (None: as train_diffusion.py compiles them)
    parallelize.compile_blocks = functools.partial(compile_blocks, mode=compile_mode)
    try:
        trainer = DiffusionTrainer(config, family, device=opts.device)
        trainer.init()
    finally:
        parallelize.compile_blocks = compile_blocks
    return trainer


def timed_step(trainer: DiffusionTrainer, samples, rollout_id: int, device: str) -> tuple[dict, float]:
    sync(device)
    began = time.perf_counter()
    metrics = trainer.train(rollout_id, samples)
    sync(device)
    return metrics, time.perf_counter() - began


def step_line(label: str, metrics: dict, seconds: float) -> str:
    probe = " ".join(f"{key.split('/')[-1]}={metrics.get(key, float('nan')):.3g}" for key in PROBE)
    return (f"{label}: {seconds:.2f} s wall, host thread {metrics.get('perf/train_host_cpu_s', float('nan')):.2f} s "
            f"CPU, {metrics.get('train/num_pairs', 0):.0f} pairs, {probe}")


def sync_sites(trainer: DiffusionTrainer, samples, device: str) -> str:
    """The call sites that synchronise with the device during one step (this thread's)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed_step(trainer, samples, 10, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    lines = [f"synchronising calls in one step: {sum(sites.values())} at {len(sites)} sites"]
    lines += [f"  {count:5d}  {site}" for site, count in sites.most_common(15)]
    return "\n".join(lines)


def host_profile(trainer: DiffusionTrainer, samples, device: str, rows: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    metrics, seconds = timed_step(trainer, samples, 11, device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return step_line("cProfile'd step", metrics, seconds) + "\n" + text.getvalue()


def device_profile(trainer: DiffusionTrainer, samples, device: str, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        metrics, seconds = timed_step(trainer, samples, 12, device)
    averages = prof.key_averages()
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in averages)
    host_table = averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)
    device_table = averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)
    return (f"{step_line('profiled step', metrics, seconds)}; device kernels {kernel_us / 1e6:.2f} s in all\n"
            f"-- host operators by own CPU time --\n{host_table}\n-- by own device time --\n{device_table}")


def run_variant(opts, family, samples, variant: str, diagnose: bool, out) -> None:
    compile_mode = None if variant == "default" else variant
    began = time.perf_counter()
    trainer = build_trainer(opts, family, compile_mode)
    for warm in range(2):
        metrics, seconds = timed_step(trainer, samples, warm, opts.device)
        out(step_line(f"[{variant}] warm-up step {warm}", metrics, seconds))
    out(f"[{variant}] built and warmed in {time.perf_counter() - began:.1f} s")
    for step in range(opts.timed_steps):
        metrics, seconds = timed_step(trainer, samples, 2 + step, opts.device)
        out(step_line(f"[{variant}] step {step}", metrics, seconds))
    if opts.device == "cuda":
        out(f"[{variant}] peak reserved {torch.cuda.max_memory_reserved() / (1 << 30):.1f} GiB")
    if diagnose:
        if opts.device == "cuda":
            out(sync_sites(trainer, samples, opts.device))
        out(host_profile(trainer, samples, opts.device, opts.rows))
        out(device_profile(trainer, samples, opts.device, opts.rows))
    del trainer
    if opts.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def leave_linear_to_the_compiler(out) -> None:
    """Both sides' blocks keep their linear layers as aten calls (cuBLAS through inductor's extern kernels),
    with inductor told to keep a bf16 addmm fused (its bias in the GEMM's epilogue, as eager rounds it)."""
    import torch._inductor.config as inductor_config

    from miles.models import opaque_kernels

    opaque_kernels.install_opaque_kernels = functools.partial(opaque_kernels.install_opaque_kernels, linear=False)
    kept = hasattr(inductor_config, "keep_addmm_fused_for_half_dtypes")
    if kept:
        inductor_config.keep_addmm_fused_for_half_dtypes = True
    out(f"linear layers left to the compiler; inductor keeps bf16 addmm fused: "
        f"{'yes' if kept else 'no such setting in this torch'} ({torch.__version__})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--checkpoint", required=True, help="an SD3 pipeline folder (make_tiny --real-size)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--variants", default="default", help="comma list: default, reduce-overhead")
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--diagnose", action="store_true", help="sync sites, cProfile, torch.profiler (first variant)")
    parser.add_argument("--linear", choices=("opaque", "native"), default="opaque",
                        help="native: both sides leave linear layers to the compiler (an exactness experiment)")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--log", help="also append every line to this file")
    opts = parser.parse_args()
    opts.sde_steps = None

    def out(text: str) -> None:
        print(text, flush=True)
        if opts.log:
            with open(opts.log, "a") as log:
                log.write(text + "\n")

    if opts.device == "cpu":
        torch.set_num_threads(1)
    if opts.linear == "native":
        leave_linear_to_the_compiler(out)
    init_distributed(0, 1, "nccl" if opts.device == "cuda" else "gloo", free_port())
    if opts.device == "cuda":
        torch.cuda.set_device(0)
    config = trainer_config(opts.checkpoint)
    family = build_train_pipeline_config(**config.model.family_source())
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    pipe = family.load_pipeline(opts.checkpoint, dtype).to(opts.device)
    prompts = (PROMPTS * ((opts.prompts + len(PROMPTS) - 1) // len(PROMPTS)))[: opts.prompts]
    runner = engine(family, pipe, opts.checkpoint, opts.device, opts.dtype, opts.micro_batch_size,
                    compile=opts.device == "cuda")
    samples, phases = rollout(runner, opts, prompts, opts.samples, (opts.height, opts.width, 1))
    out(f"rollout (compiling): {phases['total']:.1f} s, {len(samples)} samples")
    del runner, pipe
    for sample in samples:  # the probe needs the engine's log-probs, not its debug outputs
        sample.debug_model_outputs = None
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    for index, variant in enumerate(v for v in opts.variants.split(",") if v):
        run_variant(opts, family, samples, variant, opts.diagnose and index == 0, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
