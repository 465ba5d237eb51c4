"""Bitwise parity and what it costs: the engine's rollout replayed by the trainer, with and without `batch_invariant`.

    python bench/bench_parity.py --device cuda --checkpoint SD35M --height 512 --width 512   # real size, LoRA
    python bench/bench_parity.py --device cuda --families sd3,flux,qwen_image,wan2_2,ltx,cosmos3   # tiny, bf16
    python bench/bench_parity.py --device cpu --families sd3 --dtype fp32                     # CPU smoke test

Both parts run the real engine (`ModelRunner`: requests of different prompts share every denoising step, the
family's decode) and the real trainer (`DiffusionTrainer`, one-rank FSDP2), in one process.

- `--checkpoint`: the cost of the group at one checkpoint. The rollout (prompts × samples, every step SDE,
  decode included) and the trainer's pass over its pairs (LoRA) timed with the group off (the engine batches freely, the trainer
  forwards micro-batches) and on (both sides forward tiles of `--micro-batch-size`, attention pinned, LoRA valued
  by the merged weight). The trainer's pass is a real optimizer step at lr 0 (forward, backward, clipping,
  AdamW), so the weights stay those the engine ran. Then the on-policy probe with a non-zero LoRA B: the trainer's merged weights are put
  into the engine, which rolls out again, and the trainer replays it: `log_prob` / `model_output` differences
  and clipfrac, which must be exactly 0 with the group.
- `--families`: the probe at tiny size for each family (built offline with `make_tiny`), in `--dtype`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from miles.backends.fsdp_utils.actor import DiffusionTrainer  # noqa: E402
from miles.backends.fsdp_utils.spawn import free_port, init_distributed  # noqa: E402
from miles.testing.tiny_rollout import build_tiny_family, tiny_trainer_config  # noqa: E402
from miles.backends.fsdp_utils.weight_export import iter_named_tensors  # noqa: E402
from miles.engine.model_runner import ModelRunner  # noqa: E402
from miles.engine.protocol import GenerateRequest  # noqa: E402
from miles.engine.server_args import ServerArgs  # noqa: E402
from miles.types import GuidanceConfig, Sample  # noqa: E402

PROMPTS = ["a red cube on a table", "two cats under a tree", "a lighthouse at dusk", "a bowl of ramen",
           "an astronaut riding a horse", "a city street in the rain", "a violin on a chair", "a snowy mountain"]
# Tiny geometry per family: (height, width, frames); video families need a few frames.
TINY_SHAPES = {"sd3": (32, 32, 1), "flux": (32, 32, 1), "qwen_image": (32, 32, 1), "wan2_2": (32, 32, 5),
               "ltx": (32, 32, 5), "cosmos3": (64, 64, 1), "flux2": (32, 32, 1), "hunyuan_video": (32, 32, 5)}
# The tiny wan2_2 default has two experts and the trainer trains one; TI2V-5B (one transformer) is the layout
# the real-size builder reproduces.
TINY_VARIANTS = {"wan2_2": "ti2v_5b"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine(family, pipe, checkpoint: str, device: str, dtype: str, tile: int, compile: bool = False) -> ModelRunner:
    """An engine's model runner over an already loaded pipeline; `tile` > 0 turns the group on; `compile`: each
    block compiled, as `--sglang-enable-torch-compile` does."""
    server_args = ServerArgs(model_path=checkpoint, device=device, dtype=dtype, forward_tile=tile,
                             rollout_patch_group="batch_invariant" if tile else None, max_batch_size=256,
                             enable_torch_compile=compile)
    return ModelRunner(server_args, loaded=(family, pipe))


def rollout(runner: ModelRunner, opts, prompts: list[str], samples_per_prompt: int, shape) -> tuple[list[Sample], dict]:
    """Every prompt's request denoised together (one batched forward per step), decoded; timed phases."""
    height, width, frames = shape
    steps = opts.steps
    sde_steps = list(range(steps)) if opts.sde_steps is None else opts.sde_steps
    requests = [
        GenerateRequest(prompt=prompt, num_samples=samples_per_prompt, seed=100 * i, num_steps=steps,
                        height=height, width=width, num_frames=frames,
                        guidance=GuidanceConfig(guidance_scale=opts.guidance), noise_level=0.7, debug=True,
                        sde_step_indices=sde_steps,
                        return_latent_indices=sorted({*sde_steps, *(k + 1 for k in sde_steps)}))
        for i, prompt in enumerate(prompts)
    ]
    device = runner.device.type
    sync(device)
    began = time.perf_counter()
    trajectories = [runner.start(request) for request in requests]
    sync(device)
    encoded = time.perf_counter()
    while not trajectories[0].done:
        runner.step(trajectories)
    sync(device)
    denoised = time.perf_counter()
    samples = []
    for trajectory, request in zip(trajectories, requests):
        for result in runner.finish(trajectory).samples:
            sample = result.fill_sample(Sample(prompt=request.prompt), request, 0, None)
            sample.index = len(samples)
            sample.advantage = 1.0 if sample.index % 2 else -1.0
            samples.append(sample)
    sync(device)
    finished = time.perf_counter()
    return samples, {"encode": encoded - began, "denoise": denoised - encoded, "decode+pack": finished - denoised,
                     "total": finished - began}


@contextlib.contextmanager
def profiled(folder: str, name: str):
    """torch.profiler over the block; the kernels by total device time into `folder/name.txt`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.txt"), "w") as out:
        out.write(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=90))
    print(f"profile: {os.path.join(folder, name + '.txt')}", flush=True)


def trainer_for(family, checkpoint: str, opts, tile: int, micro_batch_size: int, **overrides) -> DiffusionTrainer:
    height, width, frames = opts.shape
    # Real optimizer steps (forward, backward, clip, AdamW) at lr 0: timed like training, and the policy stays the
    # one the engine ran, so every pass is a valid probe.
    assert tile in (0, micro_batch_size), "the batch_invariant group forwards in micro-batch tiles"
    args = tiny_trainer_config(
        checkpoint, diffusion_debug_mode=True, lr=0.0, micro_batch_size=micro_batch_size,
        rollout_patch_group=["batch_invariant" if tile else "none"],
        diffusion_guidance_scale=opts.guidance, diffusion_num_steps=opts.steps, diffusion_forward_dtype=opts.dtype,
        diffusion_height=height, diffusion_width=width, diffusion_output_num_frames=frames,
        fsdp_torch_compile=opts.compile, **overrides,
    )
    trainer = DiffusionTrainer(args, family, device=opts.device)
    trainer.init()
    return trainer


def timed_train(trainer: DiffusionTrainer, samples: list[Sample], rollout_id: int, device: str) -> tuple[dict, float]:
    sync(device)
    began = time.perf_counter()
    metrics = trainer.train(rollout_id, samples)
    sync(device)
    return metrics, time.perf_counter() - began


def probe_line(metrics: dict) -> str:
    keys = ("train/log_prob_mean_abs_diff", "train/model_output_mean_abs_diff", "train/model_output_max_abs_diff",
            "train/clipfrac", "train/approx_kl")
    return " | ".join(f"{metrics.get(key, float('nan')):.3g}" for key in keys)


def randomize_lora_b(trainer: DiffusionTrainer, scale: float = 0.02) -> None:
    """A trained adapter: B != 0, so the merged weight the engine runs differs from the base."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_((torch.randn(local.shape, generator=generator) * scale).to(local.dtype))


def load_into_engine(runner: ModelRunner, trainer: DiffusionTrainer) -> None:
    merged = {name: tensor for name, tensor in iter_named_tensors(trainer)}
    with torch.no_grad():
        for name, param in runner.modules["transformer"].named_parameters():
            param.copy_(merged[f"transformer.{name}"].to(param.device, param.dtype))


def cost_at_checkpoint(opts) -> None:
    """The group's cost and the probe with a trained (non-zero) LoRA, at one checkpoint."""
    family = build_tiny_family(tiny_trainer_config(opts.checkpoint))
    pipe = family.load_pipeline(opts.checkpoint, DTYPES[opts.dtype]).to(opts.device)
    prompts = (PROMPTS * ((opts.prompts + len(PROMPTS) - 1) // len(PROMPTS)))[: opts.prompts]
    tile = opts.micro_batch_size
    rows = []
    lora = dict(use_lora=True, lora_rank=opts.lora_rank, lora_alpha=2 * opts.lora_rank)
    warm = rollout(engine(family, pipe, opts.checkpoint, opts.device, opts.dtype, 0), opts, prompts[:1], 2,
                   opts.shape)  # kernels, allocator
    del warm
    modes = (("off (batched freely)", 0), (f"on (tiles of {tile})", tile))
    for label, mode_tile in modes[1:] if opts.probe_only else modes:
        runner = engine(family, pipe, opts.checkpoint, opts.device, opts.dtype, mode_tile, opts.compile)
        samples, phases = rollout(runner, opts, prompts, opts.samples, opts.shape)
        _, phases = rollout(runner, opts, prompts, opts.samples, opts.shape)  # the second one is timed
        trainer = trainer_for(family, opts.checkpoint, opts, mode_tile, tile, **lora)
        first, _ = timed_train(trainer, samples, 0, opts.device)
        _, seconds = timed_train(trainer, samples, 1, opts.device)
        if opts.profile:
            name = "group-on" if mode_tile else "group-off"
            with profiled(opts.profile, f"{name}-rollout"):
                rollout(runner, opts, prompts, opts.samples, opts.shape)
            with profiled(opts.profile, f"{name}-train"):
                timed_train(trainer, samples, 1, opts.device)
        pairs = first.get("train/num_pairs") or len(samples) * len(samples[0].sde_step_indices)
        rows.append((label, len(samples) / phases["total"], phases, pairs / seconds, seconds, probe_line(first)))
        if mode_tile:
            randomize_lora_b(trainer)
            load_into_engine(runner, trainer)
            samples, _ = rollout(runner, opts, prompts, opts.samples, opts.shape)
            trained, _ = timed_train(trainer, samples, 2, opts.device)
            probe_trained = probe_line(trained)
        del trainer, runner
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    if opts.probe_only:
        print(f"\n## probe at {opts.checkpoint} ({'compiled' if opts.compile else 'eager'}, group on): "
              f"log_prob mean diff / output mean / output max / clipfrac / approx_kl")
        print(f"LoRA B = 0: {rows[0][5]}\ntrained adapter: {probe_trained}", flush=True)
        return
    off, on = rows
    print(f"\n## batch_invariant at {opts.checkpoint}: {opts.prompts} prompts x {opts.samples} samples, "
          f"{opts.shape[0]}x{opts.shape[1]}, {opts.steps} steps, CFG {opts.guidance}, {opts.dtype}, LoRA "
          f"r{opts.lora_rank}, micro-batch {tile}, {opts.device}")
    print("| group | rollout images/s | encode s | denoise s | decode+pack s | trainer pairs/s | train pass s | "
          "probe: log_prob mean diff / output mean / output max / clipfrac / approx_kl |")
    print("|---|---|---|---|---|---|---|---|")
    for label, images_per_s, phases, pairs_per_s, seconds, probe in rows:
        print(f"| {label} | {images_per_s:.2f} | {phases['encode']:.2f} | {phases['denoise']:.2f} | "
              f"{phases['decode+pack']:.2f} | {pairs_per_s:.2f} | {seconds:.2f} | {probe} |")
    print(f"| cost of the group | rollout {100 * (1 - on[1] / off[1]):+.1f}% slower | | | | "
          f"trainer {100 * (1 - on[3] / off[3]):+.1f}% slower | | |")
    print(f"\nprobe with a trained adapter (LoRA B ~ N(0, 0.02²), merged weights in the engine, group on): {probe_trained}")


def families_probe(opts) -> None:
    from miles.testing.make_tiny import build_tiny_pipeline

    print(f"\n## tiny families, {opts.dtype} on {opts.device}: requests of different prompts share each step, "
          "trainer micro-batch 3 = engine tile")
    print("| family | log_prob mean diff | output mean diff | output max diff | clipfrac | approx_kl | "
          "same, group off |")
    print("|---|---|---|---|---|---|---|")
    root = opts.workdir or tempfile.mkdtemp(prefix="parity-")
    for name in opts.families.split(","):
        variant = TINY_VARIANTS.get(name)
        checkpoint = build_tiny_pipeline(name, os.path.join(root, f"tiny-{name}-{variant or 'default'}"), variant=variant)
        family = build_tiny_family(tiny_trainer_config(checkpoint))
        pipe = family.load_pipeline(checkpoint, DTYPES[opts.dtype]).to(opts.device)
        opts.shape = TINY_SHAPES[name]
        lines = []
        for tile in (0, 3):  # off first: the group casts the shared pipeline's fp32-kept parameters
            runner = engine(family, pipe, checkpoint, opts.device, opts.dtype, tile)
            samples, _ = rollout(runner, opts, ["a red cube", "two cats under a tree"], 3, opts.shape)
            trainer = trainer_for(family, checkpoint, opts, tile, 3 if tile else 1)
            metrics, _ = timed_train(trainer, samples, 0, opts.device)
            lines.append(probe_line(metrics))
            del trainer, runner
        print(f"| {name}{f' ({variant})' if variant else ''} | {lines[1]} | {lines[0].split(' | ')[2]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--checkpoint", help="a pipeline folder: measure the group's cost there")
    parser.add_argument("--families", help="comma list of tiny families to probe")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sde-steps", type=lambda text: [int(k) for k in text.split(",")], default=None,
                        help="comma list of SDE (trained) steps; default all")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--compile", action="store_true",
                        help="compile each block on both sides (--sglang-enable-torch-compile, --fsdp-torch-compile)")
    parser.add_argument("--probe-only", action="store_true", help="with --checkpoint: only the group-on probes")
    parser.add_argument("--profile", metavar="DIR",
                        help="with --checkpoint: after the timed passes, one more rollout and train pass per mode "
                             "under torch.profiler, each kernel table written to DIR")
    opts = parser.parse_args()
    opts.shape = (opts.height, opts.width, 1)
    if opts.device == "cpu":
        # oneDNN splits a GEMM's reduction across threads differently for a row's position in the batch; one
        # thread per process (what Ray gives a 1-CPU actor, and the tests use) keeps CPU parity exact.
        torch.set_num_threads(1)
    init_distributed(0, 1, "nccl" if opts.device == "cuda" else "gloo", free_port())
    if opts.device == "cuda":
        torch.cuda.set_device(0)
    if opts.checkpoint:
        cost_at_checkpoint(opts)
    if opts.families:
        opts.steps, opts.sde_steps, opts.micro_batch_size = 4, [0, 1, 2], 3
        families_probe(opts)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
