"""Trainer inputs without engines: tiny run configurations and rollout samples made in-process.

Used by the trainer's tests and `bench/bench_train.py`; the configurations come from the flag declarations
(`miles.testing.config.trainer_config`), never from a list of defaults of their own. `make_rollout_samples`
runs the family's own `predict_velocity` and the math core's SDE step exactly as the engine does (per-sample generators, CFG,
recorded x_k / x_{k+1} / log-probs at the selected steps, the final latent as `clean_latents`), so a trainer
with the same weights must reproduce the rollout log-probs (docs/algorithms.md §11.7).
"""

from __future__ import annotations

import torch

from miles.config.sections import RunConfig
from miles.models.base import GenerationShape
from miles.models.common import parse_dtype
from miles.testing.config import trainer_config
from miles.types import GuidanceConfig, Sample

@torch.no_grad()
def make_rollout_samples(
    family,
    pipe,
    config: RunConfig,
    prompts: list[str],
    n_samples_per_prompt: int,
    sde_step_indices: list[int],
    seed: int = 0,
    advantages: list[float] | None = None,
    debug: bool = False,
) -> list[Sample]:
    """Samples as the engine returns them: SDE steps at `sde_step_indices`, Euler steps elsewhere."""
    from miles.diffusion.sde import build_sde_backend, ode_step

    sampling = config.sampling
    guidance = GuidanceConfig(
        guidance_scale=sampling.diffusion_guidance_scale,
        guidance_scale_2=sampling.diffusion_guidance_scale_2,
        true_cfg_scale=sampling.diffusion_true_cfg_scale,
    )
    shape = GenerationShape(sampling.diffusion_height, sampling.diffusion_width,
                            sampling.diffusion_output_num_frames, sampling.diffusion_fps)
    dtype = parse_dtype(config.trainer.diffusion_forward_dtype)
    sde = build_sde_backend(sampling.diffusion_sde_type, sampling.diffusion_noise_level,
                            sampling.diffusion_log_prob_no_const, sampling.sde_step_backend_path)
    all_prompts = [p for p in prompts for _ in range(n_samples_per_prompt)]
    count = len(all_prompts)
    conditioning = family.encode_prompt(pipe, all_prompts, sampling.diffusion_negative_prompt, guidance, shape=shape)
    sigmas = family.sigmas(pipe, sampling.diffusion_num_steps, shape, None).to(torch.float32)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    latents = family.prepare_latents(pipe, shape, generators, dtype)
    modules = {name: getattr(pipe, name) for name in family.trainable_modules}
    recorded: dict[int, torch.Tensor] = {}
    log_probs: list[torch.Tensor] = []
    outputs: dict[int, torch.Tensor] = {}
    keep = set(sde_step_indices) | {k + 1 for k in sde_step_indices}
    for k in range(sampling.diffusion_num_steps):
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
    if sampling.diffusion_num_steps in keep:
        recorded[sampling.diffusion_num_steps] = latents.clone()
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


def tiny_trainer_config(checkpoint: str, **overrides) -> RunConfig:
    """Small, fp32, LoRA-ready settings for a tiny pipeline folder (`overrides` by flag dest)."""
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
    return trainer_config(**{**base, **overrides})


def build_tiny_family(config: RunConfig):
    """The family object of `config.model`, with a short text length where the family has one."""
    from miles.models.common import build_train_pipeline_config

    family = build_train_pipeline_config(**config.model.family_source())
    if hasattr(family, "max_sequence_length"):
        family.max_sequence_length = TINY_TEXT_LENGTH
    return family


def load_tiny_family(config: RunConfig):
    """(family, pipeline in fp32) for `config.model.hf_checkpoint`."""
    family = build_tiny_family(config)
    return family, family.load_pipeline(config.model.hf_checkpoint, torch.float32)


def trained_state(trainer) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of the trainable parameters; a collective on every rank."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in trainer.trainable}


def rollout_and_train_step(
    config: RunConfig, prompts: list[str], n_samples_per_prompt: int, sde_step_indices: list[int], seed: int = 0
):
    """One engine-free iteration on a tiny pipeline, on the current process group: rollout samples made with the
    family's pipeline (velocities recorded), then one trainer step on them. Returns (samples, metrics, trainable
    weights before the step, after it). With `diffusion_debug_mode=True` the trainer compares its velocities
    with the rollout's (`train/model_output_max_abs_diff`, docs/algorithms.md §11.7)."""
    family, pipe = load_tiny_family(config)
    samples = make_rollout_samples(
        family, pipe, config, prompts, n_samples_per_prompt, sde_step_indices, seed=seed, debug=True
    )
    return (samples, *train_step(config, family, samples))


def train_step(config: RunConfig, family, samples: list) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One trainer step on `samples`, on the current process group: (metrics, trainable weights before, after)."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer

    trainer = DiffusionTrainer(config, family)
    trainer.init()
    before = trained_state(trainer)
    metrics = trainer.train(0, samples)
    return metrics, before, trained_state(trainer)


def train_step_on_one_rank(config: RunConfig, family, samples: list):
    """`train_step` in a one-rank gloo group of its own (created and destroyed here)."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed

    init_distributed(0, 1, "gloo", free_port())
    try:
        return train_step(config, family, samples)
    finally:
        dist.destroy_process_group()


def train_rank_worker(rank: int, config: RunConfig, samples_path: str, rollout_ids: list[int]) -> dict:
    """Spawned-rank body: build the trainer, train the given rollouts, return metrics and the trained weights.

    `samples_path`: a `torch.save`d list of `Sample.to_record()` dicts."""
    from miles.backends.fsdp_utils.actor import DiffusionTrainer
    from miles.types import Sample
    from miles.utils.safe_load import load_plain

    family = build_tiny_family(config)
    samples = [Sample.from_record(record, f"{samples_path} sample {position}")
               for position, record in enumerate(load_plain(samples_path, "train_rank_worker samples"))]
    trainer = DiffusionTrainer(config, family)
    trainer.init()
    metrics = [trainer.train(rollout_id, samples) for rollout_id in rollout_ids]
    return {"metrics": metrics, "state": trained_state(trainer)}


def cpu_runner(path: str, family, pipe):
    """An engine's `ModelRunner` on the CPU in fp32, serving an already loaded (family, pipeline)."""
    from miles.engine.model_runner import ModelRunner
    from miles.engine.server_args import ServerArgs

    return ModelRunner(ServerArgs(model_path=path, device="cpu", dtype="fp32", generator_device="cpu"),
                       loaded=(family, pipe))


def samples_through_the_engine(runner, request) -> list[Sample]:
    """`request` as an engine receives it (through the wire format), denoised to the end on `runner`, and the
    response as the rollout hands it to the trainer: one Sample per result, with advantages −1, +1, …"""
    from miles.engine.protocol import decode_request, decode_response, encode_request, encode_response

    request = decode_request(encode_request(request))
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    response = decode_response(encode_response(runner.finish(trajectory)))
    return [result.fill_sample(Sample(prompt=request.prompt, index=b, advantage=float(2 * b - 1)), request, 0, None)
            for b, result in enumerate(response.samples)]


def max_result_difference(a, b) -> tuple[float, int]:
    """Two engines' `SampleResult`s for the same requests: the largest |difference| of their latents, log-probs and
    velocities, and of their uint8 images."""
    worst, worst_pixel = 0.0, 0
    for x, y in zip(a, b, strict=True):
        pairs = [(x.clean_latents, y.clean_latents), (x.rollout_log_probs, y.rollout_log_probs)]
        pairs += [(x.latents[k], y.latents[k]) for k in x.latents]
        pairs += [(x.debug_model_outputs[k], y.debug_model_outputs[k]) for k in x.debug_model_outputs]
        for p, q in pairs:
            assert p.shape == q.shape
            worst = max(worst, (p - q).abs().max().item())
        assert x.image.shape == y.image.shape
        worst_pixel = max(worst_pixel, (x.image.int() - y.image.int()).abs().max().item())
    return worst, worst_pixel
