"""Aesthetic reward: a head on CLIP image embeddings, in the style of the LAION aesthetic predictor.

`score = head(i / ‖i‖)` for the CLIP image embedding i of the frame (the prompt plays no part). The head is a chain
of linear layers applied in order with no activation between them, which is what the LAION predictor is (its
MLP 768 → 1024 → 128 → 64 → 16 → 1 has only dropouts between the layers, a no-op at inference; the older
linear predictor is a single 768 → 1 layer). Its score is on the predictor's ≈1–10 scale. A video scores the
frames chosen by `pickscore_frame_indices` with `--pickscore-num-frames` and its reward is their mean.

Files: `--aesthetic-model-path` a CLIP folder (model + processor; the LAION heads were trained on
openai/clip-vit-large-patch14), `--aesthetic-head-path` a safetensors file of the head, read with safetensors
(never pickle). Its tensors are either `weight` [1, D] and `bias` [1] (one linear layer) or `<prefix>.<n>.weight`
and `<prefix>.<n>.bias` for each layer n (e.g. LAION's `layers.0`, `layers.2`, `layers.4`, `layers.6`,
`layers.7`), applied in increasing n. docs/rewards.md shows how to convert LAION's .pth once.
"""

from __future__ import annotations

import re
import threading
from typing import Sequence

import numpy as np
import torch

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.clip_models import (
    default_device,
    image_embeddings,
    load_clip_model,
    load_clip_processor,
    mean_over_frames,
)
from miles.rollout.rm_hub.clipscore import clip_reward_workers
from miles.rollout.rm_hub.workers import ScorerPool, get_scorer_pool
from miles.types import Sample
from miles.utils.errors import MilesUserError

_LAYER_KEY = re.compile(r"^(?:(?P<prefix>.*)\.)?(?P<index>\d+)\.(?P<kind>weight|bias)$")


def load_aesthetic_head(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The head's (weight [out, in], bias [out]) layers in order, checked to chain down to one output."""
    from safetensors.torch import load_file

    flag = f"--aesthetic-head-path {path!r}"
    try:
        tensors = load_file(path)
    except Exception as err:  # a missing or non-safetensors file must name the flag
        raise MilesUserError(f"{flag}: cannot read it as safetensors: {err}") from err
    if set(tensors) == {"weight", "bias"}:
        layers = [(tensors["weight"], tensors["bias"])]
    else:
        by_index: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _LAYER_KEY.match(key)
            if match is None:
                raise MilesUserError(f"{flag}: unexpected tensor {key!r}; expected 'weight'/'bias' or "
                                     "'<prefix>.<n>.weight'/'<prefix>.<n>.bias' per layer")
            by_index.setdefault(int(match["index"]), {})[match["kind"]] = tensor
        layers = []
        for index in sorted(by_index):
            parts = by_index[index]
            if set(parts) != {"weight", "bias"}:
                raise MilesUserError(f"{flag}: layer {index} needs both a weight and a bias, has {sorted(parts)}")
            layers.append((parts["weight"], parts["bias"]))
    if not layers:
        raise MilesUserError(f"{flag}: the file holds no layers")
    for position, (weight, bias) in enumerate(layers):
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise MilesUserError(f"{flag}: layer {position} has weight {list(weight.shape)} and bias "
                                 f"{list(bias.shape)}; expected [out, in] and [out]")
        if position and weight.shape[1] != layers[position - 1][0].shape[0]:
            raise MilesUserError(f"{flag}: layer {position} takes {weight.shape[1]} inputs but the layer before "
                                 f"gives {layers[position - 1][0].shape[0]}")
    if layers[-1][0].shape[0] != 1:
        raise MilesUserError(f"{flag}: the last layer gives {layers[-1][0].shape[0]} outputs; a score needs 1")
    return [(weight.float(), bias.float()) for weight, bias in layers]


class AestheticScorer:
    """CLIP image tower + the head, scoring RGB uint8 frames."""

    def __init__(self, model_path: str, head_path: str, device: str | None = None):
        self.device = default_device(device)
        self.processor = load_clip_processor(model_path, "--aesthetic-model-path")
        self.model = load_clip_model(model_path, "--aesthetic-model-path", self.device)
        self.layers = [(w.to(self.device), b.to(self.device)) for w, b in load_aesthetic_head(head_path)]
        embed_dim = int(self.model.config.projection_dim)
        if self.layers[0][0].shape[1] != embed_dim:
            raise MilesUserError(
                f"--aesthetic-head-path {head_path!r} takes {self.layers[0][0].shape[1]}-dim embeddings but "
                f"--aesthetic-model-path {model_path!r} gives {embed_dim}-dim ones: the head belongs to another CLIP"
            )
        self._lock = threading.Lock()  # one forward at a time when called from several threads

    @torch.no_grad()
    def score(self, prompts: Sequence[str], frames: Sequence[np.ndarray]) -> list[float]:
        """One score per frame; `prompts` is accepted for the shared pair interface and not used."""
        with self._lock:
            hidden = image_embeddings(self.model, self.processor, frames, self.device)
            for weight, bias in self.layers:
                hidden = torch.nn.functional.linear(hidden, weight, bias)
        return hidden[:, 0].cpu().tolist()


def get_aesthetic_pool(reward_config: RewardConfig) -> ScorerPool:
    model_path = reward_config.aesthetic_model_path
    head_path = reward_config.aesthetic_head_path
    if not model_path or not head_path:
        raise MilesUserError("--rm-type aesthetic needs --aesthetic-model-path (a CLIP folder) and "
                             "--aesthetic-head-path (the head as safetensors)")
    return get_scorer_pool("aesthetic", AestheticScorer, (model_path, head_path),
                           *clip_reward_workers(reward_config))


async def aesthetic_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    pool = get_aesthetic_pool(reward_config)
    return await mean_over_frames(samples, reward_config.pickscore_num_frames, pool.score)
