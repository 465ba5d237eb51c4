"""Wan (`WanPipeline`): Wan 2.2's dual-expert T2V A14B and single-expert TI2V 5B, and Wan 2.1 T2V (1.3B, 14B);
video latents [C, F, H, W].

One pipeline class holds all of them, so they are one family (key `wan2_2`); the checkpoint's model_index.json
says which layout a folder holds (`WAN_LAYOUTS`): a `transformer_2` with a `boundary_ratio` is the A14B,
`expand_timesteps` the TI2V 5B, a single expert without either Wan 2.1 (whether the index lists those entries
as null / false or, as diffusers wrote Wan folders before Wan 2.2, not at all). Wan 2.1 is the A14B's
single-expert special case: one transformer for every step, one timestep per sample, the 16-channel Wan 2.1
VAE (8x spatial, 4x temporal) that the A14B also uses.

Mirrors `WanPipeline.__call__` (diffusers 0.42):
- prompts through UMT5, padded to `max_sequence_length` tokens with the padding positions zeroed (the
  pipeline's own `encode_prompt`), so any samples stack; the negative prompt defaults to "" like diffusers;
- noise [C, (F−1)/4 + 1, H/8, W/8] (A14B, Wan 2.1; the 5B VAE is 16× spatial) drawn per sample from its own generator;
- the DiT time input t = 1000·σ (docs/algorithms.md §1); the 5B (`expand_timesteps`) takes it per token, [B, tokens];
- A14B: `transformer` denoises while t ≥ boundary_ratio·1000 (high noise) with `--diffusion-guidance-scale`,
  `transformer_2` below it (low noise) with `--diffusion-guidance-scale-2` (default: the first scale);
  every sample of one batch must sit on the same side of the boundary;
- latents decoded as `x·std + mean` with the VAE's per-channel statistics (`encode_images`, for SFT, is the
  inverse).

Schedule: the published checkpoints ship `UniPCMultistepScheduler` with flow sigmas and `flow_shift`; our
loop takes Euler / SDE steps (docs/algorithms.md §2) on exactly that scheduler's sigma grid
(`unipc_flow_sigmas`). A checkpoint with `FlowMatchEulerDiscreteScheduler` gets that scheduler's grid.
One deliberate difference: with `guidance_scale ≤ 1 < guidance_scale_2` diffusers skips CFG everywhere;
we apply CFG in the low-noise phase, since that is what `--diffusion-guidance-scale-2` asks for.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models.base import (
    CONDITION_IMAGE_NONE,
    CONDITION_IMAGE_OPTIONAL,
    GenerationShape,
    SequenceParallelLayout,
    condition_image_mismatch,
    register_family,
)
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    encode_with_negative,
    normalize_latent_stats,
    randn_per_sample,
    read_model_index,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block
IMAGE_LATENTS = "image_latents"  # TI2V 5B image-to-video: the encoded input image, the first latent frame [C, 1, h, w]
HIGH_NOISE_EXPERT = "transformer"
LOW_NOISE_EXPERT = "transformer_2"

# layout -> what it is; `Wan22TrainPipelineConfig.layout` holds the key once a checkpoint is read.
WAN_LAYOUTS = {
    "t2v_a14b": "Wan 2.2 T2V A14B (dual expert, switched at boundary_ratio)",
    "ti2v_5b": "Wan 2.2 TI2V 5B (single expert, per-token timesteps)",
    "wan2_1": "Wan 2.1 T2V (single expert, one timestep per sample)",
}


def unipc_flow_sigmas(
    scheduler_config: Mapping[str, Any], num_steps: int, flow_shift: float | None, base: Sequence[float] | None = None
) -> torch.Tensor:
    """n + 1 fp32 sigmas of `UniPCMultistepScheduler.set_timesteps` with `use_flow_sigmas=True` (diffusers 0.42).

    `u = linspace(1, 1/N, n+1)[:n]` in fp64 (or the `base` grid a pipeline passes as `sigmas=`), static shift
    `S_s(u)` (s = `flow_shift` override or the config's `flow_shift`; docs/algorithms.md §1), then the terminal (0 for
    `final_sigmas_type="zero"`, else the last sigma). One deliberate difference: diffusers nudges a first sigma
    of 1 to 1 − 1e-6 so that UniPC's log-SNR stays finite; Euler and SDE steps need no nudge, and the Flow-GRPO
    'sde' kind's σ = 1 rule (docs/algorithms.md §2) needs exactly 1 (at 1 − 1e-6 its noise would be ~1000× η).
    """
    from miles.diffusion.schedules import shift_sigmas

    if not scheduler_config.get("use_flow_sigmas"):
        raise MilesUserError(
            "this checkpoint's UniPCMultistepScheduler does not use flow sigmas (use_flow_sigmas=False); "
            "miles only supports flow-matching schedules"
        )
    for option in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_dynamic_shifting"):
        if scheduler_config.get(option):
            raise MilesUserError(f"scheduler option {option}=True is not supported by miles' sigma schedules")
    if scheduler_config.get("shift_terminal"):
        raise MilesUserError("UniPCMultistepScheduler shift_terminal is not supported by miles' sigma schedules")
    num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
    shift = float(flow_shift if flow_shift is not None else scheduler_config.get("flow_shift", 1.0))
    if base is None:
        base = np.linspace(1.0, 1.0 / num_train_timesteps, num_steps + 1)[:-1]
    elif len(base) != num_steps:
        raise ValueError(f"got {len(base)} base sigmas for {num_steps} steps")
    # fp64, like the scheduler's numpy arithmetic; rounded to fp32 once at the end
    sigmas = shift_sigmas(torch.from_numpy(np.array(base, dtype=np.float64)), shift)
    final = sigmas[-1:] if scheduler_config.get("final_sigmas_type", "zero") == "sigma_min" else sigmas.new_zeros(1)
    return torch.cat([sigmas, final]).to(torch.float32)


def flow_sigmas_for_scheduler(
    scheduler: Any, num_steps: int, flow_shift: float | None, image_seq_len: int | None = None
) -> torch.Tensor:
    """The sigma grid of the checkpoint's own scheduler class (UniPC with flow sigmas, or flow-match Euler)."""
    name = type(scheduler).__name__
    if name == "UniPCMultistepScheduler":
        return unipc_flow_sigmas(scheduler.config, num_steps, flow_shift)
    if name == "FlowMatchEulerDiscreteScheduler":
        return scheduler_sigmas(scheduler.config, num_steps, flow_shift=flow_shift, image_seq_len=image_seq_len)
    raise MilesUserError(
        f"scheduler {name} is not supported; use a checkpoint with UniPCMultistepScheduler (flow sigmas) "
        "or FlowMatchEulerDiscreteScheduler"
    )


@register_family
class Wan22TrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "wan2_2"
    name_hints: ClassVar[tuple[str, ...]] = (
        "wan2.2", "wan2_2", "wan2-2", "wan22", "wan2.1", "wan2_1", "wan2-1", "wan21"
    )
    pipeline_class_name: ClassVar[str] = "WanPipeline"
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds",)
    trainable_modules: ClassVar[tuple[str, ...]] = (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = WAN_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    is_video: ClassVar[bool] = True
    max_sequence_length: ClassVar[int] = 512  # WanPipeline.__call__'s default UMT5 length
    # Image-to-video: the TI2V 5B only (`configure` narrows it to "none" for the other layouts).
    condition_image: ClassVar[str] = CONDITION_IMAGE_OPTIONAL

    def __init__(self, model_backend: Any = None) -> None:
        super().__init__(model_backend)
        # Set from the checkpoint by configure(); until then the single-expert layout.
        self.boundary_ratio: float | None = None
        self.expand_timesteps = False
        self.layout: str | None = None  # a WAN_LAYOUTS key

    # ---- loading ------------------------------------------------------------------------------------
    def configure(self, boundary_ratio: float | None, expand_timesteps: bool, has_transformer_2: bool) -> None:
        """Record the checkpoint's layout: the expert boundary, per-token timesteps, which experts exist."""
        if boundary_ratio is not None and not has_transformer_2:
            raise MilesUserError(
                f"this Wan 2.2 checkpoint sets boundary_ratio={boundary_ratio} but has no transformer_2 "
                "(the low-noise expert)"
            )
        self.boundary_ratio = boundary_ratio if has_transformer_2 else None
        self.expand_timesteps = bool(expand_timesteps)
        if self.boundary_ratio is not None:
            self.layout = "t2v_a14b"
        else:  # (a transformer_2 without a boundary is never switched to: the pipeline runs it as Wan 2.1)
            self.layout = "ti2v_5b" if self.expand_timesteps else "wan2_1"
        logger.info("Wan layout: %s, boundary_ratio=%s", WAN_LAYOUTS[self.layout], self.boundary_ratio)
        # Instance attribute: the 5B layout trains and syncs its single transformer only (as does a folder
        # with a transformer_2 but no boundary, which the pipeline never switches to).
        dual = self.boundary_ratio is not None
        self.trainable_modules = (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT) if dual else (HIGH_NOISE_EXPERT,)
        self.condition_image = CONDITION_IMAGE_OPTIONAL if self.layout == "ti2v_5b" else CONDITION_IMAGE_NONE

    @classmethod
    def condition_image_policy(cls, hf_checkpoint: str | None) -> str:
        """A local folder's model_index.json tells the TI2V 5B (`expand_timesteps`, no expert boundary), the one
        layout that takes an input image; a hub id is left to the engine, which knows the layout once loaded."""
        index = read_model_index(hf_checkpoint) if hf_checkpoint and os.path.isdir(hf_checkpoint) else None
        if index is None:
            return cls.condition_image
        ti2v = bool(index.get("expand_timesteps")) and index.get("boundary_ratio") is None
        return CONDITION_IMAGE_OPTIONAL if ti2v else CONDITION_IMAGE_NONE

    def check_pipeline_class(self, path: str) -> None:
        """Refuse a Wan folder of another pipeline (image-to-video, VACE, animate) before loading it."""
        index = read_model_index(path) if self.model_backend is None else None
        class_name = (index or {}).get("_class_name", self.pipeline_class_name)
        if class_name != self.pipeline_class_name:
            raise MilesUserError(
                f"--hf-checkpoint {path!r} holds a {class_name}; the wan2_2 family supports {self.pipeline_class_name} "
                "(text-to-video: Wan 2.1, Wan 2.2 T2V A14B and TI2V 5B) only"
            )

    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        self.check_pipeline_class(path)
        return super().load_pipeline(path, dtype, device)

    def configure_pipeline(self, pipe: Any) -> None:
        if pipe.transformer is None and getattr(pipe, "transformer_2", None) is None:
            return  # an encoders-only pipeline (SFT encoding): no denoiser layout to record
        self.configure(
            pipe.config.boundary_ratio, pipe.config.expand_timesteps, getattr(pipe, "transformer_2", None) is not None
        )

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        self.check_pipeline_class(path)
        index = read_model_index(path)
        if index is None and self.model_backend is None:  # a hub id: its model_index.json via the hub cache
            from diffusers import DiffusionPipeline

            index = DiffusionPipeline.load_config(path)
        if index is not None:
            entry = index.get(LOW_NOISE_EXPERT)
            self.configure(
                index.get("boundary_ratio"), bool(index.get("expand_timesteps", False)), bool(entry and entry[0])
            )
            if LOW_NOISE_EXPERT in names and LOW_NOISE_EXPERT not in self.trainable_modules:
                raise MilesUserError(
                    f"the Wan checkpoint {path!r} is single-expert ({WAN_LAYOUTS[self.layout]}, no {LOW_NOISE_EXPERT} "
                    "in use); train and sync it with --update-weight-target-module transformer"
                )
        return super().load_modules(path, names, dtype)

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
        """`prompt_embeds` [B, 512, D] (padding zeroed); with CFG `negative_prompt_embeds` of the same shape."""

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            prompt_embeds, _ = pipe.encode_prompt(
                prompt=batch, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length
            )
            return {"prompt_embeds": prompt_embeds}

        return encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance))

    def uses_cfg(self, guidance: GuidanceConfig) -> bool:
        """CFG when either expert's scale asks for it (`--diffusion-guidance-scale-2` is the low-noise expert's)."""
        return guidance.do_cfg

    def encode_condition_image(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> dict[str, torch.Tensor]:
        """TI2V 5B image-to-video (`WanImageToVideoPipeline` with `expand_timesteps`): the image resized to the
        output size (Lanczos, the pipeline's video processor), pixels to [-1, 1], one frame through the VAE
        (posterior mode), normalised `(z − mean)·(1/std)`: `image_latents` [1, C, 1, h, w], fp32."""
        from PIL import Image

        if self.condition_image == CONDITION_IMAGE_NONE:
            raise MilesUserError(condition_image_mismatch(self.family, self.condition_image, True))
        if tuple(pixels.shape[:2]) != (shape.height, shape.width):
            resized = Image.fromarray(pixels.numpy()).resize((shape.width, shape.height), resample=Image.LANCZOS)
            pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
        image = (pixels.float() / 255.0 * 2.0 - 1.0).permute(2, 0, 1)[None, :, None]  # [1, 3, 1, H, W]
        vae = pipe.vae
        with torch.no_grad():
            latents = vae.encode(image.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        return {IMAGE_LATENTS: normalize_latent_stats(vae, latents.float())}

    def final_latents(self, latents: torch.Tensor, conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Image-to-video: the first latent frame is the encoded input image (the pipeline's last replacement)."""
        if IMAGE_LATENTS not in conditioning:
            return latents
        return torch.cat([conditioning[IMAGE_LATENTS].to(latents), latents[:, :, 1:]], dim=2)

    # ---- schedule and latents -----------------------------------------------------------------------
    @staticmethod
    def _any_transformer(pipe: Any) -> Any:
        return pipe.transformer if pipe.transformer is not None else pipe.transformer_2

    def latent_sample_shape(self, pipe: Any, shape: GenerationShape) -> tuple[int, int, int, int]:
        """[C, F_latent, H/s, W/s]; sizes the pipeline would silently round are refused with the flag named."""
        transformer = self._any_transformer(pipe)
        return (transformer.config.in_channels, *self.latent_grid(pipe, shape, transformer.config.patch_size))

    def latent_grid(self, pipe: Any, shape: GenerationShape, patch: Sequence[int]) -> tuple[int, int, int]:
        """(F_latent, H/s, W/s) for an output size, refusing sizes the VAE and the DiT's `patch` cannot tile."""
        temporal = pipe.vae_scale_factor_temporal
        spatial = pipe.vae_scale_factor_spatial
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise MilesUserError(
                f"--diffusion-output-num-frames {shape.num_frames} must be {temporal}·k + 1 for Wan "
                f"(e.g. 1, {temporal + 1}, 81)"
            )
        if shape.height % (spatial * patch[1]) or shape.width % (spatial * patch[2]):
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {spatial * patch[1]} "
                "(VAE scale factor × patch size) for this Wan checkpoint"
            )
        latent_frames = (shape.num_frames - 1) // temporal + 1
        return (latent_frames, shape.height // spatial, shape.width // spatial)

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        return flow_sigmas_for_scheduler(pipe.scheduler, num_steps, flow_shift)

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        transformer = self._any_transformer(pipe)
        return randn_per_sample(self.latent_sample_shape(pipe, shape), generators, device=transformer.device)

    # ---- the denoiser -------------------------------------------------------------------------------
    def expert_for(self, sigma: float) -> str:
        """`transformer` while t = 1000·σ ≥ boundary_ratio·1000 (the pipeline's test), else `transformer_2`."""
        if self.boundary_ratio is None:
            return HIGH_NOISE_EXPERT
        timestep = float(sigma) * self.num_train_timesteps
        return HIGH_NOISE_EXPERT if timestep >= self.boundary_ratio * self.num_train_timesteps else LOW_NOISE_EXPERT

    def guidance_scale_for(self, expert: str, guidance: GuidanceConfig) -> float:
        if expert == LOW_NOISE_EXPERT and guidance.guidance_scale_2 is not None:
            return guidance.guidance_scale_2
        return guidance.scale

    def batch_expert(self, sigmas: torch.Tensor) -> str:
        """The one expert for a batch; a batch straddling the boundary is a batching bug, refused here."""
        experts = {self.expert_for(s) for s in sigmas.detach().flatten().tolist()}
        if len(experts) != 1:
            raise ValueError(
                f"a Wan 2.2 batch mixes expert phases (sigmas {sigmas.tolist()} straddle boundary_ratio="
                f"{self.boundary_ratio}); batch samples of one side of the boundary only"
            )
        return experts.pop()

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
        sigmas = sigmas.to(device=latents.device, dtype=torch.float32).reshape(-1)
        expert = self.batch_expert(sigmas)
        if expert not in modules:
            raise ValueError(f"the Wan batch needs the {expert} expert but modules hold only {sorted(modules)}")
        transformer = modules[expert]
        scale = self.guidance_scale_for(expert, guidance)
        timesteps = self.timesteps_from_sigmas(sigmas)
        image_to_video = IMAGE_LATENTS in conditioning
        if image_to_video and not self.expand_timesteps:
            raise MilesUserError(condition_image_mismatch(self.family, CONDITION_IMAGE_NONE, True))
        if self.expand_timesteps:
            # TI2V 5B: one timestep per patch token (the pipeline's mask[:, ::2, ::2]·t with an all-ones mask).
            _, _, frames, height, width = latents.shape
            tokens_per_frame = ((height + 1) // 2) * ((width + 1) // 2)
            timesteps = timesteps[:, None].expand(-1, frames * tokens_per_frame)
            if image_to_video:  # the first frame is the clean input image: its tokens at t = 0
                mask = torch.ones(frames * tokens_per_frame, device=timesteps.device, dtype=timesteps.dtype)
                mask[:tokens_per_frame] = 0
                timesteps = timesteps * mask
                latents = torch.cat([conditioning[IMAGE_LATENTS].to(latents), latents[:, :, 1:]], dim=2)
        cfg = scale > 1.0
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, ("prompt_embeds",), cfg)
        output = transformer(
            hidden_states=latents.to(dtype),
            timestep=timesteps,  # fp32 t = 1000·σ
            encoder_hidden_states=text["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]
        velocity = combine_cfg(output, scale) if cfg else output.float()
        if image_to_video:
            # The first frame is pinned to the input image (`final_latents`): no velocity, so it contributes no
            # gradient and the same (θ-free) term to the rollout's and the trainer's log-probs.
            velocity = torch.cat([torch.zeros_like(velocity[:, :, :1]), velocity[:, :, 1:]], dim=2)
        return velocity

    # ---- sequence-parallel engines ------------------------------------------------------------------------
    def sequence_parallel_layout(self, module: nn.Module) -> SequenceParallelLayout | None:
        """diffusers' own context-parallel plan for the Wan DiT (tokens and rotary table split at the blocks,
        per-token timesteps of the 5B split, gathered after `proj_out`); self-attention mixes the video tokens,
        cross-attention to the text is token-local."""
        plan = self.context_parallel_plan(module)
        if plan is None:
            return None
        return SequenceParallelLayout(plan=plan, patch_size=tuple(module.config.patch_size),
                                      self_attention=tuple(block.attn1 for block in module.blocks))

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1)
        latents = latents.to(device=vae.device, dtype=vae.dtype)
        # The pipeline divides by 1/std computed in the VAE dtype (not multiplies by std): keep its rounding.
        latents = latents / (1.0 / std.to(latents)) + mean.to(latents)
        with torch.no_grad():
            video = vae.decode(latents, return_dict=False)[0]
        return vae_output_to_uint8(video)

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """[B, C, F_latent, H/s, W/s]: the posterior mean (the image-to-video pipeline's `argmax`) normalised
        as `(z − mean) · (1 / std)`. The SFT encoder pipeline holds no transformer; without one only the VAE's
        factors are checked here (`prepare_latents` checks the DiT's patch size when the run starts)."""
        transformer = self._any_transformer(pipe)
        patch = transformer.config.patch_size if transformer is not None else (1, 1, 1)
        self.latent_grid(pipe, shape, patch)
        return normalize_latent_stats(pipe.vae, vae_latent_mean(self, pipe.vae, pixels, shape, video_vae=True))
