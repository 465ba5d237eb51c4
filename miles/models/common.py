"""Helpers shared by every family: loading, per-sample noise, CFG, uint8 output, and building the family.

Family modules (`miles/models/<family>.py`) subclass `DiffusersTrainPipelineConfig`, which loads a diffusers
pipeline folder (or hub id) with `dtype=` (diffusers 0.42 rejects `torch_dtype=`), checks the folder for
missing components first, and honours `--model-backend-path`. `build_train_pipeline_config` is the
one entry point the engine and the trainer use to get the family object.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from abc import abstractmethod
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape, TrainPipelineConfig
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function, load_object

logger = logging.getLogger(__name__)

# `fn(path, dtype) -> pipeline`, the signature `--model-backend-path` points at.
ModelBackend = Callable[[str, torch.dtype], Any]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bf16"` / `"fp32"` / `"fp16"` (the `--*-dtype` flag values) or a torch dtype -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise MilesUserError(f"unknown dtype {name!r}; choose one of bf16, fp16, fp32")
    return DTYPES[name]


# ---- checkpoint folders ------------------------------------------------------------------------------


def read_model_index(path: str) -> dict[str, Any] | None:
    """The folder's `model_index.json` as a dict, or None when `path` is not a local folder (a hub id)."""
    if not os.path.isdir(path):
        return None
    index_path = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_path):
        raise MilesUserError(
            f"--hf-checkpoint {path!r} is a folder without model_index.json; expected a diffusers pipeline folder "
            "(saved with save_pretrained)"
        )
    with open(index_path) as f:
        return json.load(f)


def read_component_config(path: str | None, component: str) -> dict[str, Any] | None:
    """`<path>/<component>/config.json` as a dict, read without loading weights; None for a hub id or a folder
    without that file (loading reports a missing component)."""
    config_path = os.path.join(path, component, "config.json") if path and os.path.isdir(path) else None
    if config_path is None or not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise MilesUserError(f"--hf-checkpoint {path!r}: cannot read {config_path}: {err}") from None
    return config if isinstance(config, dict) else None


def check_components(path: str, components: Sequence[str]) -> None:
    """Raise a MilesUserError naming the first of `components` the local pipeline folder lacks.

    A component is missing when model_index.json does not list it (or lists it as null) or when its
    subfolder is absent. Hub ids are not checked here (diffusers reports those itself).
    """
    index = read_model_index(path)
    if index is None:
        return
    for name in components:
        entry = index.get(name)
        if not entry or entry[0] is None or not os.path.isdir(os.path.join(path, name)):
            raise MilesUserError(
                f"the checkpoint folder {path!r} is missing the component {name!r} "
                f"(no {name}/ subfolder or no entry in model_index.json)"
            )


def _component_class(path: str, name: str) -> type:
    """The class model_index.json names for component `name` (e.g. SD3Transformer2DModel)."""
    import importlib

    index = read_model_index(path)
    if index is None:  # hub id: read model_index.json through the hub cache
        from diffusers import DiffusionPipeline

        index = DiffusionPipeline.load_config(path)
    library, class_name = index[name]
    module = importlib.import_module("diffusers" if library in ("diffusers", None) else library)
    return getattr(module, class_name)


# ---- the shared base class ---------------------------------------------------------------------------


class DiffusersTrainPipelineConfig(TrainPipelineConfig):
    """A family stored as a diffusers pipeline: loading is shared, the denoising details are per family.

    `required_components` are checked before loading so that a folder missing one fails with a clear
    message. `model_backend` (from `--model-backend-path`) replaces `from_pretrained` entirely.
    """

    required_components: ClassVar[tuple[str, ...]] = ("transformer", "vae", "scheduler")

    def __init__(self, model_backend: ModelBackend | None = None) -> None:
        self.model_backend = model_backend

    def pipeline_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def pipeline_from_pretrained_kwargs(self) -> dict[str, Any]:
        """Extra `from_pretrained` keyword arguments a family needs (none by default)."""
        return {}

    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        dtype = parse_dtype(dtype)
        if self.model_backend is not None:
            pipe = self.model_backend(path, dtype)
            if pipe is None:
                raise MilesUserError(f"--model-backend-path returned None for {path!r}; it must return a pipeline")
        else:
            check_components(path, self.required_components)
            pipe = self.pipeline_class().from_pretrained(path, dtype=dtype, **self.pipeline_from_pretrained_kwargs())
        pipe.to(device)
        self.configure_pipeline(pipe)
        return pipe

    def configure_pipeline(self, pipe: Any) -> None:
        """Hook for family-specific settings after loading (e.g. Qwen-Image's prompt template length)."""

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        dtype = parse_dtype(dtype)
        if self.model_backend is not None:
            pipe = self.model_backend(path, dtype)
            return {name: pipeline_component(pipe, name, path) for name in names}
        check_components(path, names)
        modules: dict[str, nn.Module] = {}
        for name in names:
            cls = _component_class(path, name)
            modules[name] = cls.from_pretrained(path, subfolder=name, dtype=dtype)
        return modules


def pipeline_component(pipe: Any, name: str, path: str) -> nn.Module:
    """Component `name` of a pipeline returned by `--model-backend-path`, or a one-line error naming it."""
    module = getattr(pipe, name, None)
    if module is None:
        raise MilesUserError(f"the pipeline loaded by --model-backend-path for {path!r} has no component {name!r}")
    return module


# ---- 2×2 packed latents (the DiT takes 2×2 latent patches as tokens) ---------------------------------


def pack_2x2_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2×2 patches as tokens (the pipelines' `_pack_latents`)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def even_latent_grid(shape: GenerationShape, vae_scale_factor: int, model: str) -> tuple[int, int]:
    """The latent height and width of 2×2-patched models (FLUX.1, FLUX.2): 2·⌊H / 2f⌋, as the pipelines floor to even
    latent sizes; an output smaller than one patch is a user error naming `model`."""
    patch = vae_scale_factor * 2
    latent_h, latent_w = 2 * (shape.height // patch), 2 * (shape.width // patch)
    if latent_h == 0 or latent_w == 0:
        raise MilesUserError(
            f"--diffusion-height/width {shape.height}x{shape.width} is smaller than one {model} latent patch ({patch} px)"
        )
    return latent_h, latent_w


def unpack_2x2_latents(latents: torch.Tensor, latent_h: int, latent_w: int) -> torch.Tensor:
    """The inverse of `pack_2x2_latents`: [B, N, 4C] -> [B, C, h, w]."""
    b, _, channels = latents.shape
    patches = latents.view(b, latent_h // 2, latent_w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, latent_h, latent_w)


class Packed2x2TrainPipelineConfig(DiffusersTrainPipelineConfig):
    """A family whose DiT reads packed 2×2 latent patches [N, 4C] and takes σ as its time input.

    Shared here: the VAE scale factor (from the loaded pipeline, or from `vae/config.json` when only the
    denoiser modules are loaded), the noise and its packing, and the pieces of the transformer call that
    such pipelines build alike. A subclass gives `latent_grid` (its size rules) and
    `scale_factor_from_vae_config` (its VAE's formula).
    """

    def __init__(self, model_backend: ModelBackend | None = None) -> None:
        super().__init__(model_backend)
        self.vae_scale_factor: int | None = None  # learnt at load time; packing needs it without the VAE

    @staticmethod
    @abstractmethod
    def scale_factor_from_vae_config(vae_config: Mapping[str, Any]) -> int:
        """The VAE scale factor the pipeline derives from its VAE's config."""

    @abstractmethod
    def latent_grid(self, shape: GenerationShape) -> tuple[int, int]:
        """The unpacked latent height and width for an output size (refusing sizes the family cannot make)."""

    def configure_pipeline(self, pipe: Any) -> None:
        self.vae_scale_factor = pipe.vae_scale_factor

    def load_modules(self, path: str, names: Sequence[str], dtype: torch.dtype) -> dict[str, nn.Module]:
        modules = super().load_modules(path, names, dtype)
        if self.vae_scale_factor is None:
            config_path = os.path.join(path, "vae", "config.json")
            if os.path.isfile(config_path):
                with open(config_path) as f:
                    self.vae_scale_factor = self.scale_factor_from_vae_config(json.load(f))
            else:
                self.vae_scale_factor = 8
        return modules

    def num_image_tokens(self, shape: GenerationShape) -> int:
        latent_h, latent_w = self.latent_grid(shape)
        return (latent_h // 2) * (latent_w // 2)

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The DiT takes σ (the pipeline divides its 1000·σ timesteps by 1000; docs/algorithms.md §1)."""
        return sigmas * self.num_train_timesteps / self.num_train_timesteps

    def dit_timesteps(self, sigmas: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Exactly the pipeline's expression: scheduler timesteps (fp32 1000·σ) cast to the latents' dtype, / 1000."""
        return (sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps).to(dtype) / 1000

    @staticmethod
    def distilled_guidance(
        transformer: nn.Module, batch_size: int, guidance: GuidanceConfig, device: torch.device
    ) -> torch.Tensor | None:
        """The guidance-embedding input of a guidance-distilled transformer (`guidance_embeds`), else None."""
        if not transformer.config.guidance_embeds:
            return None
        return torch.full((batch_size,), guidance.guidance_scale, device=device)

    def prepare_latents(
        self, pipe: Any, shape: GenerationShape, generators: Sequence[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        latent_h, latent_w = self.latent_grid(shape)
        channels = pipe.transformer.config.in_channels // 4
        noise = randn_per_sample((channels, latent_h, latent_w), generators, device=pipe.transformer.device)
        return pack_2x2_latents(noise)

    def unpack(self, latents: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        """Packed latents [B, N, 4C] back to [B, C, h, w] for this output size."""
        return unpack_2x2_latents(latents, *self.latent_grid(shape))


# ---- noise -------------------------------------------------------------------------------------------


def randn_per_sample(
    sample_shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """fp32 noise [B, *sample_shape], sample b drawn from generators[b] on that generator's device.

    This is what diffusers' `randn_tensor` does with a list of generators (one `randn((1, *shape))` per
    generator), so a sample's noise depends only on its own seed, never on its batch neighbours.
    """
    if len(generators) == 0:
        raise ValueError("randn_per_sample needs one generator per sample")
    draws = [
        torch.randn((1, *sample_shape), generator=g, device=g.device, dtype=torch.float32) for g in generators
    ]
    return torch.cat([d.to(device) for d in draws], dim=0)


def generators_from_seeds(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sample, seeded `seeds[b]` (the engine's `seed, seed+1, ...` of a request)."""
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]


# ---- sigma schedules from a scheduler config ---------------------------------------------------------

UNSUPPORTED_SCHEDULER_OPTIONS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")


def scheduler_sigmas(
    scheduler_config: Mapping[str, Any],
    num_steps: int,
    *,
    flow_shift: float | None = None,
    image_seq_len: int | None = None,
    base_grid: Sequence[float] | None = None,
    default_max_shift: float = 1.15,
    mu: float | None = None,
) -> torch.Tensor:
    """n + 1 fp32 sigmas (terminal 0) as a FlowMatchEulerDiscreteScheduler with this config would give them.

    Composes the math core (`miles.diffusion.schedules`, docs/algorithms.md §1):
    - static shift (`shift`, or `flow_shift` when given) or, when the config has `use_dynamic_shifting`
      and no `flow_shift` override, the dynamic shift `mu = dynamic_shift_mu(image_seq_len, ...)` from the
      config's base/max sequence lengths and shifts (exponential: shift factor e^mu; linear: mu);
    - `base_grid`: the unshifted grid the pipeline passes as `sigmas=` (FLUX/Qwen-Image pass
      `linspace(1, 1/n, n)`); None means the scheduler's own grid;
    - `shift_terminal`: the stretch that makes the last non-zero sigma equal that value.
    `default_max_shift` is the default the pipeline's own `calculate_shift` call uses (SD3 passes 1.16).
    `mu`: the dynamic shift's μ when the pipeline computes it its own way (FLUX.2's empirical μ); it replaces
    `dynamic_shift_mu(image_seq_len, ...)`.
    """
    from miles.diffusion.schedules import dynamic_shift_mu, flow_match_sigmas

    for option in UNSUPPORTED_SCHEDULER_OPTIONS:
        if scheduler_config.get(option):
            raise MilesUserError(f"scheduler option {option}=True is not supported by miles' sigma schedules")
    num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
    dynamic = bool(scheduler_config.get("use_dynamic_shifting")) and flow_shift is None
    if dynamic and mu is None:
        if image_seq_len is None:
            raise ValueError("a dynamic-shift schedule needs image_seq_len")
        mu = dynamic_shift_mu(
            image_seq_len,
            base_seq_len=scheduler_config.get("base_image_seq_len", 256),
            max_seq_len=scheduler_config.get("max_image_seq_len", 4096),
            base_shift=scheduler_config.get("base_shift", 0.5),
            max_shift=scheduler_config.get("max_shift", default_max_shift),
        )
    if dynamic:
        shift_type = scheduler_config.get("time_shift_type", "exponential")
        if shift_type not in ("exponential", "linear"):
            raise MilesUserError(f"scheduler time_shift_type {shift_type!r} is not supported")
        shift_factor = mu
    else:
        shift_factor = float(flow_shift if flow_shift is not None else scheduler_config.get("shift", 1.0))

    base = None if base_grid is None else [float(u) for u in base_grid]
    if dynamic and shift_type == "linear" and base is None:  # the dynamic scheduler's grid is unshifted
        base = flow_match_sigmas(num_steps, shift=1.0, num_train_timesteps=num_train_timesteps)[:-1].tolist()
    if dynamic and shift_type == "exponential":
        with_terminal = flow_match_sigmas(num_steps, num_train_timesteps=num_train_timesteps, mu=mu, sigmas=base)
    else:  # static shift; the linear time shift mu/(mu + 1/u - 1) is the static shift with s = mu
        with_terminal = flow_match_sigmas(
            num_steps, shift=shift_factor, num_train_timesteps=num_train_timesteps, sigmas=base
        )
    sigmas = with_terminal[:-1]
    sigmas = sigmas.to(torch.float32)
    shift_terminal = scheduler_config.get("shift_terminal")
    if shift_terminal:
        # Stretch so that the last non-zero sigma lands on shift_terminal (diffusers' stretch_shift_to_terminal).
        one_minus = 1.0 - sigmas
        sigmas = 1.0 - one_minus / (one_minus[-1] / (1.0 - shift_terminal))
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def flux_style_base_grid(num_steps: int) -> list[float]:
    """The unshifted grid FLUX and Qwen-Image pass as `sigmas=`: numpy's linspace(1, 1/n, n) in float64."""
    return np.linspace(1.0, 1.0 / num_steps, num_steps).tolist()


# ---- classifier-free guidance ------------------------------------------------------------------------


def cfg_doubled(tensor: torch.Tensor) -> torch.Tensor:
    """Repeat a batch for the [negative; positive] doubled CFG forward."""
    return torch.cat([tensor, tensor], dim=0)


def cfg_pair(negative: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """The doubled-batch layout every family uses: negatives first, then positives (diffusers' order)."""
    return torch.cat([negative, positive], dim=0)


def encode_with_negative(
    encode: Callable[[list[str]], Mapping[str, torch.Tensor]],
    prompts: Sequence[str],
    negative_prompt: str | None,
    cfg: bool,
    default_negative: str = "",
) -> dict[str, torch.Tensor]:
    """Conditioning for a batch of prompts and, when `cfg`, the negative prompt under `negative_<key>`.

    `encode(prompts)` returns batched tensors by key. The negative prompt (`default_negative` when None) is
    encoded once and repeated to the batch, so the conditioning pairs key by key for `cfg_batch_inputs`.
    """
    prompts = list(prompts)
    with torch.no_grad():
        conditioning = dict(encode(prompts))
        if cfg:
            negative = encode([negative_prompt if negative_prompt is not None else default_negative])
            for key, value in negative.items():
                conditioning[f"negative_{key}"] = repeat_batch(value, len(prompts))
    return conditioning


def cfg_batch_inputs(
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    keys: Sequence[str],
    cfg: bool,
    cfg_name: str = "CFG",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The DiT inputs of one forward: with `cfg`, the [negative; positive] doubled batch (latents and timesteps
    repeated, each conditioning `key` paired with its `negative_<key>`, as `encode_with_negative` stores it);
    without, the inputs as they are."""
    if not cfg:
        return latents, timesteps, {key: conditioning[key] for key in keys}
    if f"negative_{keys[0]}" not in conditioning:
        raise ValueError(
            f"{cfg_name} is on but the conditioning holds no negative_{keys[0]}; encode with {cfg_name} on"
        )
    paired = {key: cfg_pair(conditioning[f"negative_{key}"], conditioning[key]) for key in keys}
    return cfg_doubled(latents), cfg_doubled(timesteps), paired


def combine_cfg(doubled_output: torch.Tensor, scale: float, renormalize: bool = False) -> torch.Tensor:
    """Split a [negative; positive] doubled output and combine it (docs/algorithms.md §1, CFG), in fp32.

    `v = v_neg + scale·(v_pos − v_neg)`; with `renormalize` (Qwen-Image true CFG) each token is rescaled
    to the positive branch's norm over the feature (last) axis: `v ← v·‖v_pos‖ / max(‖v‖, 1e-12)`.
    """
    v_neg, v_pos = doubled_output.float().chunk(2, dim=0)
    combined = v_neg + scale * (v_pos - v_neg)
    if renormalize:
        pos_norm = torch.linalg.vector_norm(v_pos, dim=-1, keepdim=True)
        comb_norm = torch.linalg.vector_norm(combined, dim=-1, keepdim=True)
        combined = combined * (pos_norm / comb_norm.clamp_min(1e-12))
    return combined


# ---- conditioning helpers ----------------------------------------------------------------------------


def pad_to_length(tensor: torch.Tensor, length: int, dim: int = 1, value: float = 0.0) -> torch.Tensor:
    """Right-pad (or truncate) `tensor` along `dim` to `length`, so samples of different prompts stack."""
    current = tensor.shape[dim]
    if current >= length:
        return tensor.narrow(dim, 0, length)
    pad_shape = list(tensor.shape)
    pad_shape[dim] = length - current
    return torch.cat([tensor, tensor.new_full(pad_shape, value)], dim=dim)


def repeat_batch(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A [1, ...] tensor (one encoded negative prompt) repeated to [batch_size, ...]."""
    return tensor.expand(batch_size, *tensor.shape[1:]).contiguous()


# ---- output ------------------------------------------------------------------------------------------


def vae_output_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1], channels-first ([B, 3, H, W] or [B, 3, F, H, W]) -> uint8 [B, F, H, W, 3].

    Same rounding as diffusers' image processor (`round(clamp(x/2 + 0.5, 0, 1)·255)`), docs/algorithms.md §10.
    """
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    if images.ndim == 4:
        images = images.unsqueeze(2)  # [B, 3, 1, H, W]
    if images.ndim != 5:
        raise ValueError(f"expected VAE output [B, 3, H, W] or [B, 3, F, H, W], got {tuple(images.shape)}")
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()


def decode_scaled_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Decode `x / scaling_factor + shift_factor` with the VAE (in its dtype), to uint8 pixels."""
    scaled = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    with torch.no_grad():
        images = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
    return vae_output_to_uint8(images)


# ---- input: pixels to clean latents (SFT, the inverse of decode) ------------------------------------


def vae_latent_mean(
    family: TrainPipelineConfig, vae: Any, pixels: torch.Tensor, shape: GenerationShape, *, video_vae: bool
) -> torch.Tensor:
    """uint8 pixels [B, F, H, W, 3] -> the VAE posterior mean (fp32, not yet normalised).

    Pixels map to [-1, 1] as the pipelines' image processors do. `video_vae`: the VAE takes [B, 3, F, H, W]
    and returns [B, C, f, h, w] (Wan / Qwen-Image / LTX / Cosmos); otherwise it takes images [B, 3, H, W]
    and returns [B, C, h, w] (F must be 1). Frame count and size must be those of `shape`.
    """
    if pixels.dtype != torch.uint8 or pixels.ndim != 5 or pixels.shape[-1] != 3:
        raise ValueError(f"expected uint8 pixels [B, F, H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}")
    frames, height, width = pixels.shape[1:4]
    if frames != shape.num_frames:
        kind = "video" if family.is_video else "images"
        raise MilesUserError(
            f"family {family.family!r} trains on {kind} of {shape.num_frames} frame(s) "
            f"(--diffusion-output-num-frames); got {frames} frames per row"
        )
    if (height, width) != (shape.height, shape.width):
        raise MilesUserError(
            f"pixels are {height}x{width}, --diffusion-height/width ask for {shape.height}x{shape.width}"
        )
    images = pixels.float().permute(0, 4, 1, 2, 3) / 127.5 - 1.0  # [B, 3, F, H, W]
    if not video_vae:
        images = images[:, :, 0]
    with torch.no_grad():
        posterior = vae.encode(images.to(device=vae.device, dtype=vae.dtype)).latent_dist
    return posterior.mean.float()


def scale_shift_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """`(z − shift_factor) · scaling_factor`: the inverse of `decode_scaled_latents` (SD3, FLUX)."""
    return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


def normalize_latent_stats(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """`(z − latents_mean) · (1 / latents_std)` per channel of [B, C, f, h, w], the inverse of the Wan-style
    VAE decode `x / (1 / std) + mean` (Wan 2.2, Qwen-Image, Cosmos 3; the image-to-video pipelines' form)."""
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(view).to(latents.device)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32).view(view).to(latents.device)
    return (latents.float() - mean) * inverse_std


# ---- building the family object ----------------------------------------------------------------------


def load_model_backend(path: str | None) -> ModelBackend | None:
    """`--model-backend-path`: a user `fn(path, dtype) -> pipeline` that replaces the family's loader."""
    if not path:
        return None
    return load_function(path, "--model-backend-path", required_params=2)


def load_train_pipeline_config_class(path: str) -> type[TrainPipelineConfig]:
    """`--train-pipeline-config-path`: a user TrainPipelineConfig subclass, checked to be concrete."""
    cls = load_object(path, "--train-pipeline-config-path")
    if not (inspect.isclass(cls) and issubclass(cls, TrainPipelineConfig)):
        raise MilesUserError(
            f"--train-pipeline-config-path {path!r}: must name a subclass of miles.models.base.TrainPipelineConfig, "
            f"got {cls!r}"
        )
    if inspect.isabstract(cls):
        missing = sorted(cls.__abstractmethods__)
        raise MilesUserError(f"--train-pipeline-config-path {path!r}: {cls.__name__} does not implement {missing}")
    return cls


def build_train_pipeline_config(
    hf_checkpoint: str | None,
    *,
    diffusion_model_family: str | None = None,
    train_pipeline_config_path: str | None = None,
    model_backend_path: str | None = None,
) -> TrainPipelineConfig:
    """The family object for a run: `--train-pipeline-config-path`, else the registered family that
    `--diffusion-model-family` names or `hf_checkpoint` resolves to; `--model-backend-path` overrides its loader."""
    backend = load_model_backend(model_backend_path)
    if train_pipeline_config_path:
        if diffusion_model_family:
            raise MilesUserError(
                "--train-pipeline-config-path and --diffusion-model-family are mutually exclusive; pass one"
            )
        cls = load_train_pipeline_config_class(train_pipeline_config_path)
    else:
        cls = get_family_class(resolve_family_name(hf_checkpoint, diffusion_model_family))
    if issubclass(cls, DiffusersTrainPipelineConfig):
        return cls(model_backend=backend)
    if backend is not None:
        raise MilesUserError(
            f"--model-backend-path needs a family derived from miles.models.common.DiffusersTrainPipelineConfig; "
            f"{cls.__name__} loads its own models (put the loading in its load_pipeline instead)"
        )
    return cls()


def conditioning_batch(conditionings: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample conditioning dicts (no batch axis, as stored in `Sample.conditioning`) into a batch."""
    keys = conditionings[0].keys()
    return {key: torch.stack([c[key] for c in conditionings], dim=0) for key in keys}


def conditioning_unbatch(conditioning: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Split a batched conditioning dict into per-sample dicts (the inverse of `conditioning_batch`)."""
    batch_size = next(iter(conditioning.values())).shape[0]
    return [{key: value[b] for key, value in conditioning.items()} for b in range(batch_size)]
