"""Trainer inputs without engines: the flag namespace with CLI defaults, and rollout samples made in-process.

Used by the trainer's tests and `bench/bench_train.py`. `make_rollout_samples` runs the family's own
`predict_velocity` and the math core's SDE step exactly as the engine does (per-sample generators, CFG,
recorded x_k / x_{k+1} / log-probs at the selected steps, the final latent as `clean_latents`), so a trainer
with the same weights must reproduce the rollout log-probs (docs/algorithms.md §11.7).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from miles.models.base import GenerationShape
from miles.types import GuidanceConfig, Sample

# The trainer-relevant flags with the defaults of spec/cli-reference.md.
TRAINER_FLAG_DEFAULTS: dict[str, Any] = dict(
    hf_checkpoint=None,
    diffusion_model_family=None,
    train_pipeline_config_path=None,
    model_backend_path=None,
    update_weight_target_module="transformer",
    update_weight_buffer_size=512 * 1024 * 1024,
    update_weight_transport="auto",
    check_weight_sync=False,
    loss_type="policy_loss",
    seed=1234,
    lr=1e-6,
    min_lr=0.0,
    lr_warmup_init=0.0,
    lr_warmup_iters=0,
    lr_warmup_fraction=None,
    lr_decay_iters=None,
    lr_decay_style="constant",
    lr_wsd_decay_iters=None,
    lr_wsd_decay_style=None,
    use_checkpoint_lr_scheduler=True,
    override_lr_scheduler=False,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_eps=1e-8,
    weight_decay=0.0,
    clip_grad=1.0,
    num_rollout=1,
    num_steps_per_rollout=1,
    micro_batch_size=1,
    parity_forward_tile=0,
    rollout_patch_group=[],
    micro_batch_size_sample=None,
    micro_batch_size_tstep=None,
    diffusion_train_iter_order="sample_major",
    train_dp_split_mode="contiguous",
    diffusion_forward_dtype="bf16",
    fsdp_master_dtype="fp32",
    fsdp_reduce_dtype="fp32",
    fsdp_cpu_offload=False,
    fsdp_cpu_backend="gloo",
    fsdp_attention_backend=None,
    fsdp_flow_shift=None,
    dp_replicate_size=1,
    sequence_parallel_size=1,
    ulysses_degree=0,
    gradient_checkpointing=False,
    fsdp_torch_compile=False,
    deterministic_mode=False,
    train_env_vars="{}",
    distributed_backend="nccl",
    distributed_timeout_minutes=10,
    diffusion_num_steps=10,
    diffusion_guidance_scale=4.0,
    diffusion_guidance_scale_2=None,
    diffusion_true_cfg_scale=None,
    diffusion_negative_prompt=None,
    diffusion_noise_level=0.7,
    diffusion_height=512,
    diffusion_width=512,
    diffusion_output_num_frames=1,
    diffusion_fps=None,
    diffusion_sde_type="sde",
    sde_step_backend_path=None,
    diffusion_log_prob_no_const=False,
    diffusion_clip_range=1e-4,
    diffusion_adv_clip_max=5.0,
    diffusion_recompute_old_log_prob=False,
    diffusion_kl_beta=0.0,
    ref_mode=None,
    custom_prepare_train_batch_path=None,
    custom_loss_function_path=None,
    custom_convert_samples_to_train_data_path=None,
    custom_expand_samples_to_train_pairs_path=None,
    diffusion_nft_beta=1.0,
    diffusion_nft_timestep_fraction=0.99,
    no_diffusion_nft_adaptive_weight=False,
    no_diffusion_nft_shuffle_timesteps=False,
    use_lora=False,
    lora_rank=64,
    lora_alpha=64,
    lora_target_modules=None,
    lora_init_weights="gaussian",
    lora_ipc_weight_sync=False,
    use_ema=False,
    ema_rollout_policy="live",
    ema_decay_init=0.001,
    ema_decay_ramp=0.001,
    ema_decay_max=0.5,
    ema_decay_flat_steps=0,
    save=None,
    save_interval=None,
    save_keep_latest=None,
    load=None,
    ckpt_step=None,
    no_save_optim=False,
    no_load_optim=False,
    no_load_rng=False,
    start_rollout_id=None,
    debug_skip_optimizer_step=False,
    diffusion_debug_mode=False,
    colocate=False,
)


def trainer_args(**overrides) -> argparse.Namespace:
    """A namespace like the parser's for the trainer's flags; unknown names are refused (typo guard)."""
    unknown = sorted(set(overrides) - set(TRAINER_FLAG_DEFAULTS))
    if unknown:
        raise KeyError(f"not trainer flags: {unknown}")
    return argparse.Namespace(**{**TRAINER_FLAG_DEFAULTS, **overrides})


@torch.no_grad()
def make_rollout_samples(
    family,
    pipe,
    args,
    prompts: list[str],
    n_samples_per_prompt: int,
    sde_step_indices: list[int],
    seed: int = 0,
    advantages: list[float] | None = None,
    debug: bool = False,
) -> list[Sample]:
    """Samples as the engine returns them: SDE steps at `sde_step_indices`, Euler steps elsewhere."""
    from miles.diffusion.sde import build_sde_backend, ode_step

    guidance = GuidanceConfig(
        guidance_scale=args.diffusion_guidance_scale,
        guidance_scale_2=args.diffusion_guidance_scale_2,
        true_cfg_scale=args.diffusion_true_cfg_scale,
    )
    shape = GenerationShape(
        args.diffusion_height, args.diffusion_width, args.diffusion_output_num_frames, args.diffusion_fps
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.diffusion_forward_dtype]
    sde = build_sde_backend(
        args.diffusion_sde_type, args.diffusion_noise_level, args.diffusion_log_prob_no_const, args.sde_step_backend_path
    )
    all_prompts = [p for p in prompts for _ in range(n_samples_per_prompt)]
    count = len(all_prompts)
    conditioning = family.encode_prompt(pipe, all_prompts, args.diffusion_negative_prompt, guidance, shape=shape)
    sigmas = family.sigmas(pipe, args.diffusion_num_steps, shape, None).to(torch.float32)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    latents = family.prepare_latents(pipe, shape, generators, dtype)
    modules = {name: getattr(pipe, name) for name in family.trainable_modules}
    recorded: dict[int, torch.Tensor] = {}
    log_probs: list[torch.Tensor] = []
    outputs: dict[int, torch.Tensor] = {}
    keep = set(sde_step_indices) | {k + 1 for k in sde_step_indices}
    for k in range(args.diffusion_num_steps):
        if k in keep:
            recorded[k] = latents.clone()
        sigma = sigmas[k].expand(count)
        velocity = family.predict_velocity(modules, latents, sigma, conditioning, guidance, shape, dtype)
        if debug:
            outputs[k] = velocity.clone()
        if k in sde_step_indices:
            step = sde.sample(latents, velocity, sigmas[k], sigmas[k + 1], sigmas[1], generators)
            latents = step.next_latents
            log_probs.append(step.log_prob)
        else:
            latents = ode_step(latents, velocity, sigmas[k], sigmas[k + 1])
    if args.diffusion_num_steps in keep:
        recorded[args.diffusion_num_steps] = latents.clone()
    if advantages is None:
        adv_gen = torch.Generator().manual_seed(seed + 10_000)
        advantages = torch.randn(count, generator=adv_gen).tolist()
    timesteps = family.timesteps_from_sigmas(sigmas[:-1])
    samples = []
    for i in range(count):
        samples.append(
            Sample(
                prompt=all_prompts[i],
                index=i,
                group_index=i // n_samples_per_prompt,
                seed=seed + i,
                sde_step_indices=list(sde_step_indices),
                latents={k: v[i].clone() for k, v in recorded.items()},
                sigmas=sigmas.clone(),
                timesteps=timesteps.clone(),
                rollout_log_probs=torch.stack([lp[i] for lp in log_probs]) if log_probs else torch.zeros(0),
                conditioning={key: value[i].clone() for key, value in conditioning.items()},
                clean_latents=latents[i].clone(),
                debug_model_outputs={k: v[i].clone() for k, v in outputs.items()} if debug else None,
                advantage=float(advantages[i]),
            )
        )
    return samples


# ---------------------------------------------------------------------------------------------------------
# tiny end-to-end setups (tests and the CPU benchmark)
# ---------------------------------------------------------------------------------------------------------
TINY_TEXT_LENGTH = 8  # T5 tokens: keeps the tiny SD3 joint sequence short so CPU tests stay fast


def tiny_trainer_args(checkpoint: str, **overrides) -> argparse.Namespace:
    """Small, fp32, LoRA-ready settings for a tiny pipeline folder."""
    base = dict(
        hf_checkpoint=checkpoint,
        diffusion_height=32,
        diffusion_width=32,
        diffusion_num_steps=4,
        diffusion_forward_dtype="fp32",
        lora_rank=4,
        lora_alpha=8,
        lr=1e-2,
        seed=0,
    )
    return trainer_args(**{**base, **overrides})


def build_tiny_family(args):
    """The family object for `args.hf_checkpoint`, with a short text length where the family has one."""
    from miles.models.common import build_train_pipeline_config

    family = build_train_pipeline_config(args)
    if hasattr(family, "max_sequence_length"):
        family.max_sequence_length = TINY_TEXT_LENGTH
    return family


def load_tiny_family(args):
    """(family, pipeline in fp32) for `args.hf_checkpoint`."""
    family = build_tiny_family(args)
    return family, family.load_pipeline(args.hf_checkpoint, torch.float32)


def trained_state(trainer) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of the trainable parameters; a collective on every rank."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in trainer.trainable}


def rollout_and_train_step(
    args, prompts: list[str], n_samples_per_prompt: int, sde_step_indices: list[int], seed: int = 0
):
    """One engine-free iteration on a tiny pipeline, on the current process group: rollout samples made with the
    family's pipeline (velocities recorded), then one trainer step on them. Returns (samples, metrics, trainable
    weights before the step, after it). With `diffusion_debug_mode=True` the trainer compares its velocities
    with the rollout's (`train/model_output_max_abs_diff`, docs/algorithms.md §11.7)."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer

    family, pipe = load_tiny_family(args)
    samples = make_rollout_samples(
        family, pipe, args, prompts, n_samples_per_prompt, sde_step_indices, seed=seed, debug=True
    )
    trainer = DiffusionTrainer(args, family)
    trainer.init()
    before = trained_state(trainer)
    metrics = trainer.train(0, samples)
    return samples, metrics, before, trained_state(trainer)


def train_rank_worker(rank: int, args, samples_path: str, rollout_ids: list[int]) -> dict:
    """Spawned-rank body: build the trainer, train the given rollouts, return metrics and the trained weights.

    `samples_path`: a `torch.save`d list of `Sample.to_record()` dicts."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer
    from miles.types import Sample
    from miles.utils.safe_load import load_plain

    family = build_tiny_family(args)
    samples = [Sample.from_record(record, f"{samples_path} sample {position}")
               for position, record in enumerate(load_plain(samples_path, "train_rank_worker samples"))]
    trainer = DiffusionTrainer(args, family)
    trainer.init()
    metrics = [trainer.train(rollout_id, samples) for rollout_id in rollout_ids]
    return {"metrics": metrics, "state": trained_state(trainer)}
