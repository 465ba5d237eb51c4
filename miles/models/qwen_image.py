"""Qwen-Image (`QwenImagePipeline`): MMDiT on packed 2×2 latent patches, Qwen2.5-VL text states, true CFG.

Mirrors `QwenImagePipeline.__call__` (diffusers 0.42):
- Prompts are wrapped in the pipeline's chat template and encoded by Qwen2.5-VL (last hidden state); the
  template's leading tokens (`prompt_template_encode_start_idx`, 34 with the real tokenizer) are dropped.
  Here every prompt is zero-padded to a fixed `prompt_pad_length` (the pipeline's default
  `max_sequence_length`, 512) with an integer mask, so samples of any prompts stack; padded tokens are
  masked out of attention and do not change the result.
- True CFG (ALGORITHMS.md §1): v = v_neg + s·(v_pos − v_neg), then per-token renormalisation to ‖v_pos‖, with
  s = `--diffusion-true-cfg-scale`, else `--diffusion-guidance-scale` (diffusers' default 4.0 either way).
- Schedule: base grid linspace(1, 1/n, n), dynamic exponential shift μ from the image token count, then
  the config's `shift_terminal` stretch.
- DiT time input: σ (the pipeline passes `timestep / 1000`; the time embedding scales by 1000 inside).
- Decode: unpack to [B, C, 1, h, w], undo the per-channel latents_mean/std, take frame 0.
"""

from __future__ import annotations

import json
import logging
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
    pad_to_length,
    randn_per_sample,
    repeat_batch,
    scheduler_sigmas,
    vae_output_to_uint8,
)
from miles.models.flux import pack_latents, unpack_latents
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

# Attention projections of both streams of every block (image: to_*, text: add_* / to_add_out).
QWEN_IMAGE_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


def template_prefix_length(pipe: Any) -> int:
    """Tokens of the chat template before the user prompt: what the pipeline drops from the encoder output."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    return len(pipe.tokenizer(prefix).input_ids)


@register_family
class QwenImageTrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "qwen_image"
    name_hints: ClassVar[tuple[str, ...]] = ("qwen-image", "qwen_image", "qwenimage")
    pipeline_class_name: ClassVar[str] = "QwenImagePipeline"
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = QWEN_IMAGE_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    prompt_pad_length: ClassVar[int] = 512  # = the pipeline's default max_sequence_length (its truncation)
    latent_patch: ClassVar[int] = 2

    def __init__(self, model_backend=None) -> None:
        super().__init__(model_backend)
        self.vae_scale_factor: int | None = None

    def configure_pipeline(self, pipe: Any) -> None:
        self.vae_scale_factor = pipe.vae_scale_factor
        start_idx = template_prefix_length(pipe)
        if start_idx != pipe.prompt_template_encode_start_idx:
            logger.info(
                "tokenizer splits the prompt template's prefix into %d tokens (pipeline default %d); using %d",
                start_idx, pipe.prompt_template_encode_start_idx, start_idx,
            )
            pipe.prompt_template_encode_start_idx = start_idx

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        modules = super().load_modules(path, names, dtype)
        if self.vae_scale_factor is None:
            self.vae_scale_factor = self._vae_scale_factor_from_folder(path)
        return modules

    @staticmethod
    def _vae_scale_factor_from_folder(path: str) -> int:
        config_path = os.path.join(path, "vae", "config.json")
        if not os.path.isfile(config_path):
            return 8
        with open(config_path) as f:
            return 2 ** len(json.load(f)["temperal_downsample"])  # the pipeline's own formula

    # ---- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def cfg_scale(guidance: GuidanceConfig) -> float:
        return guidance.scale

    def uses_cfg(self, guidance: GuidanceConfig) -> bool:
        return self.cfg_scale(guidance) > 1.0

    def _encode_padded(self, pipe: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = pipe.encode_prompt(prompt=prompts, max_sequence_length=self.prompt_pad_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return pad_to_length(embeds, self.prompt_pad_length), pad_to_length(mask, self.prompt_pad_length)

    def encode_prompt(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape | None = None,
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds` [B, L, D] and `prompt_embeds_mask` [B, L] (int64, 1 = token), L = prompt_pad_length;
        with CFG also `negative_prompt_embeds` / `negative_prompt_embeds_mask` (encoded once, repeated)."""
        prompts = list(prompts)
        with torch.no_grad():
            embeds, mask = self._encode_padded(pipe, prompts)
            conditioning = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
            if self.uses_cfg(guidance):
                negative = negative_prompt if negative_prompt is not None else " "
                neg_embeds, neg_mask = self._encode_padded(pipe, [negative])
                conditioning["negative_prompt_embeds"] = repeat_batch(neg_embeds, len(prompts))
                conditioning["negative_prompt_embeds_mask"] = repeat_batch(neg_mask, len(prompts))
        return conditioning

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int]:
        """Unpacked latent height and width, 2·⌊H / 2f⌋ like the pipeline."""
        scale = self.vae_scale_factor or 8
        if shape.height % (scale * 2) or shape.width % (scale * 2):
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {scale * 2} "
                "(VAE scale factor × patch size) for Qwen-Image"
            )
        return 2 * (shape.height // (scale * 2)), 2 * (shape.width // (scale * 2))

    def num_image_tokens(self, shape: GenerationShape) -> int:
        latent_h, latent_w = self.latent_grid(shape)
        return (latent_h // 2) * (latent_w // 2)

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=self.num_image_tokens(shape),
            base_grid=flux_style_base_grid(num_steps),
        )

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Qwen-Image's DiT takes σ = t / 1000 (ALGORITHMS.md §1)."""
        return sigmas * self.num_train_timesteps / self.num_train_timesteps

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        latent_h, latent_w = self.latent_grid(shape)
        channels = pipe.transformer.config.in_channels // 4
        # The pipeline draws [1, C, h, w] per sample (a frame axis of 1), the same numbers as [C, h, w].
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
        # The pipeline's expression: scheduler timesteps (fp32 1000·σ) cast to the latents' dtype, / 1000.
        timesteps = (sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps).to(dtype) / 1000
        prompt_embeds = conditioning["prompt_embeds"]
        mask = conditioning["prompt_embeds_mask"]
        cfg = self.uses_cfg(guidance)
        if cfg:
            if "negative_prompt_embeds" not in conditioning:
                raise ValueError("true CFG is on but the conditioning holds no negative_prompt_embeds")
            latents = cfg_doubled(latents)
            timesteps = cfg_doubled(timesteps)
            prompt_embeds = cfg_pair(conditioning["negative_prompt_embeds"], prompt_embeds)
            mask = cfg_pair(conditioning["negative_prompt_embeds_mask"], mask)
        distilled_guidance = None
        if transformer.config.guidance_embeds:  # guidance-distilled variants only
            distilled_guidance = torch.full((latents.shape[0],), guidance.guidance_scale, device=device)
        latent_h, latent_w = self.latent_grid(shape)
        img_shapes = [[(1, latent_h // 2, latent_w // 2)]] * latents.shape[0]
        output = transformer(
            hidden_states=latents.to(dtype),
            timestep=timesteps,
            guidance=distilled_guidance,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=prompt_embeds.to(dtype),
            img_shapes=img_shapes,
            return_dict=False,
        )[0]
        return combine_cfg(output, self.cfg_scale(guidance), renormalize=True) if cfg else output.float()

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        latent_h, latent_w = self.latent_grid(shape)
        unpacked = unpack_latents(latents, latent_h, latent_w).unsqueeze(2).to(vae.dtype)  # [B, C, 1, h, w]
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(unpacked.device, unpacked.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(unpacked.device, unpacked.dtype)
        with torch.no_grad():
            images = vae.decode(unpacked / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return vae_output_to_uint8(images)
