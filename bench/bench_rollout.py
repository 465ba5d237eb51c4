"""Rollout throughput: the miles engine against the naive per-prompt loop, on the same model and batch.

    python bench/bench_rollout.py --device cpu                                  # tiny SD3, a few seconds
    python bench/bench_rollout.py --device cuda --arch sd3.5-medium [--compile] # SD3.5-Medium, random weights

Both sides generate the same images (same prompts, seeds, CFG, Flow-GRPO SDE on every step, VAE decode):
- naive: `miles.testing.reference_loop.sample_reference` one prompt at a time — CFG as a doubled batch of 2,
  the math core's SDE step, decode (what the research repos do);
- engine: an in-process engine server (the real HTTP protocol on 127.0.0.1, the step-level batcher, responses
  with the training payload: latents, log-probs, conditioning) fed by concurrent requests of
  `--microgroup-size` samples.
The table gives images/s (decode included) and the time of one denoising step (one DiT forward + step kernel,
synchronised) at each side's batch size. On CUDA it also times a full weight update of the transformer from
this process into a separate engine process through `POST /update_weights_from_tensor` (CUDA IPC buckets).

`--arch sd3.5-medium` builds the SD3.5-Medium transformer from its config with random weights (2.24 B
parameters), a real-size SD3 VAE, and random text embeddings of the real shapes (333 tokens × 4096, pooled 2048):
no hub access, no text encoders. Speed does not depend on the weight values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from miles.config.flags import all_flags  # noqa: E402
from miles.engine.server_args import ServerArgs  # noqa: E402
from miles.models.common import encode_with_negative  # noqa: E402
from miles.models.sd3 import SD3TrainPipelineConfig  # noqa: E402
from miles.testing.real_size import (  # noqa: E402
    random_sd35_medium_transformer,
    random_sd35_medium_vae,
    random_text_embeddings,
    synchronize,
)
from miles.types import GuidanceConfig  # noqa: E402
from miles.utils.auth import auth_headers, ensure_run_api_key  # noqa: E402

DEFAULT_NOISE_LEVEL = all_flags()["diffusion_noise_level"].default  # the run's --diffusion-noise-level default

# ---- the random SD3.5-Medium pipeline ----------------------------------------------------------------------


class BenchPipeline:
    """The attributes of a StableDiffusion3Pipeline the SD3 family reads, without text encoders."""

    def __init__(self, transformer, vae, scheduler):
        self.transformer, self.vae, self.scheduler = transformer, vae, scheduler
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)

    @property
    def components(self) -> dict[str, Any]:
        return {"transformer": self.transformer, "vae": self.vae, "scheduler": self.scheduler}

    def to(self, device):
        self.transformer.to(device)
        self.vae.to(device)
        return self


class RandomTextSD3(SD3TrainPipelineConfig):
    """SD3 with random prompt embeddings of the real shapes, deterministic per prompt."""

    def encode_prompt(self, pipe, prompts: Sequence[str], negative_prompt, guidance: GuidanceConfig, *, shape=None):
        device, dtype = pipe.transformer.device, pipe.transformer.dtype

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            pairs = [random_text_embeddings(text, device, dtype) for text in batch]
            return {
                "prompt_embeds": torch.cat([p[0] for p in pairs]),
                "pooled_prompt_embeds": torch.cat([p[1] for p in pairs]),
            }

        return encode_with_negative(encode, prompts, negative_prompt or "", self.uses_cfg(guidance))


def build_sd35_medium(
    device: str, dtype: torch.dtype, seed: int = 0, num_layers: int | None = None
) -> tuple[RandomTextSD3, BenchPipeline]:
    """`num_layers` < 24 keeps the real widths with fewer blocks (a quick CPU smoke test of this path)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    transformer = random_sd35_medium_transformer(device, dtype, num_layers)
    vae = random_sd35_medium_vae(device, dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    transformer.eval().requires_grad_(False)
    vae.eval().requires_grad_(False)
    return RandomTextSD3(), BenchPipeline(transformer, vae, scheduler)


def build_engine_pipeline(server_args: ServerArgs):
    """`--pipeline-builder-path bench.bench_rollout:build_engine_pipeline` with
    `--model-path arch:sd3.5-medium[:num_layers]`."""
    from miles.models.common import parse_dtype

    arch, _, layers = server_args.model_path.removeprefix("arch:").partition(":")
    if arch != "sd3.5-medium":
        raise ValueError(f"unknown bench arch {arch!r}")
    device = "cuda" if server_args.device in ("auto", "cuda") else server_args.device
    return build_sd35_medium(device, parse_dtype(server_args.dtype), num_layers=int(layers) if layers else None)


def build_tiny(device: str, dtype: torch.dtype):
    from miles.testing.make_tiny import build_tiny_pipeline

    path = build_tiny_pipeline("sd3", os.path.join(tempfile.gettempdir(), "miles-bench-tiny-sd3"))
    family = SD3TrainPipelineConfig()
    return family, family.load_pipeline(path, dtype, device), path


# ---- measurements ------------------------------------------------------------------------------------------


def run_naive(family, pipe, prompts, seeds, opts, device) -> float:
    """Seconds for all images, one prompt at a time."""
    from miles.diffusion.sde import build_sde_backend
    from miles.models.base import GenerationShape
    from miles.testing.reference_loop import sample_reference

    backend = build_sde_backend("sde", DEFAULT_NOISE_LEVEL, False)
    shape = GenerationShape(opts.height, opts.width)
    began = time.perf_counter()
    for prompt, seed in zip(prompts, seeds):
        sample_reference(family, pipe, [prompt], seeds=[seed], num_steps=opts.steps, shape=shape,
                         guidance=GuidanceConfig(opts.cfg), negative_prompt=" ", dtype=opts.dtype,
                         sde_backend=backend, generator_device=str(device))
    synchronize(device)
    return time.perf_counter() - began


def time_step(family, modules, latents, conditioning, guidance, shape, dtype, device, repeats: int) -> float:
    """Seconds of one denoising step (forward + SDE kernel) at this batch, synchronised, best of `repeats`
    (the minimum: a shared machine only ever adds time)."""
    from miles.diffusion.sde import build_sde_backend

    backend = build_sde_backend("sde", DEFAULT_NOISE_LEVEL, False)
    batch = latents.shape[0]
    sigma = torch.full((batch,), 0.8, device=device)
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        began = time.perf_counter()
        with torch.no_grad():
            velocity = family.predict_velocity(modules, latents, sigma, conditioning, guidance, shape, dtype)
            backend.sample(latents, velocity, sigma, sigma - 0.1, 0.9, generators)
        synchronize(device)
        times.append(time.perf_counter() - began)
    return min(times[1:])


def run_engine(runner, prompts, seeds, opts) -> tuple[float, dict]:
    """Seconds for all images through the in-process HTTP engine, requests of `microgroup_size` samples."""
    import aiohttp

    from miles.engine.launcher import BackgroundLoop
    from miles.engine.protocol import GenerateRequest, decode_response, encode_request
    from miles.engine.server import EngineServer

    loop = BackgroundLoop()
    server = EngineServer(runner.server_args, runner=runner)
    url = loop.run(server.start())
    m = opts.microgroup_size
    requests = [
        GenerateRequest(prompt=prompts[i], num_samples=min(m, len(prompts) - i), seed=seeds[i], num_steps=opts.steps,
                        guidance=GuidanceConfig(opts.cfg), height=opts.height, width=opts.width,
                        sde_step_indices=list(range(opts.steps)), return_latent_indices=list(range(opts.steps + 1)),
                        request_id=str(i))
        for i in range(0, len(prompts), m)
    ]

    async def burst() -> None:
        async with aiohttp.ClientSession(headers=auth_headers()) as session:
            async def one(request):
                async with session.post(f"{url}/rollout/generate", data=encode_request(request)) as response:
                    assert response.status == 200, await response.text()
                    decode_response(await response.read())
            await asyncio.gather(*(one(r) for r in requests))

    try:
        began = time.perf_counter()
        asyncio.run(burst())
        seconds = time.perf_counter() - began
        counters = server.scheduler.counters.as_dict()
    finally:
        loop.run(server.stop())
        loop.close()
    return seconds, counters


def time_weight_update(opts) -> dict[str, float]:
    """Full transformer update (bf16) from this process into a separate engine process, through the endpoint."""
    from miles.engine.launcher import launch_engine
    from miles.engine.weight_sync import push_weights

    layers = f":{opts.arch_layers}" if opts.arch_layers else ""
    device = opts.device
    args = ServerArgs(model_path=f"arch:sd3.5-medium{layers}", pipeline_builder_path="bench.bench_rollout:build_engine_pipeline",
                      device=device, dtype="bf16" if opts.dtype == torch.bfloat16 else "fp32", generator_device=device,
                      model_family="sd3")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python_path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    engine = launch_engine(args, env={"PYTHONPATH": python_path}, startup_timeout=300)
    try:
        _, pipe = build_sd35_medium(device, opts.dtype, seed=1, num_layers=opts.arch_layers)
        named = [(f"transformer.{name}", p) for name, p in pipe.transformer.named_parameters()]
        total = sum(p.numel() * p.element_size() for _, p in named)
        times = []
        for version in range(1, opts.update_repeats + 2):
            synchronize(device)
            stats = push_weights([engine.url], named, bucket_bytes=opts.bucket_mb << 20, weight_version=version)
            times.append(stats["seconds"])
        # proof that the engine now holds exactly these weights (one module digest; slow for 4.5 GB on CPU)
        if opts.verify_checksum:
            import json
            import urllib.request

            from miles.engine.weight_sync import named_tensor_checksums

            request = urllib.request.Request(f"{engine.url}/weights_checksum", headers=auth_headers())
            with urllib.request.urlopen(request, timeout=600) as response:
                engine_sums = json.loads(response.read())["checksums"]
            if engine_sums != named_tensor_checksums(named):
                raise RuntimeError("the engine's weights differ from the pushed ones after the update")
        del pipe
        return {"bytes": total, "first": times[0], "median": statistics.median(times[1:]), "min": min(times[1:]),
                "buckets": stats["num_buckets"]}
    finally:
        engine.stop()


# ---- main --------------------------------------------------------------------------------------------------


def main() -> None:
    ensure_run_api_key()  # the engines this benchmark starts (in-process or as children) require a key
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--arch", default=None, help="sd3.5-medium (random weights); default: tiny sd3")
    parser.add_argument("--num-images", type=int, default=None, help="default: 16 (cuda) / 8 (cpu)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cfg", type=float, default=4.5)
    parser.add_argument("--height", type=int, default=None, help="default: 512 (sd3.5-medium) / 32 (tiny)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--microgroup-size", type=int, default=4, help="samples per engine request")
    parser.add_argument("--max-batch-size", type=int, default=32, help="engine: samples per DiT forward")
    parser.add_argument("--compile", action="store_true", help="engine: torch.compile the DiT forward")
    parser.add_argument("--compile-mode", default="default", help="engine: torch.compile mode")
    parser.add_argument("--attention-backend", default=None,
                        help="engine: diffusers attention backend, e.g. _native_cudnn / _native_flash")
    parser.add_argument("--dtype", default=None, help="bf16 / fp32; default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--arch-layers", type=int, default=None, help="fewer transformer blocks (smoke tests)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-update bucket size")
    parser.add_argument("--verify-checksum", action="store_true", help="checksum the engine after the update")
    parser.add_argument("--update-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU: torch intra-op threads (1 keeps timings stable on a shared machine)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per path; the best one is reported")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--skip-weight-update", action="store_true")
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from miles.engine.model_runner import ModelRunner
    from miles.models.base import GenerationShape
    from miles.models.common import parse_dtype

    device = torch.device(opts.device)
    big = opts.arch is not None
    if big and opts.arch != "sd3.5-medium":
        parser.error(f"--arch {opts.arch!r}: only sd3.5-medium is known")
    opts.dtype = parse_dtype(opts.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    opts.num_images = opts.num_images or (16 if device.type == "cuda" else 8)
    opts.height = opts.height or (512 if big else 32)
    opts.width = opts.width or opts.height
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(opts.threads)

    setup_began = time.perf_counter()
    if big:
        family, pipe = build_sd35_medium(opts.device, opts.dtype, num_layers=opts.arch_layers)
        model_path = "arch:sd3.5-medium"
    else:
        family, pipe, model_path = build_tiny(opts.device, opts.dtype)
    server_args = ServerArgs(model_path=model_path, model_family="sd3", device=opts.device,
                             dtype="bf16" if opts.dtype == torch.bfloat16 else "fp32", generator_device=opts.device,
                             max_batch_size=opts.max_batch_size, batch_wait_ms=20.0,
                             enable_torch_compile=opts.compile, torch_compile_mode=opts.compile_mode,
                             attention_backend=opts.attention_backend)
    runner = ModelRunner(server_args, loaded=(family, pipe))
    print(f"setup {time.perf_counter() - setup_began:.1f}s; model {model_path}; device {device}; dtype {opts.dtype}; "
          f"{opts.num_images} images of {opts.height}x{opts.width}, {opts.steps} steps, CFG {opts.cfg}", flush=True)

    prompts = [f"benchmark prompt number {i}" for i in range(opts.num_images)]
    seeds = list(range(1000, 1000 + opts.num_images))
    shape = GenerationShape(opts.height, opts.width)
    guidance = GuidanceConfig(opts.cfg)
    modules = {"transformer": pipe.transformer}

    # warm-up (and compilation) on both paths, then the timed runs
    warm_n = min(len(prompts), opts.max_batch_size)
    run_engine(runner, prompts[:warm_n], seeds[:warm_n], opts)
    engine_runs = [run_engine(runner, prompts, seeds, opts) for _ in range(opts.repeats)]
    engine_seconds, counters = min(engine_runs, key=lambda run: run[0])
    rows = []
    engine_batch = min(opts.max_batch_size, opts.num_images)
    cond = family.encode_prompt(pipe, prompts[:engine_batch], " ", guidance, shape=shape)
    lat = family.prepare_latents(pipe, shape, [torch.Generator(device=device).manual_seed(s) for s in seeds[:engine_batch]],
                                 opts.dtype)
    engine_step = time_step(family, runner.forward_modules, lat, cond, guidance, shape, opts.dtype, device, 5)
    if not opts.skip_naive:
        run_naive(family, pipe, prompts[:1], seeds[:1], opts, device)  # warm-up
        naive_seconds = min(run_naive(family, pipe, prompts, seeds, opts, device) for _ in range(opts.repeats))
        naive_step = time_step(family, modules, lat[:1], {k: v[:1] for k, v in cond.items()}, guidance, shape,
                               opts.dtype, device, 5)
        rows.append(("naive loop (per prompt)", naive_seconds, naive_step, 1))
    label = "engine" + (f" + compile({opts.compile_mode})" if opts.compile else "")
    label += f" + attn {opts.attention_backend}" if opts.attention_backend else ""
    rows.append((f"{label} (HTTP, batched)", engine_seconds, engine_step, engine_batch))

    naive_ips = opts.num_images / rows[0][1] if not opts.skip_naive else None
    print()
    print("| path | images | seconds | images/s | step ms (batch) | step ms per image | speedup |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds, step, batch in rows:
        ips = opts.num_images / seconds
        speedup = f"{ips / naive_ips:.2f}x" if naive_ips else "-"
        print(f"| {name} | {opts.num_images} | {seconds:.2f} | {ips:.2f} | {step * 1e3:.1f} ({batch}) | "
              f"{step * 1e3 / batch:.2f} | {speedup} |")
    print(f"\nengine counters: forward batches {counters['forward_batches']}, largest forward "
          f"{counters['max_forward_samples']} samples (x2 with CFG), step time {counters['step_seconds']:.2f}s, "
          f"decode+pack {counters['decode_seconds']:.2f}s")

    if big and not opts.skip_weight_update:
        del runner, pipe, family
        torch.cuda.empty_cache()
        update = time_weight_update(opts)
        transport = "CUDA IPC" if device.type == "cuda" else "shared memory"
        print(f"\nweight update (transformer, {update['bytes'] / 1e9:.2f} GB {opts.dtype}, {update['buckets']} buckets of "
              f"{opts.bucket_mb} MiB, {transport} into another process through the endpoint): "
              f"median {update['median'] * 1e3:.1f} ms, min {update['min'] * 1e3:.1f} ms, first {update['first'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
