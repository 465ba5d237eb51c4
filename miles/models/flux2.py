"""FLUX.2 (`Flux2Pipeline`, text-to-image): guidance-distilled MMDiT on 2×2-patched latents, one Mistral 3 encoder.

Mirrors `Flux2Pipeline.__call__` (diffusers 0.42) without reference images:
- prompts through the pipeline's chat template (its system message) and the Mistral 3 encoder, padded to
  `max_sequence_length` (512) tokens; the hidden states of layers (10, 20, 30) stacked along the features:
  `prompt_embeds` [B, L, 3·D]. Text positions are (0, 0, 0, l), image positions (0, i, j, 0);
- noise is drawn directly in the patched layout [4C, h/2, w/2] per sample (h = 2·⌊H / 2f⌋, f the VAE scale factor)
  and flattened row-major to tokens [h/2·w/2, 4C];
- sigmas: the base grid linspace(1, 1/n, n) (none with `use_flow_sigmas`), shifted dynamically with the
  pipeline's *empirical* μ(image tokens, n) when the scheduler has `use_dynamic_shifting` (else its static
  shift); `--diffusion-flow-shift` replaces it by a static shift (docs/algorithms.md §1);
- the DiT takes σ (the pipeline's t/1000) and the distilled guidance strength `--diffusion-guidance-scale`
  (diffusers' `guidance_scale`, default 4.0) as its guidance embedding. There is no CFG and no negative prompt:
  `--diffusion-true-cfg-scale` above 1 is refused;
- decode: tokens back to [4C, h/2, w/2], `x·sqrt(bn.var + eps) + bn.mean` (the VAE's batch-norm statistics),
  un-patched to [C, h, w], then the VAE decoder; `encode_images` (SFT) is the inverse (the pipeline's
  `_encode_vae_image`: posterior mode, patch, normalise).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    Packed2x2TrainPipelineConfig,
    encode_with_negative,
    even_latent_grid,
    randn_per_sample,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

# Double-stream attention (image and text projections) and the single-stream blocks' fused QKV+MLP input
# projection. (Their output projection is also called `attn.to_out`, a ModuleList in the double-stream blocks, so
# a suffix cannot name it alone.)
FLUX2_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_qkv_mlp_proj",
)


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's dynamic-shift μ, fitted on image tokens and step count (`compute_empirical_mu`): linear in the
    token count, and above 4300 tokens independent of the steps; below, interpolated in the step count between
    the 10-step and 200-step fits."""
    slope_10, intercept_10 = 8.73809524e-05, 1.89833333
    slope_200, intercept_200 = 0.00016927, 0.45666666
    mu_200 = slope_200 * image_seq_len + intercept_200
    if image_seq_len > 4300:
        return float(mu_200)
    mu_10 = slope_10 * image_seq_len + intercept_10
    per_step = (mu_200 - mu_10) / 190.0
    return float(per_step * num_steps + mu_200 - 200.0 * per_step)


def patch_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2]: each 2×2 patch into channels c·4 + 2·dy + dx (`_patchify_latents`)."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(batch, channels * 4, height // 2, width // 2)


def unpatch_latents(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patch_latents`."""
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(batch, channels // 4, height * 2, width * 2)


def tokens_from_grid(latents: torch.Tensor) -> torch.Tensor:
    """[B, 4C, h', w'] -> [B, h'·w', 4C], row-major (`Flux2Pipeline._pack_latents`)."""
    return latents.flatten(2).transpose(1, 2)


def grid_from_tokens(tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """The inverse of `tokens_from_grid` for the row-major positions the pipeline assigns."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], grid_h, grid_w)


def position_ids(batch: int, t: int, h: int, w: int, length: int, device: torch.device) -> torch.Tensor:
    """[B, t·h·w·length, 4] coordinates (T, H, W, L) in row-major order (the pipeline's cartesian products)."""
    axes = [torch.arange(size, device=device) for size in (t, h, w, length)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 4)
    return grid.unsqueeze(0).expand(batch, -1, -1)


@register_family
class Flux2TrainPipelineConfig(Packed2x2TrainPipelineConfig):
    family: ClassVar[str] = "flux2"
    name_hints: ClassVar[tuple[str, ...]] = ("flux.2", "flux2", "flux-2", "flux_2")
    pipeline_class_name: ClassVar[str] = "Flux2Pipeline"
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = FLUX2_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    max_sequence_length: ClassVar[int] = 512  # Flux2Pipeline.__call__'s default
    text_encoder_out_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)  # its default hidden-state layers

    @staticmethod
    def scale_factor_from_vae_config(vae_config: Mapping[str, Any]) -> int:
        """2^(levels − 1) of the AutoencoderKLFlux2 (the pipeline's own formula)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    # ---- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def check_guidance(guidance: GuidanceConfig) -> None:
        if guidance.true_cfg_scale is not None and guidance.true_cfg_scale > 1.0:
            raise MilesUserError(
                f"--diffusion-true-cfg-scale {guidance.true_cfg_scale:g}: FLUX.2 is guidance-distilled and has no "
                "negative prompt; use --diffusion-guidance-scale (its guidance embedding) instead"
            )

    def encode_prompt(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape | None = None,
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds` [B, L, 3·D]: the stacked Mistral 3 hidden states (the negative prompt is unused)."""
        self.check_guidance(guidance)

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            embeds, _ = pipe.encode_prompt(
                prompt=batch,
                max_sequence_length=self.max_sequence_length,
                text_encoder_out_layers=self.text_encoder_out_layers,
            )
            return {"prompt_embeds": embeds}

        return encode_with_negative(encode, prompts, negative_prompt, cfg=False)

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int]:
        return even_latent_grid(shape, self.vae_scale_factor or 16, "FLUX.2")

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        config = pipe.scheduler.config
        base = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1.0 / num_steps, num_steps).tolist()
        tokens = self.num_image_tokens(shape)
        return scheduler_sigmas(
            config, num_steps, flow_shift=flow_shift, image_seq_len=tokens, base_grid=base,
            mu=empirical_mu(tokens, num_steps),
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        latent_h, latent_w = self.latent_grid(shape)
        channels = pipe.transformer.config.in_channels  # already 4C: the noise is drawn patched
        noise = randn_per_sample((channels, latent_h // 2, latent_w // 2), generators, device=pipe.transformer.device)
        return tokens_from_grid(noise)

    def unpack(self, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Tokens [B, N, 4C] -> patched latents [B, 4C, h/2, w/2] (still normalised)."""
        latent_h, latent_w = self.latent_grid(shape)
        return grid_from_tokens(latents, latent_h // 2, latent_w // 2)

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
        self.check_guidance(guidance)
        transformer = modules["transformer"]
        device = latents.device
        batch = latents.shape[0]
        prompt_embeds = conditioning["prompt_embeds"]
        latent_h, latent_w = self.latent_grid(shape)
        output = transformer(
            hidden_states=latents.to(dtype),
            timestep=self.dit_timesteps(sigmas, device, dtype),  # σ, as the pipeline's t/1000
            guidance=self.distilled_guidance(transformer, batch, guidance, device),
            encoder_hidden_states=prompt_embeds.to(dtype),
            txt_ids=position_ids(batch, 1, 1, 1, prompt_embeds.shape[1], device),
            img_ids=position_ids(batch, 1, latent_h // 2, latent_w // 2, 1, device),
            return_dict=False,
        )[0]
        return output.float()

    # ---- output -------------------------------------------------------------------------------------
    @staticmethod
    def batch_norm_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like)
        return mean, std

    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        patched = self.unpack(latents, shape).to(vae.device)
        mean, std = self.batch_norm_stats(vae, patched)
        with torch.no_grad():
            images = vae.decode(unpatch_latents(patched * std + mean).to(vae.dtype), return_dict=False)[0]
        return vae_output_to_uint8(images)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Tokens [B, N, 4C]: the posterior mode, 2×2-patched, normalised by the VAE's batch-norm statistics
        (`Flux2Pipeline._encode_vae_image`), then flattened like `prepare_latents`."""
        scale = self.vae_scale_factor or pipe.vae_scale_factor
        if shape.height % (scale * 2) or shape.width % (scale * 2):
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {scale * 2} "
                "(VAE scale factor × 2×2 patches) to encode FLUX.2 SFT images"
            )
        patched = patch_latents(vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=False))
        mean, std = self.batch_norm_stats(pipe.vae, patched)
        return tokens_from_grid((patched - mean) / std)
