"""OCR reward: how well the image spells the quoted text of its prompt (docs/algorithms.md §10).

The PP-OCR detection and recognition models come with the `rapidocr` wheel and run on onnxruntime,
offline. `lang=en`, no angle classifier. With Ray initialised, `--ocr-num-workers` CPU actors share the
work; without Ray, one engine in this process.

Rules: target = the text between the first and second `"` of the prompt; recognised = all detected lines
with confidence > 0 concatenated in detection order; both normalised (spaces deleted, lowercased);
dist = 0 if target ⊂ recognised else Levenshtein(recognised, target), capped at len(target); an OCR
exception counts as dist = len(target); reward = 1 − dist / len(target). A video scores its middle frame.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Sequence

import numpy as np

from miles.config.sections import RewardConfig
from miles.rollout.rm_hub.builtin import frames_uint8
from miles.rollout.rm_hub.workers import gather_scores, restartable
from miles.types import Sample

logger = logging.getLogger(__name__)


def ocr_target(prompt: str) -> str | None:
    """The text between the first and second `"`, or None when the prompt has no quoted span."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def normalize_text(text: str) -> str:
    return "".join(ch for ch in text if not ch.isspace()).lower()


def levenshtein(a: str, b: str) -> int:
    from rapidfuzz.distance import Levenshtein

    return int(Levenshtein.distance(a, b))


def ocr_reward_from_text(prompt: str, recognised: str | None) -> float:
    """The §10 reward for one prompt given the recognised text (None = the OCR engine raised)."""
    target = ocr_target(prompt)
    target = normalize_text(target) if target is not None else ""
    if not target:
        logger.warning("OCR reward: prompt %r has no quoted target text; reward 0", prompt[:80])
        return 0.0
    if recognised is None:
        distance = len(target)
    else:
        text = normalize_text(recognised)
        distance = 0 if target in text else min(levenshtein(text, target), len(target))
    return 1.0 - distance / len(target)


class OcrReader:
    """One rapidocr engine (onnxruntime, CPU) reading RGB uint8 images."""

    def __init__(self, num_threads: int = 1):
        from rapidocr import RapidOCR

        self.engine = RapidOCR(
            params={
                "Global.use_cls": False,
                "Global.text_score": 0.0,  # keep every line with confidence > 0 (§10)
                "Global.log_level": "warning",
                "EngineConfig.onnxruntime.intra_op_num_threads": num_threads,
                "EngineConfig.onnxruntime.inter_op_num_threads": 1,
            }
        )
        self._lock = threading.Lock()

    def read(self, image: np.ndarray) -> str | None:
        """Concatenated recognised text ("" when nothing is detected), or None if the engine raised."""
        try:
            with self._lock:
                result = self.engine(np.ascontiguousarray(image))
        except Exception as err:  # a broken image must cost this sample its reward, not the whole rollout
            logger.warning("OCR engine failed (%s); reward counts the full distance", err)
            return None
        texts = result.txts or ()
        scores = result.scores or (1.0,) * len(texts)
        return "".join(text for text, score in zip(texts, scores) if score > 0)

    def read_many(self, images: Sequence[np.ndarray]) -> list[str | None]:
        return [self.read(image) for image in images]


class OcrPool:
    def __init__(self, reward_config: RewardConfig):
        import ray

        self.actors: list[Any] = []
        self.local: OcrReader | None = None
        if ray.is_initialized():
            num_workers = reward_config.ocr_num_workers
            actor_class = ray.remote(OcrReader)
            options = restartable(num_cpus=1, num_gpus=0)  # a killed worker comes back (workers.py)
            self.actors = [actor_class.options(**options).remote() for _ in range(num_workers)]
            logger.info("OCR: %d CPU Ray workers", num_workers)
        else:
            self.local = OcrReader()

    async def read(self, images: Sequence[np.ndarray]) -> list[str | None]:
        if self.actors:
            chunk = -(-len(images) // len(self.actors))
            refs = [
                actor.read_many.remote(list(images[i * chunk : (i + 1) * chunk]))
                for i, actor in enumerate(self.actors)
                if images[i * chunk : (i + 1) * chunk]
            ]
            results = await gather_scores("OCR", refs)
            return [text for part in results for text in part]
        return await asyncio.to_thread(self.local.read_many, list(images))

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


_POOLS: dict[tuple, OcrPool] = {}


def get_ocr_pool(reward_config: RewardConfig) -> OcrPool:
    import ray

    key = (reward_config.ocr_num_workers, ray.is_initialized())
    if key not in _POOLS:
        _POOLS[key] = OcrPool(reward_config)
    return _POOLS[key]


def shutdown_ocr_pools() -> None:
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()


async def ocr_rm(reward_config: RewardConfig, samples: Sequence[Sample]) -> list[float]:
    rewards: list[float | None] = [None] * len(samples)
    to_read: list[int] = []
    for position, sample in enumerate(samples):
        target = ocr_target(sample.prompt)
        if target is None or not normalize_text(target):
            rewards[position] = ocr_reward_from_text(sample.prompt, "")  # 0 with a warning
        else:
            to_read.append(position)
    if to_read:
        images = []
        for position in to_read:
            frames = frames_uint8(samples[position])
            images.append(frames[frames.shape[0] // 2])
        texts = await get_ocr_pool(reward_config).read(images)
        for position, text in zip(to_read, texts):
            rewards[position] = ocr_reward_from_text(samples[position].prompt, text)
    return rewards  # type: ignore[return-value]
