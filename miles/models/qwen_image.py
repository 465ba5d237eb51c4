"""Qwen-Image (`QwenImagePipeline`): MMDiT on packed 2×2 latent patches, Qwen2.5-VL text states, true CFG.

Mirrors `QwenImagePipeline.__call__` (diffusers 0.42):
- Prompts are wrapped in the pipeline's chat template and encoded by Qwen2.5-VL (last hidden state); the
  template's leading tokens (`prompt_template_encode_start_idx`, 34 with the real tokenizer) are dropped.
  Here every prompt is zero-padded to a fixed `prompt_pad_length` (the pipeline's default
  `max_sequence_length`, 512) with an integer mask, so samples of any prompts stack; padded tokens are
  masked out of attention and do not change the result.
- True CFG (docs/algorithms.md §1): v = v_neg + s·(v_pos − v_neg), then per-token renormalisation to ‖v_pos‖, with
  s = `--diffusion-true-cfg-scale`, else `--diffusion-guidance-scale` (diffusers' default 4.0 either way).
- Schedule: base grid linspace(1, 1/n, n), dynamic exponential shift μ from the image token count, then
  the config's `shift_terminal` stretch.
- DiT time input: σ (the pipeline passes `timestep / 1000`; the time embedding scales by 1000 inside).
- Decode: unpack to [B, C, 1, h, w], undo the per-channel latents_mean/std, take frame 0 (`encode_images`,
  for SFT, is the inverse).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    Packed2x2TrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    encode_with_negative,
    flux_style_base_grid,
    normalize_latent_stats,
    pack_2x2_latents,
    pad_to_length,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
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


def template_prefix_length(pipe: Any, marker: str = "{}") -> int:
    """Tokens of the chat template before `marker` (the user prompt; Qwen-Image-Edit: its image): what the
    pipeline drops from the encoder output."""
    prefix = pipe.prompt_template_encode.split(marker)[0]
    return len(pipe.tokenizer(prefix).input_ids)


@register_family
class QwenImageTrainPipelineConfig(Packed2x2TrainPipelineConfig):
    family: ClassVar[str] = "qwen_image"
    attention_uses_mask: ClassVar[bool] = True  # padded prompt tokens
    name_hints: ClassVar[tuple[str, ...]] = ("qwen-image", "qwen_image", "qwenimage")
    pipeline_class_name: ClassVar[str] = "QwenImagePipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_embeds_mask")
    cfg_renormalize: ClassVar[bool] = True
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = QWEN_IMAGE_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    prompt_pad_length: ClassVar[int] = 512  # = the pipeline's default max_sequence_length (its truncation)
    latent_patch: ClassVar[int] = 2
    template_user_marker: ClassVar[str] = "{}"  # where the user turn's content starts in the pipeline's template

    def configure_pipeline(self, pipe: Any) -> None:
        super().configure_pipeline(pipe)
        start_idx = template_prefix_length(pipe, self.template_user_marker)
        if start_idx != pipe.prompt_template_encode_start_idx:
            logger.info(
                "tokenizer splits the prompt template's prefix into %d tokens (pipeline default %d); using %d",
                start_idx, pipe.prompt_template_encode_start_idx, start_idx,
            )
            pipe.prompt_template_encode_start_idx = start_idx

    @staticmethod
    def scale_factor_from_vae_config(vae_config: Mapping[str, Any]) -> int:
        return 2 ** len(vae_config["temperal_downsample"])  # the pipeline's own formula

    # ---- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def cfg_scale(guidance: GuidanceConfig) -> float:
        return guidance.scale

    def uses_cfg(self, guidance: GuidanceConfig) -> bool:
        return self.cfg_scale(guidance) > 1.0

    def _encode_padded(self, pipe: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = pipe.encode_prompt(prompt=prompts, max_sequence_length=self.prompt_pad_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {
            "prompt_embeds": pad_to_length(embeds, self.prompt_pad_length),
            "prompt_embeds_mask": pad_to_length(mask, self.prompt_pad_length),
        }

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
        return encode_with_negative(
            lambda batch: self._encode_padded(pipe, batch),
            prompts,
            negative_prompt,
            self.uses_cfg(guidance),
            default_negative=" ",
        )

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

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=self.num_image_tokens(shape),
            base_grid=flux_style_base_grid(num_steps),
        )

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
        timesteps = self.dit_timesteps(sigmas, device, dtype)
        keys = ("prompt_embeds", "prompt_embeds_mask")
        cfg = self.uses_cfg(guidance)
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, keys, cfg, "true CFG")
        latent_h, latent_w = self.latent_grid(shape)
        hidden_states, condition_shapes = self.with_condition_tokens(latents.to(dtype), conditioning, cfg, shape)
        img_shapes = [[(1, latent_h // 2, latent_w // 2), *condition_shapes]] * latents.shape[0]
        output = transformer(
            hidden_states=hidden_states,
            timestep=timesteps,
            guidance=self.distilled_guidance(transformer, latents.shape[0], guidance, device),  # distilled variants
            encoder_hidden_states_mask=text["prompt_embeds_mask"],
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            img_shapes=img_shapes,
            return_dict=False,
        )[0][:, : latents.shape[1]]  # the generated image's tokens (an edit's input-image tokens follow them)
        return combine_cfg(output, self.cfg_scale(guidance), renormalize=True) if cfg else output.float()

    def with_condition_tokens(
        self, hidden_states: torch.Tensor, conditioning: Mapping[str, torch.Tensor], cfg: bool, shape: GenerationShape
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The DiT's image tokens and the (frames, rows, columns) grids after the generated image's: none here;
        Qwen-Image-Edit appends its input image's tokens."""
        return hidden_states, []

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        unpacked = self.unpack(latents, shape).unsqueeze(2).to(vae.dtype)  # [B, C, 1, h, w]
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(unpacked.device, unpacked.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(unpacked.device, unpacked.dtype)
        with torch.no_grad():
            images = vae.decode(unpacked / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return vae_output_to_uint8(images)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Packed [B, N, 4C]: the one-frame posterior mean [B, C, 1, h, w] normalised by the VAE's
        latents_mean/std, frame 0, 2×2 packing (`QwenImageImg2ImgPipeline._encode_vae_image` + packing)."""
        self.latent_grid(shape)  # refuses sizes the 2×2 packing cannot tile
        latents = normalize_latent_stats(pipe.vae, vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=True))
        return pack_2x2_latents(latents[:, :, 0])
