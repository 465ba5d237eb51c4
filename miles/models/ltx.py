"""LTX-Video (`LTXPipeline`, text-to-video): packed latents [N, C], one T5 encoder.

Supported: `LTXPipeline` (LTX-Video 0.9.x text-to-video, e.g. Lightricks/LTX-Video). Not supported: the
image/condition/long-multi-prompt LTX pipelines (they condition on frames, which a text-prompt RL rollout
does not provide) and LTX-2 (`LTX2Pipeline`: joint audio + video latents, text connectors, a vocoder and a
Gemma 3 encoder; a different family, not yet implemented).

Mirrors `LTXPipeline.__call__` (diffusers 0.42):
- prompts through T5 padded to `max_sequence_length` (128) tokens, the attention mask kept beside the
  embeddings (the DiT masks padded caption tokens); the negative prompt defaults to "" like diffusers;
- noise [C, F', H', W'] per sample from its own generator (F' = (F−1)/r_t + 1, H' = H/r_s), packed to
  [F'·H'·W' / patch, C·patch];
- sigmas: the pipeline's base grid linspace(1, 1/n, n), shifted dynamically with μ from the latent token
  count F'·H'·W' (the checkpoint's base/max sequence lengths and shifts), stretched to `shift_terminal`
  (docs/algorithms.md §1); `--diffusion-flow-shift` replaces the dynamic shift by a static one;
- the DiT time input t = 1000·σ, the latent grid sizes and rope interpolation scale
  (r_t / fps, r_s, r_s) with fps = `--diffusion-fps` (default 25, the pipeline's `frame_rate`);
- decode: unpack, `x·std / scaling_factor + mean`, and for a timestep-conditioned VAE the pipeline's
  default decode timestep 0 (its decode noise scale 0 leaves the latents unchanged); `encode_images` (SFT)
  is the inverse, `(z − mean)·scaling_factor / std`, packed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    encode_with_negative,
    flux_style_base_grid,
    randn_per_sample,
    read_model_index,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

LTX_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block
DEFAULT_FRAME_RATE = 25.0  # LTXPipeline.__call__'s frame_rate default


def pack_latents(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, (F/pt)·(H/p)·(W/p), C·pt·p·p], the token order of `LTXPipeline._pack_latents`."""
    batch, channels, frames, height, width = latents.shape
    latents = latents.reshape(
        batch, channels, frames // patch_t, patch_t, height // patch, patch, width // patch, patch
    )
    return latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_latents(
    latents: torch.Tensor, frames: int, height: int, width: int, patch: int, patch_t: int
) -> torch.Tensor:
    """The inverse of `pack_latents`, given the latent grid (F', H', W') before patching."""
    batch = latents.shape[0]
    latents = latents.reshape(batch, frames // patch_t, height // patch, width // patch, -1, patch_t, patch, patch)
    return latents.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


@register_family
class LTXTrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "ltx"
    attention_uses_mask: ClassVar[bool] = True  # padded caption tokens
    name_hints: ClassVar[tuple[str, ...]] = ("ltx",)
    pipeline_class_name: ClassVar[str] = "LTXPipeline"
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = LTX_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    is_video: ClassVar[bool] = True
    max_sequence_length: ClassVar[int] = 128  # LTXPipeline.__call__'s default T5 length

    def __init__(self, model_backend: Any = None) -> None:
        super().__init__(model_backend)
        # The VAE's compression ratios and the DiT's patch sizes, read from the checkpoint at load time;
        # predict_velocity needs them to tell the DiT the latent grid.
        self.spatial_ratio: int | None = None
        self.temporal_ratio: int | None = None
        self.patch = 1
        self.patch_t = 1

    # ---- loading ------------------------------------------------------------------------------------
    def check_pipeline_class(self, path: str) -> None:
        """Refuse LTX checkpoints of another pipeline (LTX-2, image-to-video) before loading them."""
        index = read_model_index(path) if self.model_backend is None else None
        class_name = (index or {}).get("_class_name", self.pipeline_class_name)
        if class_name.startswith("LTX2"):
            raise MilesUserError(
                f"--hf-checkpoint {path!r} is an LTX-2 pipeline ({class_name}); LTX-2 (joint audio + video) is not "
                "supported yet, the ltx family supports LTXPipeline (LTX-Video text-to-video)"
            )
        if class_name != self.pipeline_class_name:
            raise MilesUserError(
                f"--hf-checkpoint {path!r} holds a {class_name}; the ltx family supports {self.pipeline_class_name} "
                "(LTX-Video text-to-video) only"
            )

    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        self.check_pipeline_class(path)
        return super().load_pipeline(path, dtype, device)

    def configure_pipeline(self, pipe: Any) -> None:
        self.spatial_ratio = pipe.vae_spatial_compression_ratio
        self.temporal_ratio = pipe.vae_temporal_compression_ratio
        self.patch = pipe.transformer_spatial_patch_size
        self.patch_t = pipe.transformer_temporal_patch_size

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLLTXVideo

        self.check_pipeline_class(path)
        modules = super().load_modules(path, names, dtype)
        # Only the VAE's compression ratios are needed: read them from its config, as its __init__ does.
        vae_config = AutoencoderKLLTXVideo.load_config(path, subfolder="vae")
        scalings = sum(bool(s) for s in vae_config.get("spatio_temporal_scaling", (True, True, True, False)))
        self.spatial_ratio = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2**scalings
        self.temporal_ratio = (
            vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2**scalings
        )
        transformer = modules.get("transformer")
        if transformer is not None:
            self.patch = transformer.config.patch_size
            self.patch_t = transformer.config.patch_size_t
        return modules

    # ---- conditioning -------------------------------------------------------------------------------
    def encode_prompt(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape | None = None,
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds` [B, 128, D] + `prompt_attention_mask` [B, 128] (bool); with CFG the negatives too."""

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            embeds, mask, _, _ = pipe.encode_prompt(
                prompt=batch, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length
            )
            return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

        return encode_with_negative(encode, prompts, negative_prompt, guidance.scale > 1.0)

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int, int]:
        """(F', H', W') of the unpacked latent; sizes the VAE cannot round-trip are refused with the flag named."""
        if self.spatial_ratio is None or self.temporal_ratio is None:
            raise RuntimeError("load the LTX pipeline (or its modules) before asking for latent sizes")
        temporal, spatial = self.temporal_ratio, self.spatial_ratio
        if shape.num_frames < 1 or (shape.num_frames - 1) % (temporal * self.patch_t):
            raise MilesUserError(
                f"--diffusion-output-num-frames {shape.num_frames} must be {temporal * self.patch_t}·k + 1 "
                "for LTX-Video "
                f"(e.g. 1, {temporal * self.patch_t + 1}, 121)"
            )
        multiple = max(spatial * self.patch, 32)  # LTXPipeline.check_inputs asks for multiples of 32
        if shape.height % multiple or shape.width % multiple:
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {multiple} for LTX-Video"
            )
        return ((shape.num_frames - 1) // temporal + 1, shape.height // spatial, shape.width // spatial)

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        frames, height, width = self.latent_grid(shape)
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=frames * height * width,  # the pipeline's video_sequence_length (before patching)
            base_grid=flux_style_base_grid(num_steps),
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        channels = pipe.transformer.config.in_channels
        noise = randn_per_sample((channels, *self.latent_grid(shape)), generators, device=pipe.transformer.device)
        return pack_latents(noise, self.patch, self.patch_t)

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
        frames, height, width = self.latent_grid(shape)
        timesteps = self.timesteps_from_sigmas(sigmas.to(device=latents.device, dtype=torch.float32).reshape(-1))
        cfg = guidance.scale > 1.0
        keys = ("prompt_embeds", "prompt_attention_mask")
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, keys, cfg)
        fps = shape.fps if shape.fps is not None else DEFAULT_FRAME_RATE
        output = transformer(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            timestep=timesteps,  # fp32 t = 1000·σ
            encoder_attention_mask=text["prompt_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            rope_interpolation_scale=(self.temporal_ratio / fps, self.spatial_ratio, self.spatial_ratio),
            return_dict=False,
        )[0]
        return combine_cfg(output, guidance.scale) if cfg else output.float()

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        frames, height, width = self.latent_grid(shape)
        latents = unpack_latents(latents, frames, height, width, self.patch, self.patch_t).to(vae.device)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        latents = latents * std / vae.config.scaling_factor + mean
        # The pipeline's decode timestep default is 0 with noise scale 0: the latents pass through unchanged.
        decode_timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=vae.dtype)
        timestep = decode_timestep if vae.config.timestep_conditioning else None
        with torch.no_grad():
            video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return vae_output_to_uint8(video)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Packed [B, N, C·pt·p·p]: the posterior mean normalised as `(z − mean) · scaling_factor / std` (the
        inverse of `decode`; `LTXImageToVideoPipeline._normalize_latents`), then `pack_latents`."""
        self.latent_grid(shape)  # refuses frame counts and sizes the VAE cannot round-trip
        vae = pipe.vae
        latents = vae_latent_mean(self, vae, pixels, shape, video_vae=True)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        return pack_latents((latents - mean) * vae.config.scaling_factor / std, self.patch, self.patch_t)
