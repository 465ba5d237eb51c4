"""What the CLIP-based rewards (pickscore, clipscore, aesthetic) share: loading a CLIP folder, unit-norm
embeddings, and scoring a video as the mean over the frames `pickscore_frame_indices` selects."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import numpy as np
import torch

from miles.rollout.rm_hub.builtin import frames_uint8
from miles.types import Sample
from miles.utils.errors import MilesUserError

TEXT_MAX_LENGTH = 77


def frame_indices(num_frames: int, num_sampled: int | None) -> list[int]:
    """Which frames of an F-frame video are scored (docs/algorithms.md §10): all if k is unset or F ≤ k;
    [⌊F/2⌋] if k = 1; else round(i·(F−1)/(k−1)) for i = 0..k−1."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if num_sampled is None or num_frames <= num_sampled:
        return list(range(num_frames))
    if num_sampled < 1:
        raise MilesUserError(f"--pickscore-num-frames must be >= 1, got {num_sampled}")
    if num_sampled == 1:
        return [num_frames // 2]
    return [int(round(i * (num_frames - 1) / (num_sampled - 1))) for i in range(num_sampled)]


def projected(features: Any) -> torch.Tensor:
    """transformers 4 returns the projected embedding; transformers 5 an output whose pooler_output holds it."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def unit(embeds: torch.Tensor) -> torch.Tensor:
    embeds = embeds.float()
    return embeds / embeds.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def default_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_clip_processor(path: str, flag: str):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as err:  # a wrong folder must name the flag, not end in a transformers traceback
        raise MilesUserError(f"{flag} {path!r}: cannot load the CLIP processor: {err}") from err


def load_clip_model(path: str, flag: str, device: torch.device):
    from transformers import AutoModel

    try:
        return AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
    except Exception as err:  # as above
        raise MilesUserError(f"{flag} {path!r}: cannot load the CLIP model: {err}") from err


def image_embeddings(model, processor, frames: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """Unit-norm CLIP image embeddings of RGB uint8 frames, with the processor's own preprocessing."""
    from PIL import Image

    inputs = processor(images=[Image.fromarray(frame) for frame in frames], return_tensors="pt")
    return unit(projected(model.get_image_features(pixel_values=inputs["pixel_values"].to(device))))


def text_embeddings(model, processor, prompts: Sequence[str], device: torch.device) -> torch.Tensor:
    """Unit-norm CLIP text embeddings (padded, truncated to 77 tokens)."""
    inputs = processor(text=list(prompts), padding=True, truncation=True, max_length=TEXT_MAX_LENGTH,
                       return_tensors="pt")
    return unit(projected(model.get_text_features(input_ids=inputs["input_ids"].to(device),
                                                  attention_mask=inputs["attention_mask"].to(device))))


async def mean_over_frames(
    samples: Sequence[Sample],
    num_sampled: int | None,
    score_pairs: Callable[[list[str], list[np.ndarray]], Awaitable[list[float]]],
) -> list[float]:
    """Score every (prompt, selected frame) pair in one call and return each sample's mean."""
    prompts: list[str] = []
    frames: list[np.ndarray] = []
    owners: list[int] = []
    for position, sample in enumerate(samples):
        video = frames_uint8(sample)
        for frame_index in frame_indices(video.shape[0], num_sampled):
            prompts.append(sample.prompt)
            frames.append(video[frame_index])
            owners.append(position)
    scores = await score_pairs(prompts, frames)
    totals = [0.0] * len(samples)
    counts = [0] * len(samples)
    for owner, score in zip(owners, scores):
        totals[owner] += float(score)
        counts[owner] += 1
    return [total / count for total, count in zip(totals, counts)]
