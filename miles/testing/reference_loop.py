"""A plain single-request sampler over one family: the yardstick for parity tests and the naive baseline.

encode → prepare latents → for each step: `family.predict_velocity`, then the math core's step
(`miles.diffusion.sde`: Euler `ode_step`, or an `SdeStepBackend.sample` for a Flow-GRPO style rollout) →
decode. No batching across requests, no caching, no compilation: this is the loop the research repos run,
written once over the family interface so that its output can be compared with the diffusers pipeline's
own `__call__` (docs/algorithms.md §1–§2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from miles.diffusion.sde import SdeStepBackend, ode_step
from miles.models.base import GenerationShape, TrainPipelineConfig
from miles.models.common import generators_from_seeds
from miles.types import GuidanceConfig


@dataclass
class ReferenceOutput:
    """`images` uint8 [B, F, H, W, 3]; `latents` the final fp32 latents; `trajectory[k]` = x_k (k = 0..n)."""

    images: torch.Tensor | None
    latents: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    conditioning: dict[str, torch.Tensor]
    trajectory: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)  # one [B] per SDE step (empty for ODE)


@torch.no_grad()
def sample_reference(
    family: TrainPipelineConfig,
    pipe: Any,
    prompts: Sequence[str],
    *,
    seeds: Sequence[int],
    num_steps: int,
    shape: GenerationShape,
    guidance: GuidanceConfig,
    negative_prompt: str | None = None,
    flow_shift: float | None = None,
    dtype: torch.dtype = torch.float32,
    sde_backend: SdeStepBackend | None = None,
    sde_step_indices: Sequence[int] | None = None,
    decode: bool = True,
    generator_device: str = "cpu",
    condition_image: torch.Tensor | None = None,
) -> ReferenceOutput:
    """Generate one image (or video) per prompt; sample b starts from the noise of `seeds[b]`.

    With `sde_backend`, steps in `sde_step_indices` (all steps when None) are stochastic; their noise comes
    from a second per-sample generator stream (the same generators, continued after the initial noise).
    `condition_image` (uint8 [H, W, 3]): the input image of an image-conditioned family, shared by every prompt.
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    generators = generators_from_seeds(seeds, device=generator_device)
    conditioning = family.encode_conditioning(pipe, list(prompts), negative_prompt, guidance, shape=shape,
                                              image=condition_image)
    sigmas = family.sigmas(pipe, num_steps, shape, flow_shift).to(torch.float32)
    latents = family.prepare_latents(pipe, shape, generators, dtype)
    modules = {name: getattr(pipe, name) for name in family.trainable_modules}
    batch = latents.shape[0]
    sde_steps = set(range(num_steps) if sde_step_indices is None else sde_step_indices)
    trajectory = [latents]
    log_probs: list[torch.Tensor] = []
    for k in range(num_steps):
        sigma = sigmas[k].expand(batch).to(latents.device)
        sigma_next = sigmas[k + 1].expand(batch).to(latents.device)
        velocity = family.predict_velocity(modules, latents, sigma, conditioning, guidance, shape, dtype)
        if sde_backend is not None and k in sde_steps:
            step = sde_backend.sample(latents, velocity, sigma, sigma_next, float(sigmas[1]), generators)
            latents = step.next_latents
            log_probs.append(step.log_prob)
        else:
            latents = ode_step(latents, velocity, sigma, sigma_next)
        trajectory.append(latents)
    latents = family.final_latents(latents, conditioning)
    images = family.decode(pipe, latents, shape) if decode else None
    return ReferenceOutput(
        images=images,
        latents=latents,
        sigmas=sigmas,
        timesteps=family.timesteps_from_sigmas(sigmas[:-1]),
        conditioning=conditioning,
        trajectory=trajectory,
        log_probs=log_probs,
    )
