"""A tiny random CLIP (model + processor) saved to a folder, for the CLIP-based rewards' offline tests."""

from __future__ import annotations

import torch


def build_tiny_clip(folder: str, projection_dim: int = 8, seed: int = 0) -> str:
    """Save a CLIPModel with random weights (16-wide towers, 32x32 images) and its processor into `folder`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from miles.testing.tiny.tokenizers import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=projection_dim,
        logit_scale_init_value=4.6,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder
