"""The plain single-process Flow-GRPO loop that bench_e2e.py measures `train_diffusion.py` against.

`two-pass` is what a competent user writes from the libraries' docs: the diffusers pipeline in bf16, prompts
batched, CFG as one doubled batch, LoRA through PEFT (or every parameter in fp32 with bf16 autocast), fused AdamW,
the SDE step and log-prob of `miles.diffusion.sde`; the rollout denoises the whole batch without gradients, then
the trainer replays every trained step in micro-batches, forward and backward. `compiled` adds diffusers'
regional compilation (`.compile()` on each transformer block and on the VAE decoder).

`fused` (LoRA only) is an experiment on issue 26's floor, not something users write: with one optimizer step per
rollout the ratio π_θ/π_old is exactly 1 when the gradient is taken, so the clipped loss's gradient is
−A_b·∇ℓ_{b,k} for every pair and the trainer's replay forward only recomputes what the rollout computed. The
fused loop keeps the rollout's activations instead: it denoises in chunks with gradients on, runs each chunk's
backward of Σ_b ℓ_{b,k} at once, and lets each sample's gradient land in its own copy of the adapter (a
per-sample LoRA, ≈ 2 forwards' FLOPs per pair in all instead of 3). When the rewards are in, the policy
gradient is Σ_b (−clip(A_b) / pairs)·G_b: the same gradient as the two-pass loop's, with no replay.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

LORA_RANK, LORA_ALPHA, ADV_CLIP, CLIP_RANGE, LR = 32, 64, 5.0, 1e-4, 1e-5


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class PlainLoop:
    pipe: Any
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    sde: Any
    sigmas: torch.Tensor
    dtype: torch.dtype
    device: str
    steps: int
    trained_steps: int
    guidance: float
    height: int
    width: int
    per_sample: "PerSampleLoRA | None" = None

    @property
    def transformer(self):
        return self.pipe.transformer

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device == "cuda" else contextlib.nullcontext()


def build(opts, checkpoint: str, lora: bool, compiled: bool, fused: bool = False) -> PlainLoop:
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig

    from miles.diffusion.sde import build_sde_backend
    from miles.models.sd3 import SD3_LORA_TARGETS

    if fused and not lora:
        raise SystemExit("--plain-modes fused: LoRA only (a per-sample copy of every weight does not fit)")
    device = opts.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = StableDiffusion3Pipeline.from_pretrained(checkpoint, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    if lora:
        transformer.requires_grad_(False)
        transformer.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights="gaussian",
                                           target_modules=list(SD3_LORA_TARGETS)))
        for param in transformer.parameters():
            if param.requires_grad:
                param.data = param.data.float()  # adapters in fp32, the frozen base in bf16
    else:
        transformer.float().requires_grad_(True)  # fp32 master weights, bf16 autocast
    samples = opts.prompts * opts.samples
    per_sample = PerSampleLoRA(transformer, samples) if fused else None
    if compiled:
        # diffusers' regional compilation: each repeated block compiled in place, and the VAE decoder. The
        # dynamo cache limit is raised as its docs advise when a loop sees several shapes (rollout and train
        # batches, with and without grad): without it dynamo falls back to eager after 8 graphs.
        torch._dynamo.config.cache_size_limit = 64
        for block in transformer.transformer_blocks:
            block.compile()
        pipe.vae.decoder.compile()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=device == "cuda")
    pipe.scheduler.set_timesteps(opts.steps, device=device)
    return PlainLoop(pipe, params, optimizer, build_sde_backend("sde", opts.noise_level, False),
                     pipe.scheduler.sigmas.float(), dtype, device, opts.steps, opts.trained_steps or opts.steps,
                     opts.guidance, opts.height, opts.width, per_sample)


# ---------------------------------------------------------------------------------------------------------
# one rollout's inputs, the CFG velocity, the decode and the reward (shared by both loops)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class RolloutInputs:
    text: torch.Tensor  # [2N, ...]: the negative prompts' embeddings, then the prompts'
    pooled: torch.Tensor
    generators: list[torch.Generator]
    noise: torch.Tensor  # [N, C, h, w]

    def text_of(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.generators)
        rows = torch.cat([torch.arange(start, end), torch.arange(n + start, n + end)]).to(self.text.device)
        return self.text[rows], self.pooled[rows]


@torch.no_grad()
def rollout_inputs(loop: PlainLoop, prompts: list[str], samples: int, iteration: int) -> RolloutInputs:
    pipe, device = loop.pipe, loop.device
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
        prompts, None, None, negative_prompt=[""] * len(prompts), do_classifier_free_guidance=True,
        num_images_per_prompt=samples, device=device)
    generators = [torch.Generator(device).manual_seed(1000 * iteration + b) for b in range(len(prompts) * samples)]
    factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    shape = (loop.transformer.config.in_channels, loop.height // factor, loop.width // factor)
    noise = torch.stack([torch.randn(shape, generator=g, device=device) for g in generators])
    return RolloutInputs(torch.cat([negative, embeds]), torch.cat([negative_pooled, pooled]), generators, noise)


def velocity(loop: PlainLoop, x: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor):
    """CFG as one doubled batch: rows [uncond; cond] of the same samples."""
    x2 = torch.cat([x, x])
    timestep = (sigma * 1000).expand(x.shape[0]).repeat(2)  # sigma: one value, or one per sample
    with loop.autocast():
        out = loop.transformer(hidden_states=x2.to(loop.dtype), timestep=timestep, encoder_hidden_states=text,
                               pooled_projections=pooled, return_dict=False)[0].float()
    uncond, cond = out.chunk(2)
    return uncond + loop.guidance * (cond - uncond)


def sde_step(loop: PlainLoop, k: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = loop.sigmas
    return s[k].expand(batch), s[k + 1].expand(batch), s[1].expand(batch)


@torch.no_grad()
def decode_and_score(loop: PlainLoop, x: torch.Tensor, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images, and group-normalised advantages of the built-in `brightness` reward."""
    vae = loop.pipe.vae
    images = vae.decode((x / vae.config.scaling_factor + vae.config.shift_factor).to(vae.dtype)).sample
    images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    grouped = (images.float().mean(dim=(1, 2, 3)) / 255).view(-1, samples)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    return images, advantages


def optimizer_step(loop: PlainLoop) -> None:
    torch.nn.utils.clip_grad_norm_(loop.params, 1.0)
    loop.optimizer.step()


# ---------------------------------------------------------------------------------------------------------
# the two-pass loop: rollout without gradients, then the replay in micro-batches
# ---------------------------------------------------------------------------------------------------------
def two_pass_gradients(loop: PlainLoop, inputs: RolloutInputs, samples: int, micro_batch: int) -> dict[str, float]:
    """The rollout, the reward, then every trained pair replayed; leaves the policy gradient in `.grad`."""
    from miles.diffusion.losses import policy_loss

    t0 = time.perf_counter()
    n_samples = len(inputs.generators)
    with torch.no_grad():
        x = inputs.noise
        trajectory, log_probs = [x], []
        for k in range(loop.steps):
            v = velocity(loop, x, loop.sigmas[k], inputs.text, inputs.pooled)
            out = loop.sde.sample(x, v, *sde_step(loop, k, n_samples), inputs.generators)
            x = out.next_latents
            trajectory.append(x)
            log_probs.append(out.log_prob)
        _, advantages = decode_and_score(loop, x, samples)
    sync(loop.device)
    t1 = time.perf_counter()
    loop.optimizer.zero_grad(set_to_none=True)
    pairs = [(b, k) for b in range(n_samples) for k in range(loop.trained_steps)]
    for start in range(0, len(pairs), micro_batch):
        chunk = pairs[start : start + micro_batch]
        b_idx = torch.tensor([b for b, _ in chunk], device=loop.device)
        k_idx = [k for _, k in chunk]
        xs = torch.stack([trajectory[k][b] for b, k in chunk])
        xs_next = torch.stack([trajectory[k + 1][b] for b, k in chunk])
        sig = loop.sigmas[k_idx]
        text = torch.cat([inputs.text[:n_samples][b_idx], inputs.text[n_samples:][b_idx]])
        pooled = torch.cat([inputs.pooled[:n_samples][b_idx], inputs.pooled[n_samples:][b_idx]])
        v = velocity(loop, xs, sig, text, pooled)
        new = loop.sde.log_prob(xs, v, xs_next, sig, loop.sigmas[[k + 1 for k in k_idx]],
                                loop.sigmas[1].expand(len(chunk))).log_prob
        old = torch.stack([log_probs[k][b] for b, k in chunk])
        loss, _ = policy_loss(new, old, advantages[b_idx], CLIP_RANGE, ADV_CLIP)
        (loss.sum() / len(pairs)).backward()
    sync(loop.device)
    return {"rollout": t1 - t0, "train": time.perf_counter() - t1}


# ---------------------------------------------------------------------------------------------------------
# the fused loop: each sample's ∇ℓ taken during the rollout, in its own copy of the adapter
# ---------------------------------------------------------------------------------------------------------
class PerSampleLoRA:
    """Every PEFT LoRA layer of `transformer` forwards through per-sample copies of its factors. All factors of all
    layers live in one flat fp32 leaf per chunk of samples ([chunk, P]: each layer's A then B), and a forward's
    layers take views of the selected chunk's leaf: one backward over the chunk leaves ∇ of each sample's term in
    that sample's row (samples do not interact in a DiT forward), accumulated over the rollout's steps."""

    def __init__(self, transformer: torch.nn.Module, samples: int):
        from peft.tuners.lora.layer import Linear as LoraLinear

        self.layers = [m for m in transformer.modules() if isinstance(m, LoraLinear)]
        self.samples = samples
        self.leaves: list[torch.Tensor] = []  # one [chunk, P] leaf per chunk of the rollout (`load`)
        self.chunk = samples
        for layer in self.layers:
            layer.per_sample = None  # (A rows, B rows) of the current forward
            layer.forward = functools.partial(_per_sample_lora_forward, layer)

    @staticmethod
    def factor(layer, which: str) -> torch.nn.Parameter:
        return getattr(layer, f"lora_{which}")[layer.active_adapters[0]].weight

    def factors(self) -> list[torch.nn.Parameter]:
        return [self.factor(layer, which) for layer in self.layers for which in ("A", "B")]

    def numel(self) -> int:
        return self.samples * sum(f.numel() for f in self.factors())

    @torch.no_grad()
    def load(self, chunk: int) -> None:
        """Every sample's copy := the adapter as it is now, in leaves of `chunk` samples; gradients cleared."""
        flat = torch.cat([f.detach().float().reshape(-1) for f in self.factors()])
        self.chunk = chunk
        self.leaves = [flat.unsqueeze(0).repeat(chunk, 1).requires_grad_(True)
                       for _ in range(self.samples // chunk)]

    def select(self, start: int, end: int) -> None:
        """The next forward's samples are start..end-1: whole chunks (their leaves, in order)."""
        rows = torch.cat(self.leaves[start // self.chunk : end // self.chunk])
        parts = torch.split(rows, [f.numel() for f in self.factors()], dim=1)
        for index, layer in enumerate(self.layers):
            a, b = self.factor(layer, "A"), self.factor(layer, "B")
            layer.per_sample = (parts[2 * index].view(-1, *a.shape), parts[2 * index + 1].view(-1, *b.shape))

    @torch.no_grad()
    def write_gradient(self, coefficients: torch.Tensor) -> None:
        """adapter.grad := Σ_s coefficients[s]·∇_s (each sample's accumulated gradient)."""
        grads = torch.cat([leaf.grad for leaf in self.leaves])  # [S, P]
        total = coefficients.to(grads) @ grads
        for factor, part in zip(self.factors(), torch.split(total, [f.numel() for f in self.factors()])):
            factor.grad = part.view(factor.shape).to(factor.dtype)


def _per_sample_lora_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """y = W x + s·B_b A_b x for each row's sample b (PEFT's vanilla LoRA, dropout 0, one adapter); CFG's doubled
    batch repeats the samples."""
    result = layer.base_layer(x, *args, **kwargs)
    a, b = layer.per_sample
    copies = x.shape[0] // a.shape[0]
    rows = x.reshape(x.shape[0], -1, x.shape[-1])
    compute = torch.bfloat16 if torch.is_autocast_enabled() else rows.dtype
    a, b = a.to(compute).repeat(copies, 1, 1), b.to(compute).repeat(copies, 1, 1)
    low = torch.bmm(torch.bmm(rows.to(compute), a.transpose(1, 2)), b.transpose(1, 2))
    scaling = layer.scaling[layer.active_adapters[0]]
    return result + (low * scaling).reshape(result.shape).to(result.dtype)


def fused_gradients(loop: PlainLoop, inputs: RolloutInputs, samples: int, chunk: int) -> dict[str, float]:
    """The rollout with each trained step's backward taken at once, the reward, then the policy gradient as the
    advantage-weighted sum of the per-sample gradients; leaves it in the adapter's `.grad`."""
    from miles.diffusion.losses import rollout_gradient_coefficients

    per_sample = loop.per_sample
    n_samples = len(inputs.generators)
    if n_samples % chunk:
        raise SystemExit(f"--fused-chunk {chunk}: must divide the {n_samples} samples of a rollout")
    t0 = time.perf_counter()
    loop.optimizer.zero_grad(set_to_none=True)
    per_sample.load(chunk)
    x = inputs.noise
    for k in range(loop.steps):
        if k >= loop.trained_steps:  # an untrained step: the whole batch, no gradients
            with torch.no_grad():
                per_sample.select(0, n_samples)
                v = velocity(loop, x, loop.sigmas[k], inputs.text, inputs.pooled)
                x = loop.sde.sample(x, v, *sde_step(loop, k, n_samples), inputs.generators).next_latents
            continue
        nexts = []
        for start in range(0, n_samples, chunk):
            end = start + chunk
            per_sample.select(start, end)
            v = velocity(loop, x[start:end], loop.sigmas[k], *inputs.text_of(start, end))
            with torch.no_grad():
                step = loop.sde.sample(x[start:end], v, *sde_step(loop, k, chunk), inputs.generators[start:end])
            log_prob = loop.sde.log_prob(x[start:end], v, step.next_latents, *sde_step(loop, k, chunk)).log_prob
            log_prob.sum().backward()  # each sample's ∇ℓ_{b,k} into its own adapter copy
            nexts.append(step.next_latents)
        x = torch.cat(nexts)
    _, advantages = decode_and_score(loop, x, samples)
    sync(loop.device)
    t1 = time.perf_counter()
    # the clipped loss at ρ = 1: ∇ Σ_pairs L / pairs = Σ_b c_b·Σ_k ∇ℓ_{b,k}, c_b = −clip(A_b) / pairs
    pairs = torch.full((n_samples,), loop.trained_steps)
    per_sample.write_gradient(rollout_gradient_coefficients(advantages.float().cpu(), pairs, ADV_CLIP))
    sync(loop.device)
    return {"rollout": t1 - t0, "train": time.perf_counter() - t1}


# ---------------------------------------------------------------------------------------------------------
# a measured run
# ---------------------------------------------------------------------------------------------------------
def outside_allocator_bytes() -> int:
    """This process's device memory the caching allocator does not hold (its CUDA context and loaded kernel
    modules): the device's used bytes less the allocator's reserve, read while no other process uses the device."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def run(opts, checkpoint: str, prompts: list[str], lora: bool, mode: str) -> dict:
    """`mode`: eager, compiled (two-pass) or fused (compiled on CUDA, LoRA only). Returns bench_e2e's row."""
    started = time.perf_counter()
    if opts.device == "cuda":  # an earlier row's peak is not this one's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fused = mode == "fused"
    loop = build(opts, checkpoint, lora, compiled=mode == "compiled" or (fused and opts.device == "cuda"),
                 fused=fused)
    if fused:
        print(f"  plain fused: {loop.per_sample.numel() / 1e6:.1f} M per-sample adapter values "
              f"({len(loop.per_sample.layers)} LoRA layers x {opts.prompts * opts.samples} samples)", flush=True)
    timings = []
    for iteration in range(opts.iterations):
        t0 = time.perf_counter()
        inputs = rollout_inputs(loop, prompts, opts.samples, iteration)
        encoded = time.perf_counter() - t0
        if fused:
            phases = fused_gradients(loop, inputs, opts.samples, opts.fused_chunk or opts.micro_batch_size)
        else:
            phases = two_pass_gradients(loop, inputs, opts.samples, opts.micro_batch_size)
        t_step = time.perf_counter()
        optimizer_step(loop)
        sync(loop.device)
        phases["train"] += time.perf_counter() - t_step
        phases["rollout"] += encoded  # the prompts' encoding and the initial noise belong to the rollout
        timings.append({**phases, "iteration": time.perf_counter() - t0})
        print(f"  plain {mode} {'lora' if lora else 'full'} iteration {iteration}: " +
              " ".join(f"{k}={v:.2f}" for k, v in timings[-1].items()), flush=True)
    # the job's device memory as a user's one process holds it: the allocator's peak and the CUDA context (read
    # now, with every kernel module the run loaded), as bench_e2e's device-wide poll counts the framework's processes
    peak = (torch.cuda.max_memory_reserved() + outside_allocator_bytes()) / (1 << 30) if opts.device == "cuda" else None
    first_iteration = timings[0]["iteration"]
    del loop
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    steady = timings[1:] or timings
    return {
        "iteration": sum(t["iteration"] for t in steady) / len(steady),
        "phases": {k: sum(t[k] for t in steady) / len(steady) for k in ("rollout", "train")},
        "unaccounted": 0.0,
        "peak_gib": peak,
        "startup": time.perf_counter() - started - sum(t["iteration"] for t in timings),
        "first_iteration": first_iteration,
    }
