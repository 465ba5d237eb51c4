"""FLUX.1-Kontext (`FluxKontextPipeline`): image editing with FLUX.1's DiT, the input image as extra tokens.

Mirrors `FluxKontextPipeline.__call__` (diffusers 0.42) on top of the `flux` family (same text encoders,
packing, schedule, distilled guidance and true CFG):
- every prompt row carries an input image (`condition_image = "required"`). The engine encodes it once per
  request (`encode_condition_image`): its size floored to a multiple of 2·f (Lanczos resize when it was not),
  pixels to [-1, 1], the VAE posterior's mode, `(z − shift_factor)·scaling_factor`. The latents are stored
  unpacked ([C, h, w], `image_latents`) in the conditioning, so the trainer gets them with the sample and
  rebuilds their tokens and position ids from their own size.
- every forward appends the input image's packed tokens to the noisy latents' tokens (position ids with first
  coordinate 1 instead of 0), and keeps only the generated image's part of the output. Both true-CFG branches
  see the same input image.
- the output size is `--diffusion-height/width` as given: the pipeline's own `max_area` rescaling (to about
  1024² pixels) is not applied, so choose a Kontext resolution (e.g. 1024x1024, 880x1184). The rollout resizes
  each input image to that size (miles/rollout/condition_image.py) before it is encoded.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np
import torch

from miles.models.base import CONDITION_IMAGE_REQUIRED, GenerationShape, register_family
from miles.models.common import cfg_doubled, pack_2x2_latents, scale_shift_latents
from miles.models.flux import FluxTrainPipelineConfig, image_position_ids
from miles.utils.errors import MilesUserError

IMAGE_LATENTS = "image_latents"  # the conditioning key of the encoded input image, [C, h, w] per sample


@register_family
class FluxKontextTrainPipelineConfig(FluxTrainPipelineConfig):
    family: ClassVar[str] = "flux_kontext"
    name_hints: ClassVar[tuple[str, ...]] = ("kontext",)
    pipeline_class_name: ClassVar[str] = "FluxKontextPipeline"
    condition_image: ClassVar[str] = CONDITION_IMAGE_REQUIRED

    def encode_condition_image(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> dict[str, torch.Tensor]:
        """`image_latents` [1, C, h, w]: the pipeline's image preprocessing and `_encode_vae_image` (argmax)."""
        from PIL import Image

        multiple = 2 * (self.vae_scale_factor or pipe.vae_scale_factor)
        height, width = pixels.shape[0] // multiple * multiple, pixels.shape[1] // multiple * multiple
        if height == 0 or width == 0:
            raise MilesUserError(f"input image of {pixels.shape[0]}x{pixels.shape[1]} px is smaller than one FLUX "
                                 f"latent patch ({multiple} px)")
        if (height, width) != tuple(pixels.shape[:2]):
            resized = Image.fromarray(pixels.numpy()).resize((width, height), resample=Image.LANCZOS)
            pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
        vae = pipe.vae
        image = (pixels.float() / 255.0 * 2.0 - 1.0).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W] in [-1, 1]
        with torch.no_grad():
            latents = vae.encode(image.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        return {IMAGE_LATENTS: scale_shift_latents(vae, latents)}

    def with_condition_tokens(
        self, hidden_states: torch.Tensor, img_ids: torch.Tensor, conditioning: Mapping[str, torch.Tensor], cfg: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if IMAGE_LATENTS not in conditioning:
            raise MilesUserError(f"family {self.family!r} needs the input image's latents in the conditioning "
                                 f"({IMAGE_LATENTS!r}); the engine encodes them from the prompt row's \"image\"")
        image_latents = conditioning[IMAGE_LATENTS]
        grid_h, grid_w = image_latents.shape[-2] // 2, image_latents.shape[-1] // 2
        tokens = pack_2x2_latents(image_latents).to(hidden_states.dtype)
        if cfg:
            tokens = cfg_doubled(tokens)
        image_ids = image_position_ids(grid_h, grid_w, img_ids.device, img_ids.dtype)
        image_ids[:, 0] = 1  # the input image's tokens: first position coordinate 1, the generated image's 0
        return torch.cat([hidden_states, tokens], dim=1), torch.cat([img_ids, image_ids], dim=0)

    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        raise MilesUserError(f"SFT (--loss-type sft_loss) is not supported for family {self.family!r}: SFT rows carry "
                             "no input image to edit")
