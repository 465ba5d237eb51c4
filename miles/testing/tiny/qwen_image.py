"""Tiny random-weight `QwenImagePipeline` (2-block MMDiT, tiny Qwen2.5-VL text encoder, tiny Qwen-Image VAE);
variant `edit`: the same components as a `QwenImageEditPipeline` with its Qwen2-VL processor.

VAE scale factor 4 with 4 latent channels (non-trivial latents_mean/std, so the decode normalisation is
exercised): a 32×32 image is an 8×8 latent packed into 16 tokens of 16 features. The tokenizer is a byte-level
Qwen2 BPE without merges, so the pipeline's fixed chat template is longer in tokens than with the real
tokenizer; the family computes `prompt_template_encode_start_idx` from the loaded tokenizer (34 for the real
one). The scheduler copies Qwen-Image's settings (dynamic exponential shift, `shift_terminal` 0.02).

The edit variant's `processor/` folder holds what a published one does for images: the tokenizer and a Qwen2-VL
image processor config (patch 14, merge 2, the text encoder's tiny vision tower reads its patches), and
model_index.json names a `Qwen2VLProcessor`. transformers builds that class only with torchvision (its video
processor), so the builder writes the folder itself and the `qwen_image_edit` family assembles the processor from
it without the video part (`miles/models/qwen_image_edit.py`).
"""

from __future__ import annotations

import json
import os

import torch

from miles.testing.tiny.tokenizers import build_qwen2_tokenizer


def tiny_qwen2_5_vl_text_encoder(tokenizer, hidden_size: int = 32):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    )}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
        **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


VARIANTS = ("qwen_image", "edit")


def build(out_dir: str, seed: int = 0, variant: str = "qwen_image") -> str:
    """Build and `save_pretrained` a tiny Qwen-Image pipeline of `variant` (see VARIANTS) into `out_dir`."""
    if variant not in VARIANTS:
        raise ValueError(f"no tiny qwen_image variant {variant!r}; one of {', '.join(VARIANTS)}")
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    torch.manual_seed(seed)
    tokenizer = build_qwen2_tokenizer()
    text_encoder = tiny_qwen2_5_vl_text_encoder(tokenizer, hidden_size=32)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels × a 2×2 patch
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # text encoder width
        axes_dims_rope=(2, 2, 4),  # sums to the head dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, False],  # scale factor 2^2 = 4
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        num_train_timesteps=1000,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    components = dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    if variant == "qwen_image":
        QwenImagePipeline(**components).save_pretrained(out_dir)
        return out_dir
    QwenImageEditPipeline(**components, processor=None).save_pretrained(out_dir)
    save_image_processor_folder(os.path.join(out_dir, "processor"), tokenizer)
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return out_dir


def save_image_processor_folder(folder: str, tokenizer) -> None:
    """The tokenizer and the Qwen2-VL image processor's config, as a published `processor/` folder holds them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(folder)
    config_path = os.path.join(folder, "preprocessor_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["image_processor_type"] = "Qwen2VLImageProcessor"  # the published name (its torchvision backend)
    config["processor_class"] = "Qwen2VLProcessor"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
