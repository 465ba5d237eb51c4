"""Where an engine's rollout time goes: each phase of one rollout's requests, synchronised, in one process.

    python bench/profile_rollout.py --device cuda --compile        # SD3.5-Medium size, random weights
    python bench/profile_rollout.py --device cpu --arch-layers 1 --height 64 --num-images 4 --steps 2

The engine's own timers (`rollout/engine_*_seconds`) do not synchronise the device, so queued denoising work
shows up in whatever waits for it first (the decode). This script drives the same `ModelRunner` methods the
scheduler calls (start, step, finish) plus the wire encoding, with a device synchronise around each, and times
the VAE decode of the rollout's latents in a few layouts, so every second of the engine side is attributed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from bench.bench_rollout import build_sd35_medium  # noqa: E402
from miles.engine.model_runner import ModelRunner  # noqa: E402
from miles.engine.protocol import GenerateRequest, decode_response, encode_response  # noqa: E402
from miles.engine.server_args import ServerArgs  # noqa: E402
from miles.models.base import GenerationShape  # noqa: E402
from miles.models.common import decode_scaled_latents, parse_dtype  # noqa: E402
from miles.testing.real_size import synchronize  # noqa: E402
from miles.types import GuidanceConfig  # noqa: E402


class Timer:
    def __init__(self, device: torch.device):
        self.device, self.rows = device, []

    def __call__(self, name: str, fn, *args, **kwargs):
        synchronize(self.device)
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        synchronize(self.device)
        self.rows.append((name, time.perf_counter() - began))
        return out


def requests_for(opts) -> list[GenerateRequest]:
    m = opts.samples_per_request
    return [
        GenerateRequest(prompt=f"benchmark prompt number {i}", num_samples=m, seed=1000 + i, num_steps=opts.steps,
                        guidance=GuidanceConfig(opts.cfg), height=opts.height, width=opts.width,
                        sde_step_indices=list(range(opts.steps)), return_latent_indices=list(range(opts.steps + 1)),
                        request_id=str(i))
        for i in range(0, opts.num_images, m)
    ]


def one_rollout(runner: ModelRunner, opts, timer: Timer) -> None:
    trajectories = [timer("start (encode, initial latents)", runner.start, r) for r in requests_for(opts)]
    for k in range(opts.steps):
        timer(f"step {k}", runner.step, trajectories)
    for t in trajectories:
        response = timer("finish (decode + pack)", runner.finish, t)
        payload = timer("encode_response (msgpack)", encode_response, response)
        timer("decode_response (client)", decode_response, payload)
        timer.rows.append(("response MB", len(payload) / 1e6))


def best_of_three(fn, device: torch.device) -> float:
    """Seconds of `fn()`, synchronised, the best of three after a warm-up (a shared machine only adds time)."""
    fn()
    times = []
    for _ in range(3):
        synchronize(device)
        began = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return min(times)


def summarise(rows: list[tuple[str, float]]) -> list[tuple[str, float, int]]:
    merged: dict[str, list[float]] = {}
    for name, value in rows:
        key = "step (each of the steps)" if name.startswith("step ") else name
        merged.setdefault(key, []).append(value)
    return [(name, sum(values), len(values)) for name, values in merged.items()]


def time_decodes(pipe, latents: torch.Tensor, device: torch.device) -> list[tuple[str, float]]:
    """The VAE decode of the rollout's final latents at a few batch sizes (best of 3 after a warm-up), as the
    engine runs it (compiled where the engine compiles it)."""
    vae = pipe.vae
    out = []

    for chunk in sorted({4, 8, latents.shape[0]}):
        out.append((f"decode chunk {chunk}", best_of_three(
            lambda: [decode_scaled_latents(vae, latents[i : i + chunk]) for i in range(0, latents.shape[0], chunk)],
            device)))
    return out


def time_attention_backends(family, pipe, opts, device, dtype) -> list[tuple[str, float, float]]:
    """(backend, eager forward seconds at the rollout's batch, eager forward + backward at micro-batch 8) for each
    SDPA kernel: which one the engine and the trainer should run at this size."""
    shape = GenerationShape(opts.height, opts.width)
    guidance = GuidanceConfig(opts.cfg)
    transformer = pipe.transformer
    modules = {"transformer": transformer}

    def inputs(batch: int):
        prompts = [f"benchmark prompt number {i}" for i in range(batch)]
        conditioning = family.encode_prompt(pipe, prompts, " ", guidance, shape=shape)
        generators = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
        latents = family.prepare_latents(pipe, shape, generators, dtype)
        return latents, torch.full((batch,), 0.7, device=device), conditioning

    rollout_batch, micro_batch = inputs(min(opts.num_images, opts.max_batch_size)), inputs(8)

    def forward() -> None:
        with torch.no_grad():
            family.predict_velocity(modules, *rollout_batch, guidance, shape, dtype)

    def forward_backward() -> None:
        latents = micro_batch[0].detach().requires_grad_(True)
        velocity = family.predict_velocity(modules, latents, *micro_batch[1:], guidance, shape, dtype)
        velocity.float().square().mean().backward()

    rows = []
    for backend in opts.attention_backends.split(","):
        transformer.set_attention_backend(backend)
        try:
            rows.append((backend, best_of_three(forward, device), best_of_three(forward_backward, device)))
        except Exception as err:  # a kernel this device or shape lacks
            rows.append((f"{backend} ({type(err).__name__}: {str(err)[:80]})", float("nan"), float("nan")))
    transformer.reset_attention_backend()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-images", type=int, default=32)
    parser.add_argument("--samples-per-request", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cfg", type=float, default=4.5)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="per-block torch.compile, as the documented command")
    parser.add_argument("--arch-layers", type=int, default=None, help="fewer transformer blocks (CPU smoke test)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--attention-backends", default="",
                        help="comma list of diffusers attention backends to time eagerly first (e.g. native,_native_cudnn)")
    opts = parser.parse_args()
    opts.width = opts.width or opts.height
    device = torch.device(opts.device)
    dtype = parse_dtype(opts.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    family, pipe = build_sd35_medium(opts.device, dtype, num_layers=opts.arch_layers)
    if opts.attention_backends:
        print("| attention backend (eager DiT) | forward s (rollout batch, CFG doubled) | forward + backward s "
              "(8 samples, CFG doubled) |\n|---|---|---|")
        for backend, forward, both in time_attention_backends(family, pipe, opts, device, dtype):
            print(f"| {backend} | {forward:.3f} | {both:.3f} |", flush=True)
    server_args = ServerArgs(model_path="arch:sd3.5-medium", model_family="sd3", device=opts.device,
                             dtype="bf16" if dtype == torch.bfloat16 else "fp32", generator_device=opts.device,
                             max_batch_size=opts.max_batch_size, enable_torch_compile=opts.compile)
    runner = ModelRunner(server_args, loaded=(family, pipe))

    one_rollout(runner, opts, Timer(device))  # warm-up (and compilation)
    timer = Timer(device)
    began = time.perf_counter()
    one_rollout(runner, opts, timer)
    total = time.perf_counter() - began
    print(f"\none rollout, {opts.num_images} images of {opts.height}x{opts.width}, {opts.steps} steps, CFG {opts.cfg}, "
          f"requests of {opts.samples_per_request}, compile={opts.compile}, device {device}, {dtype}: {total:.3f} s")
    print("| phase | seconds | calls |\n|---|---|---|")
    for name, seconds, calls in summarise(timer.rows):
        print(f"| {name} | {seconds:.3f} | {calls} |")

    generators = [torch.Generator(device=device).manual_seed(i) for i in range(opts.num_images)]
    latents = family.prepare_latents(pipe, GenerationShape(opts.height, opts.width), generators, dtype)
    print("\n| VAE decode of the rollout's latents | seconds |\n|---|---|")
    for name, seconds in time_decodes(pipe, latents, device):
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
