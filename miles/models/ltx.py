"""LTX (text-to-video): LTX-Video 0.9 (`LTXPipeline`) and LTX-2 (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`), one
family key `ltx`.

The generation is read from the checkpoint's model_index.json (`self.generation`: "ltx-video" or "ltx2") when
the pipeline or the trainer's modules load. LTX-2 takes an optional input image per prompt row (image-to-video,
below), whichever of its two pipeline classes the folder holds; LTX-Video takes none. Not supported: LTX-Video's
image/condition pipelines and the long/multi-prompt pipelines of either generation.

LTX-Video 0.9 mirrors `LTXPipeline.__call__` (diffusers 0.42):
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

LTX-2 mirrors `LTX2Pipeline.__call__` with its guidance off (see below):
- Gemma 3 hidden states of every layer (left-padded to `max_sequence_length`, default 1024) through the text
  connectors: `prompt_embeds` (video), `audio_prompt_embeds` and the connectors' `prompt_attention_mask`;
- one state per sample holds both modalities, flattened and concatenated: the packed video tokens [N_v, C_v]
  then the packed audio tokens [L, C_a·M'] (L = round(F/fps · sample_rate / hop / 4), M' = mel bins / 4).
  Noise per sample: video then audio from that sample's generator, as the pipeline draws them;
- the sigma grid of LTX-Video with μ from the packed video token count; one DiT forward gives both velocities
  (t = 1000·σ for both streams, `sigma` = t, the pipeline's `use_cross_timestep=True`, fps = `--diffusion-fps`,
  default 24); the step (Euler, or the SDE kernel) moves the whole state, audio included;
- guidance: none. The reference trains LTX-2 without CFG at guidance 1.0 (and without the pipeline's STG,
  modality-isolation guidance and rescale, which all need extra forwards); `--diffusion-guidance-scale` above
  1 is refused. With `guidance_scale=1, audio_guidance_scale=1, stg_scale=0, audio_stg_scale=0,
  modality_scale=1, audio_modality_scale=1` the pipeline's loop is this one;
- the audio branch of the DiT (`audio_*` modules but `audio_to_video_attn`, `video_to_audio_attn`,
  `av_cross_attn_audio_*`) is frozen in full fine-tuning (`freeze_untrained`) and the default LoRA targets are
  the video attention only, so its optimizer state is absent; the audio latents still ride in the state (an
  SDE step noises them and the log-prob's mean covers them: about 2% of the elements at 121 frames 512x768);
- decode: the video part as LTX-Video (rewards read the sampled frames); the audio is not decoded (no reward
  reads it). `encode_images` (SFT) gives the video part and an all-zero normalised audio part (the audio VAE's
  latent mean: SFT rows carry no sound);
- image-to-video (a row with `"image"`; `LTX2ImageToVideoPipeline.__call__` with the same guidance off): the image,
  resized to the output size (bilinear, the pipeline's video processor; the rollout already sent it at that size),
  pixels to [-1, 1], one frame through the VAE (posterior mode), normalised `(z − mean)/std` (the pipeline's
  `_normalize_latents` without the scaling factor), packed: `image_latents` [1, H'·W', C], the first latent
  frame's tokens. Every forward replaces the state's first-frame tokens by them and gives those tokens the video
  timestep 0 (the pipeline's `t·(1 − conditioning_mask)`; the audio keeps the per-sample t); their velocity is zero,
  so the step leaves them alone (the pipeline steps frames 1: only), they get no gradient, and `final_latents`
  writes the image into the final state. One deliberate difference: the pipeline re-encodes the input image as
  H.264 at its `image_crf` (33 for Gemma 3 checkpoints, through PyAV) before the VAE, imitating compressed
  training frames; miles encodes the pixels as given (the parity test passes `image_crf=0`);
- the recommended step kernel is CPS (`--diffusion-sde-type cps`); miles has no per-family flag default, so
  the recipe sets it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models.base import (
    CONDITION_IMAGE_NONE,
    CONDITION_IMAGE_OPTIONAL,
    GenerationShape,
    condition_image_mismatch,
    register_family,
)
from miles.models.common import (
    DiffusersTrainPipelineConfig,
    cfg_batch_inputs,
    combine_cfg,
    encode_with_negative,
    flux_style_base_grid,
    parse_dtype,
    pipeline_component,
    randn_per_sample,
    read_model_index,
    scheduler_sigmas,
    vae_latent_mean,
    vae_output_to_uint8,
)
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

LTX_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block
# LTX-2: the video self- and cross-attention only (".attn1.to_q" does not match "audio_attn1.to_q").
LTX2_LORA_TARGETS = tuple(f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in LTX_LORA_TARGETS)
DEFAULT_FRAME_RATE = 25.0  # LTXPipeline.__call__'s frame_rate default
LTX2_DEFAULT_FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s
LTX_VIDEO, LTX2 = "ltx-video", "ltx2"
# supported pipeline class -> generation (LTX-2's two classes hold the same components)
GENERATIONS = {"LTXPipeline": LTX_VIDEO, "LTX2Pipeline": LTX2, "LTX2ImageToVideoPipeline": LTX2}
IMAGE_LATENTS = "image_latents"  # LTX-2 image-to-video: the input image's packed first-frame tokens [H'·W', C]
DEFAULT_MAX_SEQUENCE_LENGTH = {LTX_VIDEO: 128, LTX2: 1024}  # the pipelines' defaults (T5 / Gemma tokens)
REQUIRED_COMPONENTS = {
    LTX_VIDEO: ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"),
    LTX2: ("transformer", "vae", "audio_vae", "scheduler", "text_encoder", "tokenizer", "connectors"),
}
# Modules of the LTX-2 DiT that only carry the audio stream: frozen (docstring). `audio_to_video_attn` writes into
# the video stream and stays trainable.
LTX2_AUDIO_PREFIXES = ("audio_", "video_to_audio_attn", "av_cross_attn_audio_")
LTX2_VIDEO_STREAM_AUDIO_NAMES = ("audio_to_video_attn",)


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


def is_ltx2_audio_parameter(name: str) -> bool:
    """Whether a parameter of `LTX2VideoTransformer3DModel` belongs to its (frozen) audio branch."""
    parts = name.split(".")
    if any(part in LTX2_VIDEO_STREAM_AUDIO_NAMES for part in parts):
        return False
    return any(part.startswith(LTX2_AUDIO_PREFIXES) for part in parts)


@dataclass(frozen=True)
class AudioLayout:
    """The LTX-2 audio latent geometry, read from the audio VAE (its config when only the DiT is loaded)."""

    sample_rate: int
    hop_length: int
    temporal_ratio: int
    channels: int
    latent_mel_bins: int

    def num_frames(self, shape: GenerationShape, fps: float) -> int:
        """Latent audio frames for a video of `shape.num_frames` at `fps` (`LTX2Pipeline.__call__`'s rounding)."""
        return round(shape.num_frames / fps * (self.sample_rate / self.hop_length / float(self.temporal_ratio)))


@register_family
class LTXTrainPipelineConfig(DiffusersTrainPipelineConfig):
    family: ClassVar[str] = "ltx"
    attention_uses_mask: ClassVar[bool] = True  # padded caption tokens
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_attention_mask")  # LTX-Video; LTX-2: no CFG
    name_hints: ClassVar[tuple[str, ...]] = ("ltx",)
    pipeline_class_name: ClassVar[str] = "LTXPipeline"
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)
    default_lora_target_modules: ClassVar[tuple[str, ...]] = LTX_LORA_TARGETS
    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
    is_video: ClassVar[bool] = True
    # Image-to-video: LTX-2 only (`set_generation` narrows it to "none" for LTX-Video).
    condition_image: ClassVar[str] = CONDITION_IMAGE_OPTIONAL

    def __init__(self, model_backend: Any = None) -> None:
        super().__init__(model_backend)
        self.generation: str | None = None  # LTX_VIDEO or LTX2, from the checkpoint
        self.checkpoint_class: str | None = None  # the GENERATIONS key the checkpoint declares
        # Text tokens; None = the pipeline's default for the generation (DEFAULT_MAX_SEQUENCE_LENGTH).
        self.max_sequence_length: int | None = None
        self.audio: AudioLayout | None = None  # LTX-2 only
        # The VAE's compression ratios and the DiT's patch sizes, read from the checkpoint at load time;
        # predict_velocity needs them to tell the DiT the latent grid.
        self.spatial_ratio: int | None = None
        self.temporal_ratio: int | None = None
        self.patch = 1
        self.patch_t = 1

    # ---- loading ------------------------------------------------------------------------------------
    def check_pipeline_class(self, path: str) -> None:
        """Read the generation from the checkpoint's pipeline class; refuse other LTX pipelines before loading."""
        if self.model_backend is not None:  # configure_pipeline reads the loaded pipeline
            return
        index = read_model_index(path)
        if index is None:  # a hub id: its model_index.json through the hub cache
            from diffusers import DiffusionPipeline

            index = DiffusionPipeline.load_config(path)
        self.set_generation(index.get("_class_name"), path)

    @classmethod
    def condition_image_policy(cls, hf_checkpoint: str | None) -> str:
        """A local folder's model_index.json tells LTX-2 (optional input image) from LTX-Video (none); a hub id is
        left to the engine, which knows the generation once loaded."""
        index = read_model_index(hf_checkpoint) if hf_checkpoint and os.path.isdir(hf_checkpoint) else None
        if index is None or index.get("_class_name") not in GENERATIONS:
            return cls.condition_image
        return CONDITION_IMAGE_OPTIONAL if GENERATIONS[index["_class_name"]] == LTX2 else CONDITION_IMAGE_NONE

    def set_generation(self, class_name: str | None, path: str) -> None:
        if class_name not in GENERATIONS:
            raise MilesUserError(
                f"--hf-checkpoint {path!r} holds a {class_name}; the ltx family supports LTXPipeline (LTX-Video "
                "text-to-video), LTX2Pipeline and LTX2ImageToVideoPipeline (LTX-2 text/image-to-video+audio) only, "
                "not LTX-Video's image-to-video or condition pipelines"
            )
        self.checkpoint_class = class_name
        self.generation = GENERATIONS[class_name]
        self.condition_image = CONDITION_IMAGE_OPTIONAL if self.generation == LTX2 else CONDITION_IMAGE_NONE
        self.required_components = REQUIRED_COMPONENTS[self.generation]
        self.default_lora_target_modules = LTX2_LORA_TARGETS if self.generation == LTX2 else LTX_LORA_TARGETS

    @property
    def is_ltx2(self) -> bool:
        return self.generation == LTX2

    def pipeline_class(self) -> type:
        import diffusers

        if self.checkpoint_class is not None:  # the class the checkpoint declares
            return getattr(diffusers, self.checkpoint_class)
        return diffusers.LTX2Pipeline if self.is_ltx2 else diffusers.LTXPipeline

    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        self.check_pipeline_class(path)
        return super().load_pipeline(path, dtype, device)

    def configure_pipeline(self, pipe: Any) -> None:
        if self.generation is None:  # --model-backend-path or a hub id: the loaded pipeline's class decides
            import diffusers

            class_name = type(pipe).__name__
            for supported in GENERATIONS:  # a subclass of a supported pipeline counts as that pipeline
                if isinstance(pipe, getattr(diffusers, supported)):
                    class_name = supported
            self.set_generation(class_name, "(the loaded pipeline)")
        if self.is_ltx2:
            self.audio = AudioLayout(
                sample_rate=pipe.audio_sampling_rate,
                hop_length=pipe.audio_hop_length,
                temporal_ratio=pipe.audio_vae_temporal_compression_ratio,
                channels=pipe.audio_vae.config.latent_channels,
                latent_mel_bins=pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio,
            )
        self.spatial_ratio = pipe.vae_spatial_compression_ratio
        self.temporal_ratio = pipe.vae_temporal_compression_ratio
        self.patch = pipe.transformer_spatial_patch_size
        self.patch_t = pipe.transformer_temporal_patch_size

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo

        if self.model_backend is not None:  # the backend's pipeline says which generation it is, and its sizes
            pipe = self.model_backend(path, parse_dtype(dtype))
            self.configure_pipeline(pipe)
            return {name: pipeline_component(pipe, name, path) for name in names}
        self.check_pipeline_class(path)
        modules = super().load_modules(path, names, dtype)
        # Only the VAEs' geometry is needed: read it from their configs, as their __init__ does.
        vae_class = AutoencoderKLLTX2Video if self.is_ltx2 else AutoencoderKLLTXVideo
        vae_config = vae_class.load_config(path, subfolder="vae")
        default_scaling = (True, True, True, True) if self.is_ltx2 else (True, True, True, False)
        scalings = sum(bool(s) for s in vae_config.get("spatio_temporal_scaling", default_scaling))
        self.spatial_ratio = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2**scalings
        self.temporal_ratio = (
            vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2**scalings
        )
        if self.is_ltx2:
            self.audio = audio_layout_from_config(path)
        transformer = modules.get("transformer")
        if transformer is not None:
            self.patch = transformer.config.patch_size
            self.patch_t = transformer.config.patch_size_t
        return modules

    def freeze_untrained(self, name: str, module: nn.Module) -> None:
        """LTX-2: the DiT's audio branch stays frozen in full fine-tuning (no gradients, no optimizer state)."""
        if self.is_ltx2 and name == "transformer":
            for param_name, param in module.named_parameters():
                if is_ltx2_audio_parameter(param_name):
                    param.requires_grad_(False)

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
        """LTX-Video: `prompt_embeds` [B, 128, D] + `prompt_attention_mask` [B, 128] (bool); with CFG the negatives
        too. LTX-2: the connectors' `prompt_embeds` [B, L, D_v], `audio_prompt_embeds` [B, L, D_a] and
        `prompt_attention_mask` [B, L] (no CFG)."""
        length = self.text_length()
        if self.is_ltx2:
            self.check_no_cfg(guidance)

            def encode_ltx2(batch: list[str]) -> dict[str, torch.Tensor]:
                embeds, mask, _, _ = pipe.encode_prompt(
                    prompt=batch, do_classifier_free_guidance=False, max_sequence_length=length
                )
                padding_side = getattr(pipe.tokenizer, "padding_side", "left")
                video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=padding_side)
                return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": connector_mask}

            return encode_with_negative(encode_ltx2, prompts, negative_prompt, cfg=False)

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            embeds, mask, _, _ = pipe.encode_prompt(
                prompt=batch, do_classifier_free_guidance=False, max_sequence_length=length
            )
            return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

        return encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance))

    def encode_condition_image(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> dict[str, torch.Tensor]:
        """LTX-2 image-to-video (`LTX2ImageToVideoPipeline.prepare_latents`, `image_crf=0`): `image_latents`
        [1, H'·W', C], the packed first latent frame of the normalised posterior mode (fp32)."""
        from PIL import Image

        if not self.is_ltx2:
            raise MilesUserError(condition_image_mismatch(self.family, CONDITION_IMAGE_NONE, True))
        self.first_frame_tokens(shape)  # refuses sizes the VAE cannot round-trip, and temporal patches
        if tuple(pixels.shape[:2]) != (shape.height, shape.width):  # the pipeline's video processor: bilinear
            resized = Image.fromarray(pixels.numpy()).resize((shape.width, shape.height), resample=Image.BILINEAR)
            pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
        image = (pixels.float() / 255.0 * 2.0 - 1.0).permute(2, 0, 1)[None, :, None]  # [1, 3, 1, H, W]
        vae = pipe.vae
        with torch.no_grad():
            latents = vae.encode(image.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        return {IMAGE_LATENTS: pack_latents((latents - mean) / std, self.patch, self.patch_t)}

    def first_frame_tokens(self, shape: GenerationShape) -> int:
        """How many packed video tokens the first latent frame holds (they lead the video part of the state)."""
        if self.patch_t != 1:  # the pipeline's conditioning mask is per token only for a temporal patch of 1
            raise ValueError(f"LTX-2 image-to-video needs a temporal patch size of 1, not {self.patch_t}")
        _, height, width = self.latent_grid(shape)
        return height * width // (self.patch * self.patch)

    def final_latents(self, latents: torch.Tensor, conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """LTX-2 image-to-video: the state's first-frame tokens (the first values of its video part) are the image."""
        if IMAGE_LATENTS not in conditioning:
            return latents
        image = conditioning[IMAGE_LATENTS].to(latents).flatten(1)
        return torch.cat([image, latents[:, image.shape[1]:]], dim=1)

    def text_length(self) -> int:
        return self.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH[self.generation or LTX_VIDEO]

    @staticmethod
    def check_no_cfg(guidance: GuidanceConfig) -> None:
        if guidance.do_cfg:
            raise MilesUserError(
                f"--diffusion-guidance-scale {guidance.scale:g}: LTX-2 trains and samples without CFG (the reference "
                "setup, guidance 1.0); pass --diffusion-guidance-scale 1.0"
            )

    # ---- schedule and latents -----------------------------------------------------------------------
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int, int]:
        """(F', H', W') of the unpacked latent; sizes the VAE cannot round-trip are refused with the flag named."""
        if self.spatial_ratio is None or self.temporal_ratio is None:
            raise RuntimeError("load the LTX pipeline (or its modules) before asking for latent sizes")
        temporal, spatial = self.temporal_ratio, self.spatial_ratio
        if shape.num_frames < 1 or (shape.num_frames - 1) % (temporal * self.patch_t):
            raise MilesUserError(
                f"--diffusion-output-num-frames {shape.num_frames} must be {temporal * self.patch_t}·k + 1 "
                "for LTX "
                f"(e.g. 1, {temporal * self.patch_t + 1}, 121)"
            )
        multiple = max(spatial * self.patch, 32)  # LTXPipeline.check_inputs asks for multiples of 32
        if shape.height % multiple or shape.width % multiple:
            raise MilesUserError(
                f"--diffusion-height/width {shape.height}x{shape.width} must be multiples of {multiple} for LTX"
            )
        return ((shape.num_frames - 1) // temporal + 1, shape.height // spatial, shape.width // spatial)

    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        frames, height, width = self.latent_grid(shape)
        tokens = frames * height * width  # LTX-Video: the latent count before patching
        if self.is_ltx2:
            tokens //= self.patch_t * self.patch * self.patch  # LTX-2: the packed video token count
        return scheduler_sigmas(
            pipe.scheduler.config,
            num_steps,
            flow_shift=flow_shift,
            image_seq_len=tokens,
            base_grid=flux_style_base_grid(num_steps),
        )

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        channels = pipe.transformer.config.in_channels
        noise = randn_per_sample((channels, *self.latent_grid(shape)), generators, device=pipe.transformer.device)
        video = pack_latents(noise, self.patch, self.patch_t)
        if not self.is_ltx2:
            return video
        # The same generators continue with the audio noise [C_a, L, M'], as LTX2Pipeline draws it.
        audio = self.audio_layout()
        audio_noise = randn_per_sample(
            (audio.channels, audio.num_frames(shape, self.fps(shape)), audio.latent_mel_bins),
            generators,
            device=pipe.transformer.device,
        )
        return join_modalities(video, pack_audio_latents(audio_noise))

    # ---- LTX-2 state layout --------------------------------------------------------------------------
    def fps(self, shape: GenerationShape) -> float:
        if shape.fps is not None:
            return shape.fps
        return LTX2_DEFAULT_FRAME_RATE if self.is_ltx2 else DEFAULT_FRAME_RATE

    def audio_layout(self) -> AudioLayout:
        if self.audio is None:
            raise RuntimeError("load the LTX-2 pipeline (or its modules) before asking for audio sizes")
        return self.audio

    def split_modalities(self, state: torch.Tensor, shape: GenerationShape) -> tuple[torch.Tensor, torch.Tensor]:
        """An LTX-2 state [B, D] -> (packed video [B, N_v, C_v], packed audio [B, L, C_a·M'])."""
        frames, height, width = self.latent_grid(shape)
        video_tokens = frames * height * width // (self.patch_t * self.patch * self.patch)
        audio = self.audio_layout()
        audio_frames = audio.num_frames(shape, self.fps(shape))
        audio_size = audio_frames * audio.channels * audio.latent_mel_bins
        video_size = state.shape[1] - audio_size
        if video_size <= 0 or video_size % video_tokens:
            raise ValueError(f"an LTX-2 state of {state.shape[1]} values does not fit {shape}")
        video = state[:, :video_size].reshape(state.shape[0], video_tokens, -1)
        return video, state[:, video_size:].reshape(state.shape[0], audio_frames, -1)

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
        if self.is_ltx2:
            return self.predict_velocity_ltx2(transformer, latents, timesteps, conditioning, guidance, shape, dtype)
        cfg = self.uses_cfg(guidance)
        keys = ("prompt_embeds", "prompt_attention_mask")
        latents, timesteps, text = cfg_batch_inputs(latents, timesteps, conditioning, keys, cfg)
        fps = self.fps(shape)
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

    def predict_velocity_ltx2(
        self,
        transformer: nn.Module,
        state: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Mapping[str, torch.Tensor],
        guidance: GuidanceConfig,
        shape: GenerationShape,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One joint forward: the video and audio velocities, joined like the state (fp32). Image-to-video: the
        first frame's tokens are the input image at video timestep 0, and get zero velocity."""
        self.check_no_cfg(guidance)
        frames, height, width = self.latent_grid(shape)
        video, audio = self.split_modalities(state, shape)
        mask = conditioning["prompt_attention_mask"]
        video_timesteps = timesteps
        image = conditioning.get(IMAGE_LATENTS)
        if image is not None:
            pinned = self.first_frame_tokens(shape)
            video = torch.cat([image.to(video), video[:, pinned:]], dim=1)
            video_timesteps = timesteps[:, None].expand(-1, video.shape[1]).clone()
            video_timesteps[:, :pinned] = 0  # t·(1 − conditioning_mask)
        video_velocity, audio_velocity = transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=conditioning["prompt_embeds"].to(dtype),
            audio_encoder_hidden_states=conditioning["audio_prompt_embeds"].to(dtype),
            timestep=video_timesteps,  # fp32 t = 1000·σ (per token with an input image)
            audio_timestep=timesteps,  # per sample
            sigma=timesteps,  # the pipeline passes t here too (LTX-2.3's prompt modulation)
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames // self.patch_t,
            height=height // self.patch,
            width=width // self.patch,
            fps=self.fps(shape),
            audio_num_frames=audio.shape[1],
            use_cross_timestep=True,  # LTX2Pipeline.__call__'s default
            return_dict=False,
        )
        video_velocity = video_velocity.float()
        if image is not None:  # the pinned frame does not move: no velocity, no gradient, a θ-free log-prob term
            pinned_velocity = torch.zeros_like(video_velocity[:, :pinned])
            video_velocity = torch.cat([pinned_velocity, video_velocity[:, pinned:]], dim=1)
        return join_modalities(video_velocity, audio_velocity.float())

    # ---- output -------------------------------------------------------------------------------------
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        vae = pipe.vae
        frames, height, width = self.latent_grid(shape)
        if self.is_ltx2:
            latents, _ = self.split_modalities(latents, shape)  # rewards read the frames; the audio is not decoded
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
        video = pack_latents((latents - mean) * vae.config.scaling_factor / std, self.patch, self.patch_t)
        if not self.is_ltx2:
            return video
        audio = self.audio_layout()
        silent = video.new_zeros(video.shape[0], audio.num_frames(shape, self.fps(shape)), audio.channels * audio.latent_mel_bins)
        return join_modalities(video, silent)

    def context_parallel_plan(self, module: nn.Module) -> dict | None:
        """LTX-2: none (its diffusers plan splits the video tokens only; the joint state is not split here)."""
        return None if self.is_ltx2 else super().context_parallel_plan(module)


def pack_audio_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, L, M] -> [B, L, C·M]: every mel bin of a latent frame in one token (`LTX2Pipeline._pack_audio_latents`)."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio_latents(latents: torch.Tensor, latent_mel_bins: int) -> torch.Tensor:
    """The inverse of `pack_audio_latents`."""
    return latents.unflatten(2, (-1, latent_mel_bins)).transpose(1, 2)


def join_modalities(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """Packed video [B, N_v, C_v] and audio [B, L, C_a·M'] -> one LTX-2 state [B, N_v·C_v + L·C_a·M']."""
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def audio_layout_from_config(path: str) -> AudioLayout:
    """The audio geometry from `audio_vae/config.json` (what `LTX2Pipeline.__init__` reads off the audio VAE)."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    config = AutoencoderKLLTX2Audio.load_config(path, subfolder="audio_vae")
    return AudioLayout(
        sample_rate=config.get("sample_rate", 16000),
        hop_length=config.get("mel_hop_length", 160),
        temporal_ratio=LATENT_DOWNSAMPLE_FACTOR,
        channels=config.get("latent_channels", 8),
        latent_mel_bins=(config.get("mel_bins") or 64) // LATENT_DOWNSAMPLE_FACTOR,
    )
