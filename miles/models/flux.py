"""FLUX.1 (`FluxPipeline`): guidance-distilled MMDiT on packed 2×2 latent patches, CLIP pooled + T5 text.

Mirrors `FluxPipeline.__call__` (diffusers 0.42):
- The distilled guidance strength (`--diffusion-guidance-scale`, diffusers' `guidance_scale`, 3.5 for
  FLUX.1-dev) enters the DiT as its `guidance` embedding input when the transformer has `guidance_embeds`;
  it is not CFG. Real CFG is `--diffusion-true-cfg-scale` > 1 (diffusers' `true_cfg_scale` with a negative
  prompt): v = v_neg + s·(v_pos − v_neg), without renormalisation, run here as one doubled batch.
- Latents are packed: a sample is [N, 4C] with N = (H/2f)·(W/2f) tokens (f = VAE scale factor); the
  position ids of image and text tokens are rebuilt from the shape, never stored.
- Schedule: base grid linspace(1, 1/n, n), dynamic shift μ from N (ALGORITHMS.md §1).
- DiT time input: σ — the pipeline passes `timestep / 1000` (timesteps = 1000·σ) and the transformer
  multiplies by 1000 inside.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_doubled,
    cfg_pair,
    combine_cfg,
    flux_style_base_grid,
    randn_per_sample,
    repeat_batch,
    scheduler_sigmas,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

# Attention projections of the dual-stream blocks (image and text streams) and of the single-stream blocks.
FLUX_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


def vae_scale_factor_from_folder(path: str, default: int = 8) -> int:
    """2^(levels − 1) from `vae/config.json` of a local pipeline folder (the pipelines' own formula)."""
    config_path = os.path.join(path, "vae", "config.json")
    if not os.path.isfile(config_path):
        return default
    with open(config_path) as f:
        return 2 ** (len(json.load(f)["block_out_channels"]) - 1)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2×2 patches as tokens (the pipeline's `_pack_latents`)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, latent_h: int, latent_w: int) -> torch.Tensor:
    """The inverse of `pack_latents`: [B, N, 4C] -> [B, C, h, w]."""
    b, _, channels = latents.shape
    patches = latents.view(b, latent_h // 2, latent_w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, latent_h, latent_w)


def image_position_ids(grid_h: int, grid_w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[grid_h·grid_w, 3] ids (0, row, column), the pipeline's `_prepare_latent_image_ids`."""
    ids = torch.zeros(grid_h, grid_w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(grid_h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(grid_w)[None, :]
    return ids.reshape(grid_h * grid_w, 3).to(device=device, dtype=dtype)


@register_family
class FluxTrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "flux"
    name_hints: ClassVar[tuple[str, ...]] = ("flux",)
    pipeline_class_name: ClassVar[str] = "FluxPipeline"
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = FLUX_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
    )
    max_sequence_length: ClassVar[int] = 512  # the pipeline's default T5 length

    def __init__(self, model_backend=None) -> None:
        super().__init__(model_backend)
        self.vae_scale_factor: int | None = None  # learnt at load time; packing needs it without the VAE

    def configure_pipeline(self, pipe: Any) -> None:
        self.vae_scale_factor = pipe.vae_scale_factor

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        modules = super().load_modules(path, names, dtype)
        if self.vae_scale_factor is None:
            self.vae_scale_factor = vae_scale_factor_from_folder(path)
        return modules

    # ---- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def uses_cfg(guidance: GuidanceConfig) -> bool:
        return guidance.true_cfg_scale is not None and guidance.true_cfg_scale > 1.0

    def encode_prompt(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape | None = None,
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds` [B, T5 length, D] (T5), `pooled_prompt_embeds` [B, P] (CLIP pooler output);
        with true CFG also the negatives (the negative prompt encoded once, repeated)."""
        prompts = list(prompts)
        with torch.no_grad():
            prompt_embeds, pooled, _ = pipe.encode_prompt(
                prompt=prompts, prompt_2=None, max_sequence_length=self.max_sequence_length
            )
            conditioning = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
            if self.uses_cfg(guidance):
                negative_embeds, negative_pooled, _ = pipe.encode_prompt(
                    prompt=[negative_prompt if negative_prompt is not None else " "],  # the engine's default
                    prompt_2=None,
                    max_sequence_length=self.max_sequence_length,
                )
                conditioning["negative_prompt_embeds"] = repeat_batch(negative_embeds, len(prompts))
                conditioning["negative_pooled_prompt_embeds"] = repeat_batch(negative_pooled, len(prompts))
        return conditioning

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int]:
        """The unpacked latent height and width: 2·⌊H / 2f⌋ (the pipeline floors to even latent sizes)."""
        scale = self.vae_scale_factor or 8
        latent_h, latent_w = 2 * (shape.height // (scale * 2)), 2 * (shape.width // (scale * 2))
        if latent_h == 0 or latent_w == 0:
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} is smaller than one FLUX latent patch "
                f"({scale * 2} px)"
            )
        return latent_h, latent_w

    def num_image_tokens(self, shape: GenerationShape) -> int:
        latent_h, latent_w = self.latent_grid(shape)
        return (latent_h // 2) * (latent_w // 2)

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        config = pipe.scheduler.config
        base = None if config.get("use_flow_sigmas") else flux_style_base_grid(num_steps)
        return scheduler_sigmas(
            config, num_steps, flow_shift=flow_shift, image_seq_len=self.num_image_tokens(shape), base_grid=base
        )

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """FLUX's DiT takes σ (the pipeline divides its 1000·σ timesteps by 1000)."""
        return sigmas * self.num_train_timesteps / self.num_train_timesteps

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        latent_h, latent_w = self.latent_grid(shape)
        channels = pipe.transformer.config.in_channels // 4
        noise = randn_per_sample((channels, latent_h, latent_w), generators, device=pipe.transformer.device)
        return pack_latents(noise)

    # ---- the denoiser -------------------------------------------------------------------------------
    def predict_velocity(
        self,
        modules: Mapping[str, nn.Module],
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        conditioning: Mapping[str, torch.Tensor],
        guidance: GuidanceConfig,
        shape: GenerationShape,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        transformer = modules["transformer"]
        device = latents.device
        # Exactly the pipeline's expression: scheduler timesteps (fp32 1000·σ) cast to the latents' dtype, / 1000.
        timesteps = (sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps).to(dtype) / 1000
        prompt_embeds = conditioning["prompt_embeds"]
        pooled = conditioning["pooled_prompt_embeds"]
        cfg = self.uses_cfg(guidance)
        if cfg:
            if "negative_prompt_embeds" not in conditioning:
                raise ValueError("true CFG is on but the conditioning holds no negative_prompt_embeds")
            latents = cfg_doubled(latents)
            timesteps = cfg_doubled(timesteps)
            prompt_embeds = cfg_pair(conditioning["negative_prompt_embeds"], prompt_embeds)
            pooled = cfg_pair(conditioning["negative_pooled_prompt_embeds"], pooled)
        distilled_guidance = None
        if transformer.config.guidance_embeds:
            distilled_guidance = torch.full((latents.shape[0],), guidance.guidance_scale, device=device)
        grid_h, grid_w = (size // 2 for size in self.latent_grid(shape))
        ids_dtype = prompt_embeds.dtype
        output = transformer(
            hidden_states=latents.to(dtype),
            timestep=timesteps,
            guidance=distilled_guidance,
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=prompt_embeds.to(dtype),
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=ids_dtype),
            img_ids=image_position_ids(grid_h, grid_w, device, ids_dtype),
            return_dict=False,
        )[0]
        return combine_cfg(output, guidance.true_cfg_scale) if cfg else output.float()

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        unpacked = unpack_latents(latents, *self.latent_grid(shape))
        scaled = unpacked / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        with torch.no_grad():
            images = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
        return vae_output_to_uint8(images)
