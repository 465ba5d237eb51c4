"""The per-family interface: everything model-specific sits behind `TrainPipelineConfig`.

The engine (sampling) and the trainer (scoring) both call the same `predict_velocity`, so the two forwards
agree by construction. One subclass per family lives in `miles/models/<family>.py` and registers itself
with `@register_family`. Outside `miles/models/` no code branches on a family name.

Shapes. A *latent* is whatever the family's DiT consumes for one sample (e.g. [C, H, W] for SD3,
[C, F, H, W] for Wan, packed [N, C] for LTX/FLUX); batched latents add a leading batch axis.
*Conditioning* is a dict of tensors with a leading batch axis; the same keys are stored per sample
(without the batch axis) in `Sample.conditioning`, so the trainer never re-encodes prompts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError


@dataclass(frozen=True)
class GenerationShape:
    """Output size of one request (`--diffusion-height/width`, `--diffusion-output-num-frames`, `--diffusion-fps`)."""

    height: int = 512
    width: int = 512
    num_frames: int = 1
    fps: float | None = None


@dataclass(frozen=True)
class SequenceParallelLayout:
    """How a sequence-parallel engine splits one denoiser's tokens (miles/engine/sequence_parallel.py).

    `plan`: a diffusers context-parallel plan (`{submodule path: {input: ContextParallelInput}}` splits,
    `{submodule path: ContextParallelOutput}` gathers). `joint_attention`: the attention modules with SD3's
    joint [image, text] semantics (`JointAttnProcessor2_0`); `self_attention`: those with Wan's self-attention
    semantics (`WanAttnProcessor`); every other attention must be token-local (e.g. cross-attention to text).
    `patch_size`: the DiT's patch over the latent's trailing dims (the token count of a latent size)."""

    plan: Mapping[str, Any]
    patch_size: tuple[int, ...]
    joint_attention: tuple[nn.Module, ...] = ()
    self_attention: tuple[nn.Module, ...] = ()


CONDITION_IMAGE_NONE, CONDITION_IMAGE_REQUIRED, CONDITION_IMAGE_OPTIONAL = "none", "required", "optional"


def condition_image_mismatch(family: str, policy: str, has_image: bool) -> str | None:
    """Why a prompt row with (or without) an input image does not fit a family's `condition_image` policy, or
    None when it fits. The preflight, the engine and the data source all ask this one function."""
    if has_image and policy == CONDITION_IMAGE_NONE:
        return (f"family {family!r} takes no input image; remove the row's \"image\" or use an image-conditioned "
                "checkpoint (docs/models.md, Image-conditioned families)")
    if not has_image and policy == CONDITION_IMAGE_REQUIRED:
        return f"family {family!r} needs an input image in every prompt row (\"image\": path, docs/data.md)"
    return None


class TrainPipelineConfig(ABC):
    """One model family. Subclasses set the class attributes and implement the methods below."""

    family: ClassVar[str] = ""  # registry key, e.g. "sd3"
    name_hints: ClassVar[tuple[str, ...]] = ()  # lowercase substrings of a checkpoint name that select this family
    pipeline_class_name: ClassVar[str] = ""  # the diffusers pipeline class the checkpoint folder holds
    trainable_modules: ClassVar[tuple[str, ...]] = ("transformer",)  # --update-weight-target-module default
    default_lora_target_modules: ClassVar[tuple[str, ...]] = ()
    is_video: ClassVar[bool] = False
    # What the DiT's attention calls need, for the one SDPA kernel the parity group pins (batch_invariant.py):
    # flash takes no mask, memory-efficient takes no grouped-query attention.
    attention_uses_mask: ClassVar[bool] = False
    attention_uses_gqa: ClassVar[bool] = False
    num_train_timesteps: ClassVar[int] = 1000
    # Whether prompt rows carry an input image (`"image"` in the prompt file, docs/data.md): "none" (text only),
    # "required" (every row: image editing, image-to-video) or "optional" (rows with and without).
    condition_image: ClassVar[str] = CONDITION_IMAGE_NONE
    # CFG-parallel engines (miles/engine/cfg_parallel.py) run the two CFG branches on two processes. A family
    # declares that its guided velocity is exactly `combine_cfg(cat([v_neg, v_pos]), cfg_scale_at(...),
    # cfg_renormalize)`, each v its own `predict_velocity` under `cfg_branch_guidance`, by naming the conditioning
    # keys of the positive branch, each stored with a `negative_<key>` twin when CFG is on (`encode_with_negative`).
    # The negative branch is the same forward with every twin under its plain name; every other non-`negative_` key
    # (an input image's latents: FLUX.1-Kontext, Wan TI2V) goes to both branches. Empty: the family has no CFG of
    # two plain forwards (FLUX.2 has none at all), and a CFG-parallel engine refuses it.
    cfg_branch_keys: ClassVar[tuple[str, ...]] = ()
    # `combine_cfg`'s per-token renormalisation to the positive branch's norm (Qwen-Image true CFG): it reads only
    # the two branch outputs, so rank 0 applies it to the joined branches exactly as to the doubled batch.
    cfg_renormalize: ClassVar[bool] = False
    # A compiled engine (`--sglang-enable-torch-compile`) also compiles the VAE's decoder in place: the 2D
    # `AutoencoderKL` of SD3 and FLUX.1 decodes 1.8x faster compiled at 512² on an H200 (bench/RESULTS.md). Video VAEs
    # keep per-call frame caches that would recompile, so they stay eager.
    compile_vae_decoder: ClassVar[bool] = False

    # ---- loading ------------------------------------------------------------------------------------
    @abstractmethod
    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        """Load the whole diffusers pipeline (a folder or a hub id) with every component in `dtype`."""

    @abstractmethod
    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        """Load only the named denoiser modules (the trainer needs no encoders or VAE in RL mode)."""

    # ---- conditioning -------------------------------------------------------------------------------
    @abstractmethod
    def encode_prompt(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape | None = None,
    ) -> dict[str, torch.Tensor]:
        """Encode prompts (and, when CFG is on, the negative prompt) into batched conditioning tensors.

        `shape` is the output size of the request; most families ignore it (Cosmos 3 writes the resolution
        into its prompt)."""

    def encode_condition_image(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> dict[str, torch.Tensor]:
        """Encode a request's input image (uint8 [H, W, 3], on the host) into conditioning tensors with a batch
        axis of 1, merged with the prompt's conditioning. Called once per request, under no_grad: the trainer
        receives the tensors in `Sample.conditioning` as data, so no gradient ever reaches the encoder.
        Families whose `condition_image` is "none" never get here (the engine refuses the request first)."""
        raise MilesUserError(condition_image_mismatch(self.family or type(self).__name__, CONDITION_IMAGE_NONE, True))

    def encode_conditioning(
        self,
        pipe: Any,
        prompts: Sequence[str],
        negative_prompt: str | None,
        guidance: GuidanceConfig,
        *,
        shape: GenerationShape,
        image: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The conditioning of a batch of prompts sharing one input image (or none): `encode_prompt`, with the
        image's `encode_condition_image` tensors repeated to the batch and merged in. A family whose text encoder
        also reads the image (Qwen-Image-Edit) overrides this."""
        conditioning = self.encode_prompt(pipe, prompts, negative_prompt, guidance, shape=shape)
        if image is not None:
            encoded = self.encode_condition_image(pipe, image, shape)
            conditioning.update({key: value.expand(len(prompts), *value.shape[1:]) for key, value in encoded.items()})
        return conditioning

    @classmethod
    def condition_image_policy(cls, hf_checkpoint: str | None) -> str:
        """`condition_image` for a checkpoint, read without loading weights (the preflight's question). A family
        whose layouts differ (Wan: only the TI2V 5B takes an image) reads the checkpoint's model_index.json."""
        return cls.condition_image

    @classmethod
    def largest_image_side(cls, hf_checkpoint: str | None) -> int | None:
        """The largest output height or width in pixels the checkpoint's denoiser takes, read from its config
        files without loading weights (the preflight's question); None where none is known (a family whose
        positions are rotary, a hub id)."""
        return None

    def final_latents(self, latents: torch.Tensor, conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The clean latents x_n after the last step, as decoded and returned as `clean_latents`: the state itself,
        except where the family pins part of it to a condition (Wan TI2V image-to-video: the first latent frame)."""
        return latents

    # ---- schedule and latents -----------------------------------------------------------------------
    @abstractmethod
    def sigmas(self, pipe: Any, num_steps: int, shape: GenerationShape, flow_shift: float | None) -> torch.Tensor:
        """The generation sigma grid, n + 1 values from 1 down to a terminal 0 (docs/algorithms.md §1)."""

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """What the DiT takes as its time input (SD3/Wan: N·σ; Qwen-Image: σ)."""
        return sigmas * self.num_train_timesteps

    @abstractmethod
    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        """Initial noise, one draw per sample from that sample's own generator, fp32, batched."""

    # ---- the denoiser -------------------------------------------------------------------------------
    @abstractmethod
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
        """The CFG-combined velocity v for a batch (`sigmas`: one per sample, shape [B]), returned in fp32.

        The inputs are cast to `dtype` for the DiT; CFG runs the negative and positive branches as one
        doubled batch. Every sample of the batch must be in the same expert phase (`expert_for`).
        """

    def expert_for(self, sigma: float) -> str:
        """Which module denoises at this noise level (Wan2.2 switches experts at its boundary)."""
        return self.trainable_modules[0]

    # ---- classifier-free guidance -------------------------------------------------------------------
    def uses_cfg(self, guidance: GuidanceConfig) -> bool:
        """Whether `guidance` asks for CFG at all: `--diffusion-guidance-scale` > 1 (FLUX.1 and Qwen-Image: only
        their true CFG; Wan2.2: either expert's scale)."""
        return guidance.scale > 1.0

    def guidance_scale_for(self, expert: str, guidance: GuidanceConfig) -> float:
        """The CFG scale of the forwards that `expert` runs (Wan2.2's low-noise expert: `guidance_scale_2`)."""
        return guidance.scale

    def cfg_scale_at(self, guidance: GuidanceConfig, sigma: float) -> float | None:
        """The scale that `combine_cfg` joins the two branches with in a forward at noise level `sigma`, or None
        when that forward runs one plain branch (the rule every family's `predict_velocity` follows)."""
        scale = self.guidance_scale_for(self.expert_for(sigma), guidance)
        return scale if self.uses_cfg(guidance) and scale > 1.0 else None

    @staticmethod
    def cfg_branch_guidance(guidance: GuidanceConfig) -> GuidanceConfig:
        """The guidance of one CFG branch forward: true CFG at 1 and no second scale switch CFG off in every
        family, while `guidance_scale` still reaches a guidance-distilled DiT's embedding (FLUX.1, Qwen-Image's
        distilled variants), as it does inside the doubled batch."""
        return GuidanceConfig(guidance_scale=guidance.guidance_scale, guidance_scale_2=None, true_cfg_scale=1.0)

    # ---- output -------------------------------------------------------------------------------------
    @abstractmethod
    def decode(self, pipe: Any, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Final latents to uint8 pixels [B, F, H, W, 3] (F = 1 for images)."""

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """uint8 pixels [B, F, H, W, 3] (F = `shape.num_frames`, 1 for image families) to clean latents x0.

        The inverse of `decode`: the VAE posterior mean, normalised and laid out exactly like the latents of
        `prepare_latents` / `predict_velocity` for `shape` (batched, fp32). SFT uses it (docs/algorithms.md §7).
        Families that do not implement it cannot train with `--loss-type sft_loss`.
        """
        raise MilesUserError(
            f"SFT (--loss-type sft_loss) is not supported for family {self.family or type(self).__name__!r}: "
            "its TrainPipelineConfig has no encode_images(pipe, pixels, shape)"
        )

    # ---- training ---------------------------------------------------------------------------------
    def freeze_untrained(self, name: str, module: nn.Module) -> None:
        """Called by the trainer after it unfreezes module `name` for full fine-tuning: switch off
        `requires_grad` of the parameters the family never trains (LTX-2's audio branch), so they get no
        gradients and no optimizer state. The default trains every parameter."""

    # ---- parallelism --------------------------------------------------------------------------------
    def transformer_block_lists(self, module: nn.Module) -> list[nn.ModuleList]:
        """The ModuleLists whose blocks FSDP wraps one by one."""
        return [m for m in module.children() if isinstance(m, nn.ModuleList)]

    def context_parallel_plan(self, module: nn.Module) -> dict | None:
        """The diffusers context-parallel plan for sequence parallelism, or None if the family has none."""
        return getattr(module, "_cp_plan", None)

    def sequence_parallel_layout(self, module: nn.Module) -> SequenceParallelLayout | None:
        """The engine's sequence-parallel split of one denoiser (`--rollout-num-gpus-per-engine N`), or None."""
        return None


FAMILIES: dict[str, type[TrainPipelineConfig]] = {}


def register_family(cls: type[TrainPipelineConfig]) -> type[TrainPipelineConfig]:
    assert cls.family and cls.family not in FAMILIES, f"bad or duplicate family key {cls.family!r}"
    FAMILIES[cls.family] = cls
    return cls
