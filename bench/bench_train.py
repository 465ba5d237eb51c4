"""Train-step benchmark: the miles FSDP2 trainer against a naive single-process diffusers training step.

    python bench/bench_train.py --device cpu                              # tiny SD3, seconds
    python bench/bench_train.py --device cuda --arch sd3.5-medium         # one H200
    python bench/bench_train.py --device cuda --arch sd3.5-medium --nproc 2 --compile

Both sides run the same Flow-GRPO policy-loss step with CFG on the same synthetic train pairs (random latents
and conditioning of the real shapes: 512×512 → 16×64×64 latents, 333 text tokens for SD3.5-Medium):
- naive: one process, the plain diffusers transformer (fp32 weights, bf16 autocast), the positive and negative
  CFG branches as two separate eager forwards, SDE log-prob and policy loss from the math core, backward,
  grad clip, AdamW — how research code does it;
- miles: `DiffusionTrainer` (FSDP2 per block, bf16 params / fp32 master and reduce, CFG as one doubled batch,
  optional torch.compile per block, no activation checkpointing), one or `--nproc` ranks spawned without torchrun.
Prints one table: train pairs/s and MFU (FLOPs counted once with torch.utils.flop_counter). Random weights:
speed does not depend on their values. Every measurement runs in its own spawned process(es).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from miles.testing.real_size import (  # noqa: E402
    SD35_MEDIUM_TEXT_TOKENS,
    SD35_MEDIUM_TRANSFORMER,
    random_sd35_medium_transformer,
    synchronize,
)
from miles.utils.profiling import PROFILE_DIR_ENV, PROFILE_ROLLOUTS_ENV, profile_report_path  # noqa: E402

# flops_per_pair: forward + backward of one CFG pair (two 2.5 TFLOP forwards, backward twice that), counted with
# torch.utils.flop_counter on an H200; used for the MFU column when no row counted it (compiled blocks).
ARCH_SHAPES = {
    "sd3.5-medium": dict(
        config=SD35_MEDIUM_TRANSFORMER,
        latent=(16, 64, 64),
        text_tokens=SD35_MEDIUM_TEXT_TOKENS,
        pixels=512,
        flops_per_pair=15.002e12,
    )
}


def random_sd3_backend(path: str, dtype: torch.dtype):
    """`--model-backend-path` hook: an SD3.5-Medium transformer from its config with random weights."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    return SimpleNamespace(transformer=random_sd35_medium_transformer(device, dtype))


# ---------------------------------------------------------------------------------------------------------
# setup shared by both sides
# ---------------------------------------------------------------------------------------------------------
def bench_args(opts, checkpoint: str):
    from miles.testing.config import trainer_config

    pixels = ARCH_SHAPES[opts.arch]["pixels"] if opts.arch else 32
    extra = {}
    if opts.arch:
        extra = dict(diffusion_model_family="sd3")
        if not opts.checkpoint:
            extra["model_backend_path"] = "bench_train.random_sd3_backend"
    return trainer_config(
        hf_checkpoint=checkpoint,
        diffusion_height=pixels,
        diffusion_width=pixels,
        diffusion_forward_dtype="bf16",
        micro_batch_size=opts.micro_batch_size,
        num_rollout=1000,
        lr=1e-5,
        seed=0,
        fsdp_torch_compile=opts.compile,
        fsdp_blocks_per_unit=getattr(opts, "fsdp_blocks_per_unit", 1),
        **(dict(use_lora=True, lora_rank=32, lora_alpha=64) if opts.lora else {}),
        **extra,
    )


def synthetic_samples(opts, transformer_config: dict, latent_shape, text_tokens: int):
    """Samples with `opts.pairs` train pairs (2 SDE steps each) of the model's real shapes."""
    from miles.diffusion.schedules import flow_match_sigmas
    from miles.types import Sample

    generator = torch.Generator().manual_seed(0)
    sigmas = flow_match_sigmas(10, shift=3.0)
    width, pooled = transformer_config["joint_attention_dim"], transformer_config["pooled_projection_dim"]
    if opts.like_rollout:
        return rollout_like_samples(opts, latent_shape, text_tokens, width, pooled, sigmas, generator)
    samples = []
    for index in range(opts.pairs // 2):
        steps = [3, 4]
        samples.append(
            Sample(
                prompt="bench",
                index=index,
                group_index=index,
                sde_step_indices=steps,
                latents={k: torch.randn(latent_shape, generator=generator) for k in (3, 4, 5)},
                sigmas=sigmas,
                timesteps=sigmas[:-1] * 1000,
                rollout_log_probs=torch.full((2,), -1.0),
                conditioning={
                    "prompt_embeds": torch.randn(text_tokens, width, generator=generator),
                    "pooled_prompt_embeds": torch.randn(pooled, generator=generator),
                    "negative_prompt_embeds": torch.randn(text_tokens, width, generator=generator),
                    "negative_pooled_prompt_embeds": torch.randn(pooled, generator=generator),
                },
                advantage=float(torch.randn((), generator=generator)),
            )
        )
    return samples


def rollout_like_samples(opts, latent_shape, text_tokens: int, width: int, pooled: int, sigmas, generator):
    """As `train_diffusion.py`'s engine returns them: every one of the 10 steps trained, 4 samples per prompt
    sharing one bf16 conditioning (sent once per request), fp32 latents."""
    from miles.types import Sample

    samples, steps = [], list(range(10))
    for index in range(opts.pairs // len(steps)):
        if index % 4 == 0:
            conditioning = {
                key: torch.randn(shape, generator=generator).to(torch.bfloat16)
                for key, shape in (("prompt_embeds", (text_tokens, width)), ("pooled_prompt_embeds", (pooled,)),
                                   ("negative_prompt_embeds", (text_tokens, width)),
                                   ("negative_pooled_prompt_embeds", (pooled,)))
            }
        samples.append(Sample(
            prompt="bench", index=index, group_index=index // 4, sde_step_indices=steps,
            latents={k: torch.randn(latent_shape, generator=generator) for k in range(11)},
            sigmas=sigmas, timesteps=sigmas[:-1] * 1000, rollout_log_probs=torch.full((10,), -1.0),
            conditioning=conditioning, advantage=float(torch.randn((), generator=generator)),
        ))
    return samples


def model_setup(opts):
    """(checkpoint folder, transformer config, latent shape, text tokens) for the chosen size."""
    if opts.arch:
        shape = ARCH_SHAPES[opts.arch]
        return opts.checkpoint or "random-sd3.5-medium", shape["config"], shape["latent"], shape["text_tokens"]
    import json

    from miles.testing.make_tiny import build_tiny_pipeline

    folder = build_tiny_pipeline("sd3", os.path.join(tempfile.gettempdir(), "miles-bench-tiny-sd3"))
    with open(os.path.join(folder, "transformer", "config.json")) as handle:
        config = json.load(handle)
    latent = (config["in_channels"], config["sample_size"], config["sample_size"])
    return folder, config, latent, 16


def peak_flops(device: str) -> float | None:
    from miles.backends.fsdp_utils.train_metrics import peak_tflops

    value = peak_tflops(torch.device(device))
    return None if value is None else value * 1e12


# ---------------------------------------------------------------------------------------------------------
# the two sides (each runs in spawned processes)
# ---------------------------------------------------------------------------------------------------------
def run_miles(rank: int, opts) -> dict:
    from miles.backends.fsdp_utils.actor import DiffusionTrainer
    from miles.models.common import build_train_pipeline_config

    checkpoint, config, latent, text_tokens = model_setup(opts)
    run_config = bench_args(opts, checkpoint)
    family = build_train_pipeline_config(**run_config.model.family_source())
    device = "cuda" if opts.device == "cuda" else "cpu"
    trainer = DiffusionTrainer(run_config, family, device=device)
    trainer.init()
    samples = synthetic_samples(opts, config, latent, text_tokens)
    for rollout_id in range(opts.warmup):
        trainer.train(rollout_id, samples)
    synchronize(device)
    seconds = 0.0
    for rollout_id in range(opts.steps):
        if opts.offload_cycle:  # a colocated iteration's turn: to the host and back, outside the timed step
            trainer.offload()
            trainer.onload()
        started = time.perf_counter()
        trainer.train(opts.warmup + rollout_id, samples)
        synchronize(device)
        seconds += (time.perf_counter() - started) / opts.steps
    result = {"pairs_per_s": opts.pairs / seconds, "flops_per_pair": trainer.flops_per_pair, "seconds": seconds,
              "peak_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None}
    if opts.profile and rank == 0:  # one more step, under the trainer's own profiler (miles/utils/profiling.py)
        profiled = opts.warmup + opts.steps
        with tempfile.TemporaryDirectory() as directory:
            os.environ.update({PROFILE_DIR_ENV: directory, PROFILE_ROLLOUTS_ENV: str(profiled)})
            trainer.train(profiled, samples)
            with open(profile_report_path(directory, profiled, rank)) as handle:
                result["profile"] = handle.read()
    return result


def run_naive(rank: int, opts) -> dict:
    """Plain diffusers + math core, no FSDP: the baseline research code runs."""
    from torch.utils.flop_counter import FlopCounterMode

    from miles.backends.fsdp_utils.train_data import collate, convert_samples_to_train_data
    from miles.diffusion.losses import policy_loss
    from miles.diffusion.sde import build_sde_backend
    from miles.models.common import build_train_pipeline_config

    checkpoint, config, latent, text_tokens = model_setup(opts)
    run_config = bench_args(opts, checkpoint)
    device = "cuda" if opts.device == "cuda" else "cpu"
    family = build_train_pipeline_config(**run_config.model.family_source())
    transformer = family.load_modules(checkpoint, ["transformer"], torch.float32)["transformer"].to(device)
    transformer.train()
    trainer = run_config.trainer
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=trainer.lr,
                                  betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps)
    sde = build_sde_backend("sde", run_config.sampling.diffusion_noise_level, False)
    samples = synthetic_samples(opts, config, latent, text_tokens)
    pairs = convert_samples_to_train_data(run_config, samples, family)
    batches = [collate(pairs[i : i + opts.micro_batch_size], device) for i in range(0, len(pairs), opts.micro_batch_size)]
    flops = {}

    def step():
        optimizer.zero_grad(set_to_none=True)
        for index, batch in enumerate(batches):
            counter = FlopCounterMode(display=False) if not flops else None
            with counter or _null():
                cond = batch.conditioning
                timesteps = batch.sigmas * 1000
                with torch.autocast(device, dtype=torch.bfloat16):
                    v_pos = transformer(
                        hidden_states=batch.latents, timestep=timesteps, encoder_hidden_states=cond["prompt_embeds"],
                        pooled_projections=cond["pooled_prompt_embeds"], return_dict=False,
                    )[0]
                    v_neg = transformer(
                        hidden_states=batch.latents, timestep=timesteps,
                        encoder_hidden_states=cond["negative_prompt_embeds"],
                        pooled_projections=cond["negative_pooled_prompt_embeds"], return_dict=False,
                    )[0]
                velocity = v_neg.float() + 4.0 * (v_pos.float() - v_neg.float())
                out = sde.log_prob(batch.latents, velocity, batch.next_latents, batch.sigmas, batch.sigmas_next, batch.sigmas_1)
                loss, _ = policy_loss(out.log_prob, batch.old_log_probs, batch.advantages, 1e-4, 5.0)
                (loss.sum() / len(pairs)).backward()
            if counter is not None:
                flops["per_pair"] = counter.get_total_flops() / len(batch)
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()

    for _ in range(opts.warmup):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(opts.steps):
        step()
    synchronize(device)
    seconds = (time.perf_counter() - started) / opts.steps
    return {"pairs_per_s": len(pairs) / seconds, "flops_per_pair": flops.get("per_pair"), "seconds": seconds}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--arch", choices=sorted(ARCH_SHAPES), default=None, help="real-size architecture (GPU)")
    parser.add_argument("--nproc", type=int, default=1, help="also measure miles on this many ranks (FSDP)")
    parser.add_argument("--pairs", type=int, default=None, help="train pairs per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block (miles side)")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--lora", action="store_true", help="miles side: LoRA r32/α64 (the end-to-end geometry)")
    parser.add_argument("--like-rollout", action="store_true",
                        help="pairs as an engine rollout gives them: 10 trained steps per sample, 4 samples share a "
                             "prompt's bf16 conditioning")
    parser.add_argument("--profile", action="store_true", help="print a profiler table of one miles step")
    parser.add_argument("--checkpoint", help="with --arch: load this pipeline folder (make_tiny --real-size) through "
                        "from_pretrained, as train_diffusion.py does, instead of building random weights in place")
    parser.add_argument("--blocks-per-unit", default="1",
                        help="comma list: a miles row per --fsdp-blocks-per-unit value (blocks sharded as one unit)")
    parser.add_argument("--offload-cycle", action="store_true",
                        help="miles side: offload to the host and onload before each timed step (colocated turns)")
    opts = parser.parse_args()
    if opts.arch and opts.device != "cuda":
        parser.error("--arch needs --device cuda")
    gpu = opts.device == "cuda"
    opts.pairs = opts.pairs or (64 if gpu else 8)
    opts.micro_batch_size = opts.micro_batch_size or (8 if gpu else 2)

    from miles.backends.fsdp_utils.spawn import spawn_ranks

    backend = "nccl" if gpu else "gloo"
    rows = []
    if not opts.skip_naive:
        rows.append(("naive diffusers (1 proc, eager, CFG as 2 forwards)", 1, spawn_ranks(1, run_naive, (opts,), backend)[0]))
    label = "miles FSDP2 (CFG batched" + (", compiled blocks)" if opts.compile else ")")
    for per_unit in [int(value) for value in opts.blocks_per_unit.split(",")]:
        variant = argparse.Namespace(**{**vars(opts), "fsdp_blocks_per_unit": per_unit})
        name = label if per_unit == 1 else f"{label[:-1]}, {per_unit} blocks per unit)"
        rows.append((name, 1, spawn_ranks(1, run_miles, (variant,), backend)[0]))
    if opts.nproc > 1:
        rows.append((label, opts.nproc, spawn_ranks(opts.nproc, run_miles, (opts,), backend)[0]))
    peak = peak_flops("cuda" if gpu else "cpu")
    flops_per_pair = next((r["flops_per_pair"] for _, _, r in rows if r["flops_per_pair"]), None)
    if flops_per_pair is None and opts.arch:
        flops_per_pair = ARCH_SHAPES[opts.arch]["flops_per_pair"]
    print(f"\n{'setup':58s} {'ranks':>5s} {'pairs/s':>9s} {'s/step':>8s} {'TFLOP/s/GPU':>12s} {'MFU':>7s} {'vs naive':>9s}"
          f" {'peak GiB':>9s}")
    base = rows[0][2]["pairs_per_s"] if not opts.skip_naive else None
    for name, ranks, result in rows:
        tflops = flops_per_pair * result["pairs_per_s"] / ranks / 1e12 if flops_per_pair else float("nan")
        mfu = f"{100 * tflops * 1e12 / peak:6.1f}%" if peak and flops_per_pair else "    n/a"
        ratio = f"{result['pairs_per_s'] / base:8.2f}x" if base else "      -"
        peak_gib = f"{result['peak_gib']:9.1f}" if result.get("peak_gib") else "        -"
        print(f"{name:58s} {ranks:5d} {result['pairs_per_s']:9.2f} {result['seconds']:8.3f} {tflops:12.2f} {mfu} {ratio}"
              f" {peak_gib}")
    for name, ranks, result in rows:
        if result.get("profile"):
            print(f"\nprofile of one step: {name}, {ranks} rank(s)\n{result['profile']}")
    print(
        f"\n{opts.pairs} pairs per optimizer step, micro-batch {opts.micro_batch_size}, CFG 4.0, bf16; "
        f"FLOPs/pair (fwd+bwd, counted) = {flops_per_pair / 1e12 if flops_per_pair else float('nan'):.3f} TFLOP; "
        f"arch = {opts.arch or 'tiny sd3'}"
    )


if __name__ == "__main__":
    main()
