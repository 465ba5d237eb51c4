"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`): MMDiT on [C, H/8, W/8] latents, three text encoders.

Mirrors `StableDiffusion3Pipeline.__call__` (diffusers 0.42): prompts through two CLIP encoders and T5
(CLIP hidden states padded to the T5 width, concatenated along the sequence: the CLIP tokenizer's length (77)
+ `t5_sequence_length` tokens, a fixed length, so any samples stack), pooled CLIP projections, standard CFG
with the negative branch first, static shift (SD3.5: 3.0) on the scheduler's own grid, DiT time input t = 1000·σ
(docs/algorithms.md §1), and latents decoded as `x / scaling_factor + shift_factor`
(SFT encodes images by the inverse, `encode_images`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.models.base import GenerationShape, SequenceParallelLayout, register_family
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    decode_scaled_latents,
    encode_with_negative,
    randn_per_sample,
    read_component_config,
    scale_shift_latents,
    scheduler_sigmas,
    vae_latent_mean,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

# The attention projections Flow-GRPO's SD3 recipe trains (both the image stream and the context stream).
SD3_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


@register_family
class SD3TrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "sd3"
    compile_vae_decoder: ClassVar[bool] = True  # AutoencoderKL
    name_hints: ClassVar[tuple[str, ...]] = ("stable-diffusion-3", "sd3")
    pipeline_class_name: ClassVar[str] = "StableDiffusion3Pipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = SD3_LORA_TARGETS
    # T5 (text_encoder_3) is optional in SD3: without it the pipeline feeds zeros in its place.
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
    )
    max_sequence_length: ClassVar[int] = 256  # the pipeline's default T5 length

    def t5_sequence_length(self, pipe: Any) -> int:
        """`max_sequence_length`, or the T5 tokenizer's own `model_max_length` when that is shorter (a small
        checkpoint whose prompts are a few words, miles/tasks/shapes; SD3.5's tokenizer says 512)."""
        tokenizer = getattr(pipe, "tokenizer_3", None)
        limit = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
        return min(self.max_sequence_length, int(limit)) if limit else self.max_sequence_length

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
        """`prompt_embeds` [B, CLIP length + T5 length, D], `pooled_prompt_embeds` [B, P]; with CFG also the negatives.

        The negative prompt (diffusers' default "" when None) is encoded once and repeated to the batch.
        """

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            prompt_embeds, _, pooled, _ = pipe.encode_prompt(
                prompt=batch,
                prompt_2=None,
                prompt_3=None,
                do_classifier_free_guidance=False,
                max_sequence_length=self.t5_sequence_length(pipe),
            )
            return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

        return encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance))

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, pipe: Any, shape: GenerationShape) -> tuple[int, int]:
        """Latent height and width, H/f and W/f; sizes the DiT's 2×2 patches cannot tile are refused."""
        scale = pipe.vae_scale_factor
        if shape.height % (scale * 2) or shape.width % (scale * 2):
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {scale * 2} "
                "(VAE scale factor × patch size) for this SD3 checkpoint"
            )
        return shape.height // scale, shape.width // scale

    @classmethod
    def largest_image_side(cls, hf_checkpoint: str | None) -> int | None:
        """The transformer's learnt position table spans `pos_embed_max_size` patches a side (SD3.5: 384, so
        6144 px; the `shapes` base: 16, so 64 px)."""
        transformer, vae = (read_component_config(hf_checkpoint, name) for name in ("transformer", "vae"))
        if not transformer or not vae or not transformer.get("pos_embed_max_size"):
            return None
        vae_scale = 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1)  # the pipeline's vae_scale_factor
        return int(transformer["pos_embed_max_size"]) * int(transformer.get("patch_size", 2)) * vae_scale

    def latent_sample_shape(self, pipe: Any, shape: GenerationShape) -> tuple[int, int, int]:
        return (pipe.transformer.config.in_channels, *self.latent_grid(pipe, shape))

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        _, latent_h, latent_w = self.latent_sample_shape(pipe, shape)
        patch = pipe.transformer.config.patch_size
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=(latent_h // patch) * (latent_w // patch),
            default_max_shift=1.16,  # what StableDiffusion3Pipeline.__call__ passes to calculate_shift
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        return randn_per_sample(self.latent_sample_shape(pipe, shape), generators, device=pipe.transformer.device)

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
        timesteps = self.timesteps_from_sigmas(sigmas.to(device=latents.device, dtype=torch.float32))
        cfg = self.uses_cfg(guidance)
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, keys, cfg)
        output = transformer(
            hidden_states=latents.to(dtype),
            timestep=timesteps,  # fp32, as the pipeline passes scheduler.timesteps
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            pooled_projections=text["pooled_prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]
        return combine_cfg(output, guidance.scale) if cfg else output.float()

    # ---- sequence-parallel engines ------------------------------------------------------------------------
    def sequence_parallel_layout(self, module: nn.Module) -> SequenceParallelLayout:
        """diffusers has no context-parallel plan for SD3: split the patch tokens (after the positional embedding)
        at the first block, gather them after `proj_out`; every block's attention (and SD3.5's image-only
        `attn2`) is joint attention, the text tokens replicated on every rank."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        plan = {
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
        attentions = [block.attn for block in module.transformer_blocks]
        attentions += [block.attn2 for block in module.transformer_blocks if getattr(block, "attn2", None) is not None]
        patch = module.config.patch_size
        return SequenceParallelLayout(plan=plan, patch_size=(patch, patch), joint_attention=tuple(attentions))

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        return decode_scaled_latents(pipe.vae, latents)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """[B, C, H/f, W/f]: the posterior mean, `(z − shift_factor) · scaling_factor`."""
        self.latent_grid(pipe, shape)
        return scale_shift_latents(pipe.vae, vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=False))
