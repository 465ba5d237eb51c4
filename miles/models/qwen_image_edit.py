"""Qwen-Image-Edit (`QwenImageEditPipeline`): image editing with Qwen-Image's MMDiT; the input image is read twice,
by the Qwen2.5-VL text encoder (with the instruction) and as extra latent tokens.

Mirrors `QwenImageEditPipeline.__call__` (diffusers 0.42) on top of the `qwen_image` family (same DiT call,
schedule, true CFG with renormalisation, decode):
- every prompt row carries an input image (`condition_image = "required"`); the engine encodes it once per request
  together with the prompt (`encode_conditioning`), since the text encoder sees it:
  - the prompt, wrapped in the edit template (a system turn, then the user turn `<|vision_start|><|image_pad|>
    <|vision_end|>{prompt}`), and the image go through the Qwen2-VL processor and Qwen2.5-VL; the template's
    system turn (`prompt_template_encode_start_idx`, 64 with the real tokenizer, recounted from the loaded one)
    is dropped, so the embeddings hold the image's vision tokens, the prompt and the template's tail. They are
    zero-padded to `prompt_pad_length` (512) plus the image's vision tokens, so samples of any prompts stack; the
    negative prompt (default " ") is encoded with the same image;
  - `image_latents` [1, N, 4C]: the image through the VAE (posterior mode), `(z − latents_mean)/latents_std`,
    packed into 2×2 patches.
- every forward appends `image_latents` after the noisy tokens (`img_shapes` lists the generated grid then the
  input image's), and keeps the generated image's part of the output; both true-CFG branches see the image.
- the input image is used at the output size (`--diffusion-height/width`; the rollout resizes it there, Lanczos,
  miles/rollout/condition_image.py). One deliberate difference: the pipeline resizes it to about 1024² pixels
  with its own aspect ratio (`calculate_dimensions`) whatever the output size; choose an output of about 1024²
  pixels with the inputs' aspect ratio (e.g. 1024x1024) and the two agree.
- the processor: the checkpoint's `processor/` folder (tokenizer + Qwen2-VL image processor config) is assembled
  here into a `Qwen2VLProcessor` without its video processor, with the image processor's PIL backend:
  transformers builds the stock class only with torchvision, which the edit pipeline does not need (it passes
  images only). With torchvision installed diffusers would load the torchvision backend, whose resize can differ
  from PIL's by rounding.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import torch

from miles.models.base import CONDITION_IMAGE_REQUIRED, GenerationShape, condition_image_mismatch, register_family
from miles.models.common import cfg_doubled, check_components, encode_with_negative, pack_2x2_latents, parse_dtype
from miles.models.qwen_image import QwenImageTrainPipelineConfig
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

IMAGE_LATENTS = "image_latents"  # the input image's packed 2×2 tokens [N, 4C] per sample


def image_only_processor(path: str) -> Any:
    """A `Qwen2VLProcessor` from the checkpoint's `processor/` folder: its tokenizer and a PIL-backend Qwen2-VL
    image processor, no video processor (whose transformers class needs torchvision)."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path, subfolder="processor")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor")
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


@register_family
class QwenImageEditTrainPipelineConfig(QwenImageTrainPipelineConfig):
    family: ClassVar[str] = "qwen_image_edit"
    name_hints: ClassVar[tuple[str, ...]] = ("qwen-image-edit", "qwen_image_edit", "qwenimageedit")
    pipeline_class_name: ClassVar[str] = "QwenImageEditPipeline"
    required_components: ClassVar[tuple[str, ...]] = (
        "transformer", "vae", "scheduler", "text_encoder", "tokenizer", "processor"
    )
    condition_image: ClassVar[str] = CONDITION_IMAGE_REQUIRED
    template_user_marker: ClassVar[str] = "<|vision_start|>"  # the user turn starts with the image

    # ---- loading ------------------------------------------------------------------------------------
    def load_pipeline(self, path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        if self.model_backend is not None:
            return super().load_pipeline(path, dtype, device)
        from diffusers import QwenImageEditPipeline

        check_components(path, self.required_components)
        processor = image_only_processor(path)
        pipe = QwenImageEditPipeline.from_pretrained(path, dtype=parse_dtype(dtype), processor=processor)
        pipe.to(device)
        self.configure_pipeline(pipe)
        return pipe

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
        raise MilesUserError(condition_image_mismatch(self.family, self.condition_image, False))

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
        """`prompt_embeds` [B, L, D] / `prompt_embeds_mask` [B, L] of the prompts read with the image (L =
        `prompt_pad_length` + the image's vision tokens), with true CFG the negative's, and `image_latents`."""
        from PIL import Image

        if image is None:
            raise MilesUserError(condition_image_mismatch(self.family, self.condition_image, False))
        self.latent_grid(shape)  # refuses sizes the 2×2 packing cannot tile
        if tuple(image.shape[:2]) != (shape.height, shape.width):  # the rollout sends it at the output size
            resized = Image.fromarray(image.numpy()).resize((shape.width, shape.height), resample=Image.LANCZOS)
            image = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
        picture = Image.fromarray(image.numpy())
        grid = pipe.processor.image_processor(images=[picture], return_tensors="pt")["image_grid_thw"][0]
        length = self.prompt_pad_length + int(grid.prod()) // pipe.processor.image_processor.merge_size**2

        def encode(batch: list[str]) -> dict[str, torch.Tensor]:
            embeds, mask = pipe.encode_prompt(prompt=batch, image=[picture] * len(batch))
            if embeds.shape[1] > length:
                raise MilesUserError(
                    f"a prompt of the {self.family} family is {embeds.shape[1]} tokens with its image and template, "
                    f"more than {length}; shorten it"
                )
            if mask is None:  # the pipeline drops an all-ones mask
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            return {"prompt_embeds": pad_right(embeds, length), "prompt_embeds_mask": pad_right(mask, length)}

        conditioning = encode_with_negative(encode, prompts, negative_prompt, self.uses_cfg(guidance),
                                            default_negative=" ")
        conditioning.update({key: value.expand(len(prompts), *value.shape[1:])
                             for key, value in self.encode_condition_image(pipe, image, shape).items()})
        return conditioning

    def encode_condition_image(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> dict[str, torch.Tensor]:
        """`image_latents` [1, N, 4C]: the pipeline's `image_processor.preprocess` and `_encode_vae_image`, packed."""
        vae = pipe.vae
        image = (pixels.float() / 255.0 * 2.0 - 1.0).permute(2, 0, 1)[None, :, None]  # [1, 3, 1, H, W]
        with torch.no_grad():
            latents = vae.encode(image.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(latents)
        std = torch.tensor(vae.config.latents_std).view(view).to(latents)
        return {IMAGE_LATENTS: pack_2x2_latents(((latents - mean) / std)[:, :, 0]).float()}

    # ---- the denoiser -------------------------------------------------------------------------------
    def with_condition_tokens(
        self, hidden_states: torch.Tensor, conditioning: Mapping[str, torch.Tensor], cfg: bool, shape: GenerationShape
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        if IMAGE_LATENTS not in conditioning:
            raise MilesUserError(f"family {self.family!r} needs the input image's latents in the conditioning "
                                 f"({IMAGE_LATENTS!r}); the engine encodes them from the prompt row's \"image\"")
        tokens = conditioning[IMAGE_LATENTS].to(hidden_states.dtype)
        if cfg:
            tokens = cfg_doubled(tokens)
        # the input image is encoded at the output size: the same token grid as the generated image
        latent_h, latent_w = self.latent_grid(shape)
        if tokens.shape[1] != (latent_h // 2) * (latent_w // 2):
            raise ValueError(f"{tokens.shape[1]} input-image tokens do not fit the output size {shape}")
        return torch.cat([hidden_states, tokens], dim=1), [(1, latent_h // 2, latent_w // 2)]

    # ---- SFT data -----------------------------------------------------------------------------------
    def encode_images(self, pipe: Any, pixels: torch.Tensor, shape: GenerationShape) -> torch.Tensor:
        raise MilesUserError(f"SFT (--loss-type sft_loss) is not supported for family {self.family!r}: SFT rows carry "
                             "no input image to edit")


def pad_right(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad [B, L, ...] to [B, length, ...] along the token axis."""
    pad = tensor.new_zeros(tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:])
    return torch.cat([tensor, pad], dim=1)
