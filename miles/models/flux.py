"""FLUX.1 (`FluxPipeline`): guidance-distilled MMDiT on packed 2×2 latent patches, CLIP pooled + T5 text.

Mirrors `FluxPipeline.__call__` (diffusers 0.42):
- The distilled guidance strength (`--diffusion-guidance-scale`, diffusers' `guidance_scale`, 3.5 for
  FLUX.1-dev) enters the DiT as its `guidance` embedding input when the transformer has `guidance_embeds`;
  it is not CFG. Real CFG is `--diffusion-true-cfg-scale` > 1 (diffusers' `true_cfg_scale` with a negative
  prompt): v = v_neg + s·(v_pos − v_neg), without renormalisation, run here as one doubled batch.
- Latents are packed: a sample is [N, 4C] with N = (H/2f)·(W/2f) tokens (f = VAE scale factor); the
  position ids of image and text tokens are rebuilt from the shape, never stored.
- Schedule: base grid linspace(1, 1/n, n), dynamic shift μ from N (docs/algorithms.md §1).
- DiT time input: σ — the pipeline passes `timestep / 1000` (timesteps = 1000·σ) and the transformer
  multiplies by 1000 inside.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    Packed2x2TrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    decode_scaled_latents,
    encode_with_negative,
    even_latent_grid,
    flux_style_base_grid,
    pack_2x2_latents,
    scale_shift_latents,
    scheduler_sigmas,
    unpack_2x2_latents,
    vae_latent_mean,
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

# The pipeline's `_pack_latents` / `_unpack_latents` (shared with Qwen-Image, defined once in common).
pack_latents = pack_2x2_latents
unpack_latents = unpack_2x2_latents


def image_position_ids(grid_h: int, grid_w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[grid_h·grid_w, 3] ids (0, row, column), the pipeline's `_prepare_latent_image_ids`."""
    ids = torch.zeros(grid_h, grid_w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(grid_h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(grid_w)[None, :]
    return ids.reshape(grid_h * grid_w, 3).to(device=device, dtype=dtype)


@register_family
class FluxTrainPipelineConfig(Packed2x2TrainPipelineConfig):
    family: ClassVar[str] = "flux"
    compile_vae_decoder: ClassVar[bool] = True  # AutoencoderKL
    name_hints: ClassVar[tuple[str, ...]] = ("flux",)
    pipeline_class_name: ClassVar[str] = "FluxPipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")  # true CFG
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

    @staticmethod
    def scale_factor_from_vae_config(vae_config: Mapping[str, Any]) -> int:
        """2^(levels − 1) of the AutoencoderKL (the pipeline's own formula)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

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

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            prompt_embeds, pooled, _ = pipe.encode_prompt(
                prompt=batch, prompt_2=None, max_sequence_length=self.max_sequence_length
            )
            return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

        # " " is the engine's default negative prompt
        return encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance), default_negative=" ")

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int]:
        return even_latent_grid(shape, self.vae_scale_factor or 8, "FLUX")

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        config = pipe.scheduler.config
        base = None if config.get("use_flow_sigmas") else flux_style_base_grid(num_steps)
        return scheduler_sigmas(
            config, num_steps, flow_shift=flow_shift, image_seq_len=self.num_image_tokens(shape), base_grid=base
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
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        cfg = self.uses_cfg(guidance)
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, keys, cfg, "true CFG")
        prompt_embeds, pooled = text["prompt_embeds"], text["pooled_prompt_embeds"]
        grid_h, grid_w = (size // 2 for size in self.latent_grid(shape))
        ids_dtype = prompt_embeds.dtype
        num_tokens = latents.shape[1]
        hidden_states, img_ids = self.with_condition_tokens(
            latents.to(dtype), image_position_ids(grid_h, grid_w, device, ids_dtype), conditioning, cfg
        )
        output = transformer(
            hidden_states=hidden_states,
            timestep=timesteps,
            guidance=self.distilled_guidance(transformer, latents.shape[0], guidance, device),
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=prompt_embeds.to(dtype),
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=ids_dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0][:, :num_tokens]  # the generated image's tokens; condition tokens (Kontext) come after them
        return combine_cfg(output, guidance.true_cfg_scale) if cfg else output.float()

    def with_condition_tokens(
        self, hidden_states: torch.Tensor, img_ids: torch.Tensor, conditioning: Mapping[str, torch.Tensor], cfg: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The DiT's image-stream tokens and their position ids: the generated image's alone for FLUX.1
        (FLUX.1-Kontext appends its input image's tokens)."""
        return hidden_states, img_ids

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        return decode_scaled_latents(pipe.vae, self.unpack(latents, shape))

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Packed [B, N, 4C]: `(z − shift_factor) · scaling_factor` of the posterior mean, then 2×2 packing
        (`FluxImg2ImgPipeline._encode_vae_image` + `_pack_latents`)."""
        scale = self.vae_scale_factor or pipe.vae_scale_factor
        if shape.height % (scale * 2) or shape.width % (scale * 2):
            # The pipeline would floor the latent grid to even sizes; an encoded image must fill it exactly.
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {scale * 2} "
                "(VAE scale factor × 2×2 packing) to encode FLUX SFT images"
            )
        latents = scale_shift_latents(pipe.vae, vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=False))
        return pack_latents(latents)
