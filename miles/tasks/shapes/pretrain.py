"""Pretrain a `shapes` base model on the renderer's images: on CPU deterministically, or on a GPU.

    python -m miles.tasks.shapes.pretrain --out DIR       # the small CPU base, bit for bit (~20 min, 2 cores)
    bash scripts/shapes_gpu_pretrain.sh DIR               # the shipped base (`--size wide`, one GPU, ~7 min)

Three stages, each seeded (`--seed`), on CPU single-threaded for bitwise repeatability (`torch.set_num_threads(1)`
unless `--threads`; GPU kernels and `--max-seconds` are not repeatable bit for bit):

1. data: `--images-per-scene` renders of every train scene of `split_scenes` (never a held-out one), at the
   model's image size; a seeded `--stray-fraction` of them (`STRAY_FRACTION`) carry one small **stray
   object** the prompt did not ask for (`render(..., stray=True)`). That is the base's deliberate,
   prompt-independent flaw: it learns to add a stray to about that fraction of its images, on any prompt, a
   defect the scorer penalises and RL (or SFT on the clean renders) can remove on every prompt at once;
2. VAE: the AutoencoderKL trained as a plain autoencoder (posterior mean, L2 reconstruction in [-1, 1], a
   small KL term keeping the latents near a unit Gaussian) for `--vae-steps` (1200: its reconstructions of
   the renders then score 1.0; 200 scored 0.78); then `shift_factor` and `scaling_factor` are set to the
   latents' mean and 1/std, as SD3's are;
3. denoiser: the transformer trained by flow matching (docs/algorithms.md §1, §7) on the cached latents, with
   the random text encoders frozen and each prompt encoded once (`--train-text` trains them jointly, with the
   same AdamW and EMA: no better held-out score at 6000 steps and 1.6× the time per step, docs/shapes.md): σ
   from SD3.5's shifted uniform
   schedule, x_σ = (1 − σ)·x0 + σ·ε, loss ‖v_θ(x_σ, σ, c) − (ε − x0)‖²; 10 % of the prompts dropped to the
   empty prompt so that guidance is possible. The saved weights are the exponential moving average of the
   trained ones (decay `EMA_DECAY`), which samples cleaner shapes than the last iterate. `--dit-steps` sets
   how much it learns (held-out scores per step count in docs/shapes.md).

The pipeline is saved with `save_pretrained` (safetensors) into `--out`, the layout of a real SD3 checkpoint.
A SIGTERM while the denoiser trains (a `timeout`, the end of a scheduler's job) stops it after its step and saves
what it learned so far, with a warning in the log: a GPU call that ran out of time lost its whole pretraining.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from miles.tasks.shapes.model import LARGE, SMALL, WIDE, ModelSize, build_untrained_pipeline
from miles.tasks.shapes.render import render
from miles.tasks.shapes.score import score_scene
from miles.tasks.shapes.spec import split_scenes

logger = logging.getLogger(__name__)
SIZES = {"small": SMALL, "wide": WIDE, "large": LARGE}
CONDITION_DROPOUT = 0.1
EMA_DECAY = 0.999
STRAY_FRACTION = 0.5  # of the pretraining images carry one stray object: the base's systematic flaw


def _render_one(job: tuple) -> np.ndarray:
    scene, size, seed, stray = job
    return render(scene, size, seed=seed, stray=stray)


def render_dataset(size: int, images_per_scene: int, seed: int, stray_fraction: float = 0.0,
                   workers: int = 1) -> tuple[torch.Tensor, list[str]]:
    """([N, 3, size, size] in [-1, 1], the N prompts), train scenes only; each image has a stray object
    (`render(..., stray=True)`) with probability `stray_fraction` (a seeded draw per image). `workers` > 1
    renders in that many processes (the same images: each has its own seed); 128 px takes ~14 ms an image."""
    train, _ = split_scenes(seed=0)
    strays = np.random.default_rng(seed).random(images_per_scene * len(train)) < stray_fraction
    jobs = [(scene, size, seed * 1_000_003 + copy * 10_007 + index, bool(strays[copy * len(train) + index]))
            for copy in range(images_per_scene) for index, scene in enumerate(train)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            images = list(pool.map(_render_one, jobs, chunksize=64))
    else:
        images = [_render_one(job) for job in jobs]
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    return pixels, [scene.prompt() for scene, *_ in jobs]


@torch.no_grad()
def vae_roundtrip_score(vae, size: int, count: int = 64) -> float:
    """The scorer's mean 0/1 on the VAE's reconstructions of clean renders of `count` train scenes: how much of
    the task the autoencoder alone can carry (1.0 when it reconstructs every object's colour and shape)."""
    train, _ = split_scenes(seed=0)
    scenes = train[:: max(1, len(train) // count)][:count]
    pixels = torch.from_numpy(np.stack([render(scene, size, seed=index) for index, scene in enumerate(scenes)]))
    batch = pixels.permute(0, 3, 1, 2).float().div(127.5).sub(1.0).to(vae.device)
    decoded = vae.decode(vae.encode(batch).latent_dist.mean).sample
    images = decoded.clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return float(np.mean([score_scene(scene, image).correct for scene, image in zip(scenes, images)]))


@dataclass(frozen=True)
class DenoiserSchedule:
    """How long the denoiser trains and its learning rate over that time. Training stops after `steps` or
    `max_seconds` (if set), whichever comes first; `cosine` decays the rate to zero over the same horizon
    (progress = the larger of the two fractions), after a linear warm-up over the first `warmup` of it."""
    steps: int = 16000
    lr: float = 1e-3
    shape: str = "constant"  # or "cosine"
    warmup: float = 0.0
    max_seconds: float | None = None

    def progress(self, step: int, elapsed: float) -> float:
        fraction = step / self.steps
        if self.max_seconds:
            fraction = max(fraction, elapsed / self.max_seconds)
        return min(fraction, 1.0)

    def rate(self, progress: float) -> float:
        if self.shape == "constant":
            return self.lr
        if progress < self.warmup:
            return self.lr * progress / self.warmup
        span = max(1e-9, 1.0 - self.warmup)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * (progress - self.warmup) / span))


def train_vae(vae, pixels: torch.Tensor, steps: int, batch_size: int, lr: float, generator: torch.Generator,
              grad_clip: float | None = None) -> None:
    """`grad_clip` bounds the gradient norm: the 8× VAE of `--size large` diverged at lr 2e-3 without it."""
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    for step in range(steps):
        batch = pixels[torch.randint(len(pixels), (batch_size,), generator=generator)].to(vae.device)
        posterior = vae.encode(batch).latent_dist
        reconstruction = vae.decode(posterior.mean).sample
        loss = (reconstruction - batch).pow(2).mean() + 1e-4 * posterior.kl().mean() / posterior.mean[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(vae.parameters(), grad_clip)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("vae step %d/%d: loss %.4f", step + 1, steps, loss.item())
    vae.eval()


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Posterior means, normalised by setting the VAE's shift and scaling factors (SD3's convention)."""
    means = torch.cat([vae.encode(pixels[i:i + batch_size].to(vae.device)).latent_dist.mean.cpu()
                       for i in range(0, len(pixels), batch_size)])
    shift, scale = means.mean().item(), 1.0 / means.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (means - shift) * scale


def encode_prompts(pipe, prompts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each distinct prompt once: (prompt_embeds [L, D], pooled [P]), through the pipeline's own
    `encode_prompt` (differentiable when the text encoders train)."""
    unique = sorted(set(prompts))
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=unique, prompt_2=None, prompt_3=None,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=pipe.tokenizer_3.model_max_length)
    return {prompt: (embeds[i], pooled[i]) for i, prompt in enumerate(unique)}


def text_encoders(pipe) -> list[torch.nn.Module]:
    return [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]


def shifted_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's static time shift of a uniform u (the schedule the scheduler samples on)."""
    return shift * u / (1 + (shift - 1) * u)


def train_denoiser(pipe, latents: torch.Tensor, prompts: list[str], schedule: DenoiserSchedule, batch_size: int,
                   generator: torch.Generator, snapshot=None, snapshot_steps: tuple[int, ...] = (),
                   train_text: bool = False) -> None:
    """`snapshot(step)` is called after each step of `snapshot_steps`, the EMA weights swapped in. With
    `train_text` the three text encoders train jointly with the transformer (same optimizer, same EMA; kept in
    eval mode, so without dropout): each step encodes its batch's prompts with gradients. Without it they stay
    frozen and every prompt is encoded once."""
    transformer = pipe.transformer
    modules = [transformer] + (text_encoders(pipe) if train_text else [])
    params = [p for module in modules for p in module.parameters()]
    for encoder in text_encoders(pipe):
        encoder.requires_grad_(train_text)
    average = [p.detach().clone() for p in params]
    if not train_text:
        with torch.no_grad():
            encoded = encode_prompts(pipe, prompts + [""])
    optimizer = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=0.0)
    shift = float(pipe.scheduler.config.shift)
    transformer.train()
    start = time.monotonic()
    with stop_on_sigterm() as stop:
        for step in range(schedule.steps):
            progress = schedule.progress(step, time.monotonic() - start)
            if progress >= 1.0:
                logger.info("denoiser stopped at step %d: --max-seconds reached", step)
                break
            if stop.is_set():
                logger.warning("denoiser stopped at step %d by SIGTERM: the weights so far are saved (a shorter "
                               "schedule than asked for)", step)
                break
            for group in optimizer.param_groups:
                group["lr"] = schedule.rate(progress)
            rows = torch.randint(len(latents), (batch_size,), generator=generator)
            dropped = torch.rand(batch_size, generator=generator) < CONDITION_DROPOUT
            texts = ["" if drop else prompts[row] for row, drop in zip(rows.tolist(), dropped.tolist())]
            if train_text:
                encoded = encode_prompts(pipe, texts)
            embeds = torch.stack([encoded[text][0] for text in texts])
            pooled = torch.stack([encoded[text][1] for text in texts])
            x0 = latents[rows]
            noise = torch.randn(x0.shape, generator=generator)
            sigma = shifted_sigmas(torch.rand(batch_size, generator=generator), shift)
            noisy = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
            device = transformer.device
            velocity = transformer(hidden_states=noisy.to(device), timestep=(1000 * sigma).to(device),
                                   encoder_hidden_states=embeds.to(device), pooled_projections=pooled.to(device),
                                   return_dict=False)[0]
            loss = (velocity - (noise - x0).to(device)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            decay = min(EMA_DECAY, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(average, [p.detach() for p in params], 1 - decay)
            if snapshot is not None and step + 1 in snapshot_steps:
                with swapped_in(params, average):
                    snapshot(step + 1)
            if step % 50 == 0 or step == schedule.steps - 1:
                logger.info("denoiser step %d/%d: loss %.4f, lr %.2e", step + 1, schedule.steps, loss.item(),
                            optimizer.param_groups[0]["lr"])
    with torch.no_grad():
        for param, value in zip(params, average):
            param.copy_(value)
    for module in modules:
        module.requires_grad_(False)
    transformer.eval()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[threading.Event]:
    """Inside, SIGTERM (a caller's `timeout`, a scheduler's end of job) sets the event instead of ending the
    process, so the denoiser stops after its step and what it learned is saved. Only the main thread can take
    the signal; elsewhere the event never sets."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def swapped_in(params: list[torch.nn.Parameter], values):
    """Within the block the parameters hold `values` (the EMA), then their own values again."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved):
                param.copy_(value)


def pretrain(out_dir: str, size: ModelSize = SMALL, seed: int = 0, images_per_scene: int = 8, vae_steps: int = 1200,
             schedule: DenoiserSchedule = DenoiserSchedule(), batch_size: int = 16, vae_lr: float = 2e-3,
             snapshot_steps: tuple[int, ...] = (), device: str = "cpu", stray_fraction: float = STRAY_FRACTION,
             train_text: bool = False, vae_batch_size: int | None = None, render_workers: int = 1,
             vae_grad_clip: float | None = None) -> str:
    """Pretrain into `out_dir`; `snapshot_steps` also saves the pipeline after those denoiser steps into
    `<out_dir>-step<N>` (to choose how far to train)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws whatever --device
    pipe = build_untrained_pipeline(size, seed).to(device)
    start = time.monotonic()
    pixels, prompts = render_dataset(size.image_size, images_per_scene, seed, stray_fraction, render_workers)
    logger.info("rendered %d images in %.1fs", len(pixels), time.monotonic() - start)
    train_vae(pipe.vae, pixels, vae_steps, vae_batch_size or batch_size, vae_lr, generator, vae_grad_clip)
    latents = encode_latents(pipe.vae, pixels)
    logger.info("vae done at %.1fs: its reconstructions of clean renders score %.3f", time.monotonic() - start,
                vae_roundtrip_score(pipe.vae, size.image_size))

    def snapshot(step: int) -> None:
        pipe.save_pretrained(f"{out_dir}-step{step}")

    train_denoiser(pipe, latents, prompts, schedule, batch_size, generator, snapshot, snapshot_steps, train_text)
    logger.info("denoiser done at %.1fs", time.monotonic() - start)
    pipe.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (diffusers format)")
    parser.add_argument("--size", choices=tuple(SIZES), default="small",
                        help="small: 32 px, 3 blocks of width 48 (CPU); wide: 32 px, 4 blocks of width 96 (the shipped "
                             "base, pretrained on a GPU); large: 128 px, the GPU benchmark's")
    parser.add_argument("--num-layers", type=int, help="override the size's number of transformer blocks")
    parser.add_argument("--num-heads", type=int, help="override the size's attention heads (16 dimensions each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images-per-scene", type=int, default=8)
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--dit-steps", type=int, default=16000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vae-batch-size", type=int, help="the VAE stage's batch (default: --batch-size)")
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--vae-grad-clip", type=float, help="clip the VAE's gradient norm (default: no clipping)")
    parser.add_argument("--dit-lr", type=float, default=1e-3, help="the denoiser's peak learning rate")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--warmup", type=float, default=0.0, help="cosine: the warm-up's fraction of the horizon")
    parser.add_argument("--max-seconds", type=float,
                        help="stop the denoiser after this many seconds (cosine decays over this horizon too)")
    parser.add_argument("--snapshot-steps", default="", help="comma-separated denoiser steps to save as <out>-step<N>")
    parser.add_argument("--stray-fraction", type=float, default=STRAY_FRACTION,
                        help="the fraction of pretraining images with one stray object the prompt did not ask for")
    parser.add_argument("--train-text", action="store_true",
                        help="train the text encoders jointly with the transformer (default: random and frozen)")
    parser.add_argument("--device", default="cpu", help="cpu (bitwise repeatable) or cuda (the large model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: bitwise repeatable)")
    parser.add_argument("--render-workers", type=int, default=1, help="processes rendering the images")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    size = dataclasses.replace(SIZES[args.size], **{key: value for key, value in
                               (("num_layers", args.num_layers), ("num_heads", args.num_heads)) if value})
    schedule = DenoiserSchedule(steps=args.dit_steps, lr=args.dit_lr, shape=args.lr_schedule, warmup=args.warmup,
                                max_seconds=args.max_seconds)
    print(pretrain(args.out, size, args.seed, args.images_per_scene, args.vae_steps, schedule, args.batch_size,
                   vae_lr=args.vae_lr, vae_grad_clip=args.vae_grad_clip,
                   snapshot_steps=tuple(int(s) for s in args.snapshot_steps.split(",") if s),
                   device=args.device, stray_fraction=args.stray_fraction, train_text=args.train_text,
                   vae_batch_size=args.vae_batch_size, render_workers=args.render_workers))


if __name__ == "__main__":
    main()
