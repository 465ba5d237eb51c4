"""Cosmos 3 text-to-image and text-to-video (`Cosmos3OmniPipeline`): latents [C, F', H/s, W/s].

Which pipeline, and how it maps to the reference's `cosmos3`: diffusers 0.42's newest Cosmos text-to-image
path is `Cosmos3OmniPipeline` (Cosmos 2's `Cosmos2TextToImagePipeline` needs a guardrail package and
torchvision, and is older). The reference trains "cosmos3" as a text-to-image flow-matching DiT with CFG;
here that is the omni pipeline's text-to-image mode (`num_frames=1`), and its text-to-video mode
(`num_frames` = 4k + 1) is the same call with more frames: no image/video/sound/action conditioning, no
safety checker. Both go through the pipeline's one VAE, the Wan 2.2 `AutoencoderKLWan` (published: 48
channels, 16x spatial, 4x temporal), so a video of F frames has F' = (F − 1)/4 + 1 latent frames.

There is no separate text encoder: `Cosmos3OmniTransformer` holds the language model and reads the prompt's
token ids packed with the vision tokens in one sequence. So this family's conditioning is token ids, not
embeddings: `input_ids` [B, L] (int64, right-padded to a fixed L so samples stack) with `input_ids_length`
[B], the same for the negative prompt, and `encoded_shape` [B, 4] (height, width, frames, 1000·fps), because
the pipeline's prompt templates state the output size ("This image is of HxW resolution."; for a video
"The video is D seconds long and is of N FPS. This video is of HxW resolution.", and the inverse sentences for
the negative prompt) and the video positions depend on the fps. `encode_prompt` therefore takes the
generation shape as a keyword (default: the CLI's 512x512 image); `predict_velocity` refuses conditioning
encoded for another shape. Keep these tensors int64 (move them to a device, never cast them to the forward
dtype).

Mirrors `Cosmos3OmniPipeline.__call__` (diffusers 0.42) otherwise: the pipeline's own `tokenize_prompt`
(system prompt, templates, chat template, eos + `<|vision_start|>`), the text and vision mRoPE positions
(for a video with the transformer's `enable_fps_modulation`, latent frame k sits at temporal position
k·base_fps/fps after the text), the DiT time input t = 1000·σ on every vision token (the transformer
scales it by `timestep_scale` itself), CFG `v_neg + s·(v_pos − v_neg)` in fp32, latents decoded as
`x / (1/std) + mean` (SFT's `encode_images` is the inverse, `(z − mean)·(1/std)` of the VAE posterior mean).
The transformer packs a single sequence without a batch axis, so each sample and CFG branch is its own
transformer call (no doubled batch). Schedule: the checkpoint's `UniPCMultistepScheduler` flow-sigma grid (or
flow-match Euler's), honouring `use_native_flow_schedule`; our loop takes Euler / SDE steps on it
(docs/algorithms.md §1–§2).
Differences: CFG is on iff the scale is > 1 (diffusers: any scale ≠ 1); a frame count that is not 4k + 1 is
refused (the pipeline accepts it, and its VAE drops the frames after the last full group of 4).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models.base import GenerationShape, register_family
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    normalize_latent_stats,
    pipeline_component,
    randn_per_sample,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.models.wan2_2 import unipc_flow_sigmas
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

# LoRA on the generation tower's attention (the understanding tower, the language model, stays as it is).
COSMOS3_LORA_TARGETS = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
DEFAULT_FPS = 24.0  # Cosmos3OmniPipeline.__call__'s fps default


@register_family
class Cosmos3TrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "cosmos3"
    attention_uses_gqa: ClassVar[bool] = True
    name_hints: ClassVar[tuple[str, ...]] = ("cosmos3", "cosmos-3", "cosmos_3")
    pipeline_class_name: ClassVar[str] = "Cosmos3OmniPipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("input_ids", "input_ids_length")
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = COSMOS3_LORA_TARGETS
    is_video: ClassVar[bool] = True  # images are videos of one frame
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_tokenizer")
    max_prompt_tokens: ClassVar[int] = 1024  # fixed padded length of the token-id conditioning

    def __init__(self, model_backend: Any = None) -> None:
        super().__init__(model_backend)
        # Learnt at load time: a video's positions need it, and the trainer loads no VAE.
        self.vae_temporal_compression: int | None = None

    def configure_pipeline(self, pipe: Any) -> None:
        self.vae_temporal_compression = int(pipe.vae_scale_factor_temporal)

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        if self.model_backend is not None:  # its pipeline holds the VAE: configure from it, take the modules
            pipe = self.load_pipeline(path, dtype)
            return {name: pipeline_component(pipe, name, path) for name in names}
        modules = super().load_modules(path, names, dtype)
        from diffusers import AutoencoderKLWan

        vae_config = AutoencoderKLWan.load_config(path, subfolder="vae")  # a folder, or a hub id's cache
        self.vae_temporal_compression = int(vae_config.get("scale_factor_temporal", 4))  # 4: the class default
        return modules

    def pipeline_from_pretrained_kwargs(self) -> dict[str, Any]:
        # The guardrail package is not installed, and RL rollouts are scored by rewards, not filtered.
        return {"enable_safety_checker": False, "safety_checker": None}

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
        """Token ids of the templated chat for each prompt (and, with CFG, the negative prompt), padded to L."""
        shape = shape if shape is not None else GenerationShape()
        self.latent_grid(pipe, shape)  # refuses frame counts and sizes the VAE cannot take
        pad_id = pipe.text_tokenizer.pad_token_id or 0
        cond_ids, uncond_ids = [], []
        for prompt in prompts:
            cond, uncond = pipe.tokenize_prompt(
                prompt,
                negative_prompt,  # None -> "" inside, as the pipeline does
                num_frames=shape.num_frames,
                height=shape.height,
                width=shape.width,
                fps=self.fps(shape),
            )
            cond_ids.append(cond)
            uncond_ids.append(uncond)
        ids, lengths = self._pad(cond_ids, pad_id)
        conditioning = {
            "input_ids": ids,
            "input_ids_length": lengths,
            "encoded_shape": torch.tensor([self.encoded_shape_row(shape)] * len(prompts), dtype=torch.long),
        }
        if self.uses_cfg(guidance):
            negative_ids, negative_lengths = self._pad(uncond_ids, pad_id)
            conditioning["negative_input_ids"] = negative_ids
            conditioning["negative_input_ids_length"] = negative_lengths
        return conditioning

    def _pad(self, sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(s) for s in sequences)
        if longest > self.max_prompt_tokens:
            raise MilesUserError(
                f"a Cosmos 3 prompt takes {longest} tokens with its templates; the limit is {self.max_prompt_tokens}"
            )
        ids = torch.full((len(sequences), self.max_prompt_tokens), pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        return ids, torch.tensor([len(s) for s in sequences], dtype=torch.long)

    @staticmethod
    def fps(shape: GenerationShape) -> float:
        """`--diffusion-fps`, else the pipeline's default 24 (it enters a video's prompt and its positions)."""
        return float(shape.fps) if shape.fps is not None else DEFAULT_FPS

    def encoded_shape_row(self, shape: GenerationShape) -> list[int]:
        """(height, width, frames, round(1000·fps)): what the token ids and the positions were built for."""
        return [shape.height, shape.width, shape.num_frames, round(1000 * self.fps(shape))]

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, pipe: Any, shape: GenerationShape) -> tuple[int, int, int]:
        """(F', H/s, W/s) for an output size, refusing sizes the pipeline would silently change."""
        temporal = pipe.vae_scale_factor_temporal
        spatial = pipe.vae_scale_factor_spatial
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise MilesUserError(
                f"--diffusion-output-num-frames {shape.num_frames} must be {temporal}·k + 1 for Cosmos 3 "
                f"(1 for an image, e.g. {temporal + 1}, {8 * temporal + 1} for a video)"
            )
        if shape.height % spatial or shape.width % spatial:
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {spatial} for Cosmos 3"
            )
        return ((shape.num_frames - 1) // temporal + 1, shape.height // spatial, shape.width // spatial)

    def latent_sample_shape(self, pipe: Any, shape: GenerationShape) -> tuple[int, int, int, int]:
        return (pipe.vae.config.z_dim, *self.latent_grid(pipe, shape))

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        scheduler = pipe.scheduler
        base = None
        if pipe.config.use_native_flow_schedule:  # the grid the pipeline then passes as `sigmas=`
            num_train_timesteps = scheduler.config.num_train_timesteps
            base = np.linspace(1.0 - 1.0 / num_train_timesteps, 0.0, num_steps + 1)[:-1]
        name = type(scheduler).__name__
        if name == "UniPCMultistepScheduler":
            return unipc_flow_sigmas(scheduler.config, num_steps, flow_shift, base=base)
        if name == "FlowMatchEulerDiscreteScheduler":
            return scheduler_sigmas(
                scheduler.config, num_steps, flow_shift=flow_shift, base_grid=None if base is None else base.tolist()
            )
        raise MilesUserError(
            f"scheduler {name} is not supported for Cosmos 3; use UniPC (flow sigmas) or flow-match Euler"
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        return randn_per_sample(self.latent_sample_shape(pipe, shape), generators, device=pipe.transformer.device)

    # ---- the denoiser -------------------------------------------------------------------------------
    def packed_inputs(
        self,
        transformer: nn.Module,
        input_ids: torch.Tensor,
        latent: torch.Tensor,
        fps: float,
        temporal_compression: int,
    ) -> dict[str, Any]:
        """The step-invariant transformer inputs for one sample: text then vision tokens in one sequence.

        The same fields `Cosmos3OmniPipeline._prepare_text_segment` / `_prepare_vision_segment` build for an
        unconditioned image or video: every vision frame noisy, positions from diffusers' mRoPE helpers. With the
        transformer's `enable_fps_modulation`, a video's latent frames are placed on a time axis scaled by
        `fps` and the VAE's `temporal_compression` (an image, one latent frame, is not scaled).
        """
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
            get_3d_mrope_ids_text_tokens,
            get_3d_mrope_ids_vae_tokens,
        )

        config = transformer.config
        device = latent.device
        und_len = int(input_ids.shape[0])
        text_positions, next_offset = get_3d_mrope_ids_text_tokens(
            num_tokens=und_len, temporal_offset=0, use_float_positions=config.enable_fps_modulation
        )
        _, frames, height, width = latent.shape
        patch = config.latent_patch_size
        grid_h, grid_w = math.ceil(height / patch), math.ceil(width / patch)
        num_vision_tokens = frames * grid_h * grid_w
        vision_positions, _ = get_3d_mrope_ids_vae_tokens(
            grid_t=frames,
            grid_h=grid_h,
            grid_w=grid_w,
            temporal_offset=next_offset + config.unified_3d_mrope_temporal_modality_margin,
            reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
            fps=fps if config.enable_fps_modulation else None,  # the helper ignores it for one frame
            base_fps=float(config.base_fps),
            temporal_compression_factor=temporal_compression,
        )
        vision_indexes = torch.arange(und_len, und_len + num_vision_tokens, dtype=torch.long, device=device)
        return {
            "input_ids": input_ids.to(device=device, dtype=torch.long),
            "text_indexes": torch.arange(und_len, dtype=torch.long, device=device),
            "position_ids": torch.cat([text_positions.to(device), vision_positions.to(device)], dim=1),
            "und_len": und_len,
            "sequence_length": und_len + num_vision_tokens,
            "vision_token_shapes": [(frames, grid_h, grid_w)],
            "vision_sequence_indexes": vision_indexes,
            "vision_mse_loss_indexes": vision_indexes,
            "vision_noisy_frame_indexes": [torch.arange(frames, dtype=torch.long, device=device)],
        }

    def temporal_compression_for(self, shape: GenerationShape, latent_frames: int) -> int:
        """The VAE's temporal compression r, after checking that the latents have F' = (F − 1)/r + 1 frames.

        Only a video's positions use r (they divide by fps / r); an image needs none."""
        if latent_frames == 1 and shape.num_frames == 1:
            return 1
        r = self.vae_temporal_compression
        if r is None:
            raise ValueError(
                "the Cosmos 3 family learns its VAE's temporal compression in load_pipeline / load_modules; call one"
            )
        if latent_frames != (shape.num_frames - 1) // r + 1:
            raise ValueError(
                f"{latent_frames} latent frames do not match --diffusion-output-num-frames {shape.num_frames} "
                f"(the VAE compresses time {r}x)"
            )
        return r

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
        encoded = conditioning["encoded_shape"].reshape(latents.shape[0], -1).tolist()
        wanted = self.encoded_shape_row(shape)
        if any(row != wanted for row in encoded):
            raise ValueError(
                f"Cosmos 3 conditioning was encoded for (height, width, frames, 1000·fps) {encoded[0]} but the step "
                f"runs at {wanted}; call encode_prompt(..., shape=<the generation shape>)"
            )
        cfg = self.uses_cfg(guidance)
        if cfg and "negative_input_ids" not in conditioning:
            raise ValueError("CFG is on but the conditioning holds no negative_input_ids; encode with CFG on")
        temporal_compression = self.temporal_compression_for(shape, latents.shape[2])
        timesteps = self.timesteps_from_sigmas(sigmas.to(device=latents.device, dtype=torch.float32).reshape(-1))
        velocities = []
        for b in range(latents.shape[0]):
            latent = latents[b]
            patch = transformer.config.latent_patch_size
            frames, height, width = latent.shape[1:]
            num_vision_tokens = frames * math.ceil(height / patch) * math.ceil(width / patch)
            step_inputs = {
                "vision_tokens": [latent.unsqueeze(0).to(dtype)],
                "vision_timesteps": timesteps[b].expand(num_vision_tokens).contiguous(),  # fp32 t = 1000·σ
                "return_dict": False,
            }
            branches = [("input_ids", "input_ids_length")]
            if cfg:
                branches.insert(0, ("negative_input_ids", "negative_input_ids_length"))
            outputs = []
            for ids_key, length_key in branches:
                ids = conditioning[ids_key][b, : int(conditioning[length_key][b])]
                packed = self.packed_inputs(transformer, ids, latent, self.fps(shape), temporal_compression)
                preds_vision = transformer(**packed, **step_inputs)[0]  # one [1, C, T, H, W] per vision item
                outputs.append(preds_vision[0].reshape(latent.shape).float())
            if cfg:
                v_neg, v_pos = outputs
                velocities.append(v_neg + guidance.scale * (v_pos - v_neg))
            else:
                velocities.append(outputs[0])
        return torch.stack(velocities, dim=0)

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean, dtype=vae.dtype).view(1, channels, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=vae.dtype).view(1, channels, 1, 1, 1)
        latents = latents.to(device=vae.device, dtype=vae.dtype)
        with torch.no_grad():
            images = vae.decode(latents / inv_std.to(latents.device) + mean.to(latents.device)).sample
        return vae_output_to_uint8(images)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """[B, C, F', H/s, W/s]: the posterior mean of the Wan 2.2 VAE (the pipeline's `_encode_video` takes its
        mode), normalised as `(z − mean) · (1 / std)`."""
        self.latent_grid(pipe, shape)  # refuses frame counts and sizes the VAE cannot take
        return normalize_latent_stats(pipe.vae, vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=True))
