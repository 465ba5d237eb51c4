"""HunyuanVideo-1.5 (`HunyuanVideo15Pipeline`, text-to-video): latents [C, F', H', W'], Qwen2.5-VL + ByT5 text.

Mirrors `HunyuanVideo15Pipeline.__call__` (diffusers 0.42):
- prompts through the pipeline's chat template (its system message) and the Qwen2.5-VL text model, padded to
  `max_sequence_length` (the pipeline's 1000) plus the template's first `prompt_template_encode_start_idx` (108)
  tokens, which are then dropped; the third-to-last hidden state: `prompt_embeds` [B, 1000, D] and
  `prompt_embeds_mask`. The glyph encoder (ByT5) reads the quoted text of a prompt (`"…"`), padded to
  `glyph_sequence_length` (256); a prompt without quotes gets zero embeddings and an all-zero mask:
  `prompt_embeds_2`, `prompt_embeds_mask_2`. Masks are kept as the pipeline casts them (floating point);
- noise [C, F', H', W'] per sample (F' = (F−1)/r_t + 1, H' = H/r_s); the DiT input is the noise concatenated
  with the text-to-video condition (an all-zero latent and an all-zero mask channel), plus all-zero image
  embeddings [729, image_embed_dim];
- sigmas: the grid linspace(1, 0, n+1)[:-1] with the scheduler's static shift (docs/algorithms.md §1);
  `--diffusion-flow-shift` replaces the shift; the DiT time input is t = 1000·σ;
- CFG: standard, `v_neg + s·(v_pos − v_neg)` with s = `--diffusion-guidance-scale` (the pipeline takes it from
  its `guider` component; a guider with rescale, a step window or the original formulation is refused);
  negative prompt default "" (the pipeline's None);
- decode: `x / scaling_factor` through the VAE, one sample per call (the VAE's causal attention mask does not
  broadcast over a batch in diffusers 0.42); `encode_images` (SFT) is the inverse: posterior mean ·
  scaling_factor (`HunyuanVideo15ImageToVideoPipeline`'s encode), also per sample.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    encode_with_negative,
    randn_per_sample,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

HUNYUAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
NUM_IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: the (zero) image embeddings of t2v


@register_family
class HunyuanVideoTrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "hunyuan_video"
    attention_uses_mask: ClassVar[bool] = True  # padded prompt and glyph tokens
    name_hints: ClassVar[tuple[str, ...]] = ("hunyuanvideo", "hunyuan_video", "hunyuan-video")
    pipeline_class_name: ClassVar[str] = "HunyuanVideo15Pipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = TEXT_KEYS
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = HUNYUAN_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
    )
    is_video: ClassVar[bool] = True

    def __init__(self, model_backend: Any = None) -> None:
        super().__init__(model_backend)
        # Text lengths; None = the pipeline's (tokenizer_max_length 1000, tokenizer_2_max_length 256).
        self.max_sequence_length: int | None = None
        self.glyph_sequence_length: int | None = None
        # The VAE's compression ratios, read at load time (the trainer loads no VAE).
        self.spatial_ratio: int | None = None
        self.temporal_ratio: int | None = None

    # ---- loading ------------------------------------------------------------------------------------
    def check_pipeline_class(self, path: str) -> None:
        from miles.models.common import read_model_index

        index = read_model_index(path) if self.model_backend is None else None
        class_name = (index or {}).get("_class_name", self.pipeline_class_name)
        if class_name != self.pipeline_class_name:
            raise MilesUserError(
                f"--hf-checkpoint {path!r} holds a {class_name}; the hunyuan_video family supports "
                f"{self.pipeline_class_name} (HunyuanVideo-1.5 text-to-video) only"
            )

    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        self.check_pipeline_class(path)
        return super().load_pipeline(path, dtype, device)

    def configure_pipeline(self, pipe: Any) -> None:
        self.spatial_ratio = pipe.vae_scale_factor_spatial
        self.temporal_ratio = pipe.vae_scale_factor_temporal
        guider = getattr(pipe, "guider", None)
        if guider is not None:
            config = guider.config
            if config.get("guidance_rescale", 0.0) or config.get("start", 0.0) != 0.0 or config.get("stop", 1.0) != 1.0 \
                    or config.get("use_original_formulation", False):
                raise MilesUserError(
                    "the checkpoint's guider uses guidance rescale, a step window or the original CFG formulation; "
                    "the hunyuan_video family supports plain CFG only (scale from --diffusion-guidance-scale)"
                )

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLHunyuanVideo15

        self.check_pipeline_class(path)
        modules = super().load_modules(path, names, dtype)
        if self.model_backend is None:
            vae_config = AutoencoderKLHunyuanVideo15.load_config(path, subfolder="vae")
            self.spatial_ratio = vae_config.get("spatial_compression_ratio", 16)
            self.temporal_ratio = vae_config.get("temporal_compression_ratio", 4)
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
        """`prompt_embeds` [B, L, D] + `prompt_embeds_mask` [B, L] (Qwen2.5-VL), `prompt_embeds_2` [B, L₂, D₂] +
        `prompt_embeds_mask_2` [B, L₂] (ByT5 glyphs); with CFG the negatives too."""
        device = pipe.text_encoder.device
        text_length = self.max_sequence_length or pipe.tokenizer_max_length
        glyph_length = self.glyph_sequence_length or pipe.tokenizer_2_max_length

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            embeds, mask = pipe._get_mllm_prompt_embeds(
                text_encoder=pipe.text_encoder,
                tokenizer=pipe.tokenizer,
                prompt=batch,
                device=device,
                tokenizer_max_length=text_length,
                system_message=pipe.system_message,
                crop_start=pipe.prompt_template_encode_start_idx,
            )
            glyph_embeds, glyph_mask = pipe._get_byt5_prompt_embeds(
                tokenizer=pipe.tokenizer_2,
                text_encoder=pipe.text_encoder_2,
                prompt=batch,
                device=device,
                tokenizer_max_length=glyph_length,
            )
            values = (embeds, mask, glyph_embeds, glyph_mask)
            return {key: value.float() for key, value in zip(TEXT_KEYS, values)}

        return encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance))

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int, int]:
        """(F', H', W'); sizes the VAE cannot round-trip are refused with the flag named."""
        if self.spatial_ratio is None or self.temporal_ratio is None:
            raise RuntimeError("load the HunyuanVideo-1.5 pipeline (or its modules) before asking for latent sizes")
        temporal, spatial = self.temporal_ratio, self.spatial_ratio
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise MilesUserError(
                f"--diffusion-output-num-frames {shape.num_frames} must be {temporal}·k + 1 for HunyuanVideo-1.5 "
                f"(e.g. 1, {temporal + 1}, 121)"
            )
        if shape.height % spatial or shape.width % spatial:
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {spatial} for "
                "HunyuanVideo-1.5"
            )
        return (shape.num_frames - 1) // temporal + 1, shape.height // spatial, shape.width // spatial

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        frames, height, width = self.latent_grid(shape)
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=frames * height * width,
            base_grid=np.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist(),  # the pipeline's grid
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        channels = pipe.transformer.config.out_channels
        return randn_per_sample((channels, *self.latent_grid(shape)), generators, device=pipe.transformer.device)

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
        timesteps = self.timesteps_from_sigmas(sigmas.to(device=latents.device, dtype=torch.float32).reshape(-1))
        cfg = self.uses_cfg(guidance)
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, TEXT_KEYS, cfg)
        batch, _, frames, height, width = latents.shape
        # The text-to-video condition: an all-zero latent and an all-zero mask channel, no image.
        condition = latents.new_zeros(batch, latents.shape[1] + 1, frames, height, width)
        image_embeds = latents.new_zeros(batch, NUM_IMAGE_TOKENS, transformer.config.image_embed_dim, dtype=dtype)
        output = transformer(
            hidden_states=torch.cat([latents, condition], dim=1).to(dtype),
            timestep=timesteps.to(dtype),  # t = 1000·σ in the DiT dtype, as the pipeline casts it
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            encoder_attention_mask=text["prompt_embeds_mask"].to(dtype),
            encoder_hidden_states_2=text["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=text["prompt_embeds_mask_2"].to(dtype),
            image_embeds=image_embeds,
            return_dict=False,
        )[0]
        return combine_cfg(output, guidance.scale) if cfg else output.float()

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        videos = []
        with torch.no_grad():
            for sample in latents.split(1):  # one per call: see the module docstring
                scaled = sample.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor
                videos.append(vae.decode(scaled, return_dict=False)[0])
        return vae_output_to_uint8(torch.cat(videos))

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """[B, C, F', H', W']: posterior mean · scaling_factor, one sample per VAE call."""
        self.latent_grid(shape)  # refuses frame counts and sizes the VAE cannot round-trip
        means = [vae_latent_mean(self, pipe.vae, sample, shape, video_vae=True) for sample in pixels.split(1)]
        return torch.cat(means) * pipe.vae.config.scaling_factor
