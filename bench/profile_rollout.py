"""Where an engine's rollout time goes: each phase of one rollout's requests, synchronised, in one process.

    python bench/profile_rollout.py --device cuda --compile        # SD3.5-Medium size, random weights
    python bench/profile_rollout.py --device cpu --arch-layers 1 --height 64 --num-images 4 --steps 2
    python bench/profile_rollout.py --device cuda --compile --rollout-gradient 8 --profile-step  # the no-replay step
    python bench/profile_rollout.py ... --patch-group batch_invariant [--attention-backend _native_cudnn]  # as documented

The engine's own timers (`rollout/engine_*_seconds`) do not synchronise the device, so queued denoising work
shows up in whatever waits for it first (the decode). This script drives the same `ModelRunner` methods the
scheduler calls (start, step, finish) plus the wire encoding, with a device synchronise around each, and times
the VAE decode of the rollout's latents in a few layouts, so every second of the engine side is attributed.

`--rollout-gradient TILE` runs the requests as `--diffusion-rollout-gradient` does (each SDE step's forward
with autograd through per-sample LoRA rows, then its backward, a tile of samples at a time;
miles/engine/rollout_gradients.py), with random rank-`--lora-rank` factors pushed on the family's LoRA targets.
`--profile-step` puts one denoising step of the timed rollout under torch.profiler and prints its kernels by class
(matmul, attention, compiled elementwise, other) and the slowest ones, then where the device sat idle (its gaps,
the host calls they fall in, every host call that waits on the device; `--trace PATH` writes the step's Chrome
trace); on CUDA each phase's peak allocated memory is printed too.
"""

from __future__ import annotations

import argparse
import functools
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
from miles.models.opaque_kernels import install_in_blocks  # noqa: E402
from miles.testing.real_size import synchronize  # noqa: E402
from miles.types import GuidanceConfig  # noqa: E402


class Timer:
    """Each call's seconds, synchronised, and (CUDA) its peak allocated GiB, under the call's name."""

    def __init__(self, device: torch.device):
        self.device, self.rows, self.peaks = device, [], {}

    def __call__(self, name: str, fn, *args, **kwargs):
        synchronize(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        synchronize(self.device)
        self.rows.append((name, time.perf_counter() - began))
        if cuda:
            key = phase_of(name)
            self.peaks[key] = max(self.peaks.get(key, 0.0), torch.cuda.max_memory_allocated(self.device) / (1 << 30))
        return out


def phase_of(name: str) -> str:
    return "step (each of the steps)" if name.startswith("step ") else name


def requests_for(opts) -> list[GenerateRequest]:
    m = opts.samples_per_request
    return [
        GenerateRequest(prompt=f"benchmark prompt number {i}", num_samples=m, seed=1000 + i, num_steps=opts.steps,
                        guidance=GuidanceConfig(opts.cfg), height=opts.height, width=opts.width,
                        sde_step_indices=list(range(opts.steps)), request_id=str(i),
                        # as the rollout asks: no latents when nothing is replayed
                        return_latent_indices=[] if opts.rollout_gradient else list(range(opts.steps + 1)),
                        rollout_gradient=bool(opts.rollout_gradient))
        for i in range(0, opts.num_images, m)
    ]


def push_random_lora(runner: ModelRunner, rank: int) -> int:
    """Random rank-`rank` factors on every LoRA target of the transformer, handed to the engine's rollout
    gradients as the weight sync hands a pushed pair (the merged weight is left as it is: timing only)."""
    return random_lora_factors(runner.rollout_gradients, "transformer", runner.pipe.transformer,
                               runner.family.default_lora_target_modules, rank, runner.device)


def random_lora_factors(gradients, module_name: str, module: torch.nn.Module, targets, rank: int,
                        device: torch.device | str) -> int:
    """`gradients.set_factors` with random rank-`rank` factors for each Linear of `module` named by `targets`;
    returns how many layers got them."""
    generator = torch.Generator().manual_seed(0)
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear) and any(name.endswith(target) for target in targets):
            a = torch.randn(rank, layer.in_features, generator=generator) / layer.in_features ** 0.5
            b = torch.randn(layer.out_features, rank, generator=generator) * 1e-3
            gradients.set_factors(module_name, name, a.to(device), b.to(device), 1.0)
            count += 1
    return count


def one_rollout(runner: ModelRunner, opts, timer: Timer, profile_step: int | None = None,
                trace: str | None = None) -> None:
    if runner.rollout_gradients is not None:
        runner.rollout_gradients.new_weights()  # the previous rollout's kept sums (the same seeds) are dropped
    trajectories = [timer("start (encode, initial latents)", runner.start, r) for r in requests_for(opts)]
    for k in range(opts.steps):
        if k == profile_step:
            with step_profiler(runner.device) as profile:
                timer(f"step {k}", runner.step, trajectories)
            print_kernels(profile, runner.device)
            print_idle_gaps(profile)
            if trace:
                profile.export_chrome_trace(trace)
                print(f"the profiled step's trace: {trace}")
        else:
            timer(f"step {k}", runner.step, trajectories)
    for t in trajectories:
        response = timer("finish (decode + pack)", runner.finish, t)
        payload = timer("encode_response (msgpack)", encode_response, response)
        timer("decode_response (client)", decode_response, payload)
        timer.rows.append(("response MB", len(payload) / 1e6))


def step_profiler(device: torch.device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


KERNEL_CLASSES = (  # (class, substrings of a kernel's name), first match wins
    ("matmul (triton template)", ("triton_tem",)),
    ("compiled elementwise (triton)", ("triton",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "attn")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "matmul", "bmm", "addmm", "mm")),
    ("copy / cast", ("copy", "cast", "memcpy", "to_copy")),
)


def print_kernels(profile, device: torch.device, top: int = 25) -> None:
    """One step's device time by kernel class, and its slowest kernels (CPU time where there is no device)."""
    cuda = device.type == "cuda"
    events = [e for e in profile.key_averages() if (e.device_type.name == "CUDA") == cuda] if cuda else \
        list(profile.key_averages())
    attr = "device_time_total" if cuda else "self_cpu_time_total"
    classes: dict[str, float] = {}
    for event in events:
        name = event.key.lower()
        label = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
        classes[label] = classes.get(label, 0.0) + getattr(event, attr, 0.0)
    total = sum(classes.values()) or 1.0
    print(f"\none profiled step, {'device' if cuda else 'CPU self'} time by kernel class ({total / 1e6:.3f} s)")
    print("| class | seconds | share |\n|---|---|---|")
    for label, us in sorted(classes.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {us / 1e6:.3f} | {100 * us / total:.1f}% |")
    print(f"\n| slowest kernels | calls | seconds |\n|---|---|---|")
    for event in sorted(events, key=lambda e: -getattr(e, attr, 0.0))[:top]:
        print(f"| {event.key[:110]} | {event.count} | {getattr(event, attr, 0.0) / 1e6:.4f} |")


# host calls that wait on the device
SYNC_CALLS = ("synchronize", "_local_scalar_dense", "cudamemcpy", "cudaeventquery")


def idle_gaps(kernels: list[tuple[float, float]], host: list[tuple[str, float, float]], min_gap: float = 20.0):
    """Where the device waits, from one profiled stretch: `kernels` are device intervals (µs), `host` named host
    intervals. Returns (span, busy, gaps, by_name): the device's first-to-last span, the union of its kernels, the
    idle intervals of at least `min_gap` µs, and per host name the µs its events overlap those gaps (what the host
    was inside while the device had nothing to run: a wait on the device, or launches that fell behind)."""
    if not kernels:
        return 0.0, 0.0, [], {}
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    start, end = kernels[0]
    for k_start, k_end in kernels[1:]:
        if k_start > end:
            busy += end - start
            if k_start - end >= min_gap:
                gaps.append((end, k_start))
            start, end = k_start, k_end
        else:
            end = max(end, k_end)
    busy += end - start
    by_name: dict[str, float] = {}
    for name, h_start, h_end in host:
        overlap = sum(max(0.0, min(h_end, g_end) - max(h_start, g_start)) for g_start, g_end in gaps)
        if overlap > 0:
            by_name[name] = by_name.get(name, 0.0) + overlap
    return end - kernels[0][0], busy, gaps, by_name


def print_idle_gaps(profile, top: int = 15) -> None:
    """The profiled step's device idle time, its largest gaps and the host calls they fall in, and every host call
    that waits on the device (a per-tile wait leaves the device idle while the host launches the next tile)."""
    kernels, host = [], []
    for event in profile.events():
        interval = (event.time_range.start, event.time_range.end)
        if event.device_type.name == "CUDA":
            kernels.append(interval)
        else:
            host.append((event.name, *interval))
    if not kernels:
        print("\nno device kernels in the profiled step: no idle gaps to report")
        return
    span, busy, gaps, by_name = idle_gaps(kernels, host)
    idle = sum(g_end - g_start for g_start, g_end in gaps)
    print(f"\ndevice busy {busy / 1e6:.3f} s of a {span / 1e6:.3f} s span ({100 * busy / span:.1f}%); "
          f"{len(gaps)} idle gaps of ≥ 20 µs, {idle / 1e6:.3f} s in all, the largest (ms): "
          f"{', '.join(f'{(e - s) / 1e3:.2f}' for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:10])}")
    print("| host call overlapping the gaps | ms |\n|---|---|")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {name[:100]} | {us / 1e3:.2f} |")
    waits: dict[str, list[float]] = {}
    for name, h_start, h_end in host:
        if any(key in name.lower() for key in SYNC_CALLS):
            waits.setdefault(name, []).append(h_end - h_start)
    print("| host call that waits on the device | calls | ms |\n|---|---|---|")
    for name, times in sorted(waits.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name[:100]} | {len(times)} | {sum(times) / 1e3:.2f} |")


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
        merged.setdefault(phase_of(name), []).append(value)
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


def inductor_settings(items: list[str]) -> dict:
    """`--inductor KEY=VALUE` entries as a `torch._inductor.config.patch` dict, each value read as the type the
    setting has now (so a compiler knob is measured on the engine's step in one call, against a run without)."""
    import torch._inductor.config as inductor_config

    settings = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor {item!r}: expected KEY=VALUE, e.g. coordinate_descent_tuning=True")
        try:
            current = functools.reduce(getattr, key.split("."), inductor_config)
        except AttributeError:
            raise SystemExit(f"--inductor {item!r}: torch._inductor.config has no {key!r}") from None
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"--inductor {item!r}: {key} takes True or False")
            settings[key] = raw.lower() in ("true", "1")
        elif isinstance(current, (int, float)):
            settings[key] = type(current)(raw)
        else:
            settings[key] = raw
    return settings


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
    parser.add_argument("--rollout-gradient", type=int, default=0, metavar="TILE",
                        help="the requests take each sample's LoRA gradient in tiles of TILE samples (0: off)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--profile-step", action="store_true", help="torch.profiler over one step of the timed rollout")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="with --profile-step: the profiled step's Chrome trace to PATH (Perfetto reads it)")
    parser.add_argument("--attention-backends", default="",
                        help="comma list of diffusers attention backends to time eagerly first (e.g. native,_native_cudnn)")
    parser.add_argument("--patch-group", default=None,
                        help="the engine's --rollout-patch-group (e.g. batch_invariant, the documented default: fixed "
                             "forward tiles of the rollout-gradient tile or 8, one pinned attention kernel, opaque "
                             "matmuls and norms in the compiled blocks)")
    parser.add_argument("--attention-backend", default=None,
                        help="a diffusers attention backend for the engine's DiT, set after the patch group's pin "
                             "(--sglang-attention-backend), e.g. _native_cudnn")
    parser.add_argument("--opaque-kernels", action="store_true",
                        help="the batch_invariant group's opaque matmuls and norms and eager rounding in the blocks, "
                             "which an engine installs only where a trainer forward reproduces its bits (not under "
                             "the rollout gradient): what that costs")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="a torch._inductor.config setting for the compiled blocks (repeatable), e.g. "
                             "coordinate_descent_tuning=True or max_autotune_pointwise=True")
    opts = parser.parse_args()
    opts.width = opts.width or opts.height
    if opts.trace and not opts.profile_step:
        parser.error("--trace writes the profiled step's trace: add --profile-step")
    import torch._inductor.config as inductor_config

    settings = inductor_settings(opts.inductor)
    if settings:
        print(f"inductor settings: {settings}")
    with inductor_config.patch(settings):
        profile(opts)


def profile(opts: argparse.Namespace) -> None:
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
                             max_batch_size=opts.max_batch_size, enable_torch_compile=opts.compile,
                             rollout_gradient_tile=opts.rollout_gradient, rollout_patch_group=opts.patch_group,
                             forward_tile=(opts.rollout_gradient or 8) if opts.patch_group else 0,
                             attention_backend=opts.attention_backend)
    runner = ModelRunner(server_args, loaded=(family, pipe))
    if opts.opaque_kernels:  # before the first forward: the compiled blocks trace the forwards installed now
        print("opaque kernels:", install_in_blocks(
            [blocks for module in runner.modules.values() for blocks in runner.family.transformer_block_lists(module)]))
    if opts.rollout_gradient:
        layers = push_random_lora(runner, opts.lora_rank)
        print(f"rollout gradient: tiles of {opts.rollout_gradient} samples, rank-{opts.lora_rank} factors on {layers} "
              "layers")

    print(f"{time.strftime('%H:%M:%S')} warm-up rollout (and compilation) ...", flush=True)
    warm_began = time.perf_counter()
    one_rollout(runner, opts, Timer(device))  # warm-up (and compilation)
    # printed at once: a call cut short in the timed rollout still says what compiling took (the thirtieth
    # session's coordinate-descent call was cut before any line said so)
    print(f"warm-up rollout (and compilation): {time.perf_counter() - warm_began:.1f} s", flush=True)
    timer = Timer(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    began = time.perf_counter()
    one_rollout(runner, opts, timer, profile_step=opts.steps // 2 if opts.profile_step else None,
                trace=opts.trace)
    total = time.perf_counter() - began
    print(f"\none rollout, {opts.num_images} images of {opts.height}x{opts.width}, {opts.steps} steps, CFG {opts.cfg}, "
          f"requests of {opts.samples_per_request}, compile={opts.compile}, rollout gradient tile "
          f"{opts.rollout_gradient or 'off'}, patch group {opts.patch_group or 'none'}, attention "
          f"{opts.attention_backend or 'as the group or diffusers chooses'}, device {device}, {dtype}: {total:.3f} s")
    if device.type == "cuda":
        print(f"memory: {resident / (1 << 30):.2f} GiB allocated between rollouts, "
              f"{torch.cuda.max_memory_reserved(device) / (1 << 30):.2f} GiB reserved at most")
    print("| phase | seconds | calls | peak allocated GiB |\n|---|---|---|---|")
    for name, seconds, calls in summarise(timer.rows):
        peak = timer.peaks.get(name)
        print(f"| {name} | {seconds:.3f} | {calls} | {'–' if peak is None else f'{peak:.2f}'} |")

    generators = [torch.Generator(device=device).manual_seed(i) for i in range(opts.num_images)]
    latents = family.prepare_latents(pipe, GenerationShape(opts.height, opts.width), generators, dtype)
    print("\n| VAE decode of the rollout's latents | seconds |\n|---|---|")
    for name, seconds in time_decodes(pipe, latents, device):
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
