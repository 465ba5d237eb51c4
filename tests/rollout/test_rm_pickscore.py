"""PickScore with a tiny random CLIP built offline (docs/algorithms.md §10, invariant 20)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from miles.config.sections import HookArgs
from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.rm_hub.pickscore import PICKSCORE_SCALE, PickScoreScorer, pickscore_frame_indices
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> str:
    from miles.testing.tiny.clip import build_tiny_clip

    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny-clip")))


def _args(path: str, **overrides) -> HookArgs:
    values = dict(rm_type="pickscore", custom_rm_path=None, group_rm=False, pickscore_model_path=path,
                  pickscore_processor_path=path, pickscore_batch_size=8, pickscore_num_frames=None,
                  pickscore_num_workers=1, pickscore_num_gpus_per_worker=1.0)
    values.update(overrides)
    return hook_args(**values)


def _video(seed: int, frames: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 40, 48, 3), generator=generator, dtype=torch.uint8)


def test_frame_indices():
    assert pickscore_frame_indices(5, None) == [0, 1, 2, 3, 4]
    assert pickscore_frame_indices(3, 4) == [0, 1, 2]  # F <= k: all
    assert pickscore_frame_indices(9, 1) == [4]
    assert pickscore_frame_indices(1, 1) == [0]
    assert pickscore_frame_indices(9, 3) == [0, 4, 8]
    assert pickscore_frame_indices(10, 4) == [0, 3, 6, 9]
    assert pickscore_frame_indices(8, 3) == [0, 4, 7]  # round(3.5) = 4


def test_score_is_the_scaled_cosine_of_section_10(tiny_clip):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    scorer = PickScoreScorer(tiny_clip, tiny_clip, device="cpu")
    frame = _video(0, 1)[0].numpy()
    model, processor = CLIPModel.from_pretrained(tiny_clip), CLIPProcessor.from_pretrained(tiny_clip)
    with torch.no_grad():
        out = model(**processor(text=["a red apple"], images=[Image.fromarray(frame)], return_tensors="pt", padding=True))
    expected = out.logits_per_image[0, 0].item() / PICKSCORE_SCALE
    assert scorer.score(["a red apple"], [frame]) == [pytest.approx(expected, rel=1e-5)]


def test_batching_matches_one_by_one_and_video_averages_frames(tiny_clip):
    prompts = ["a red apple", "a blue car on a long road", "a cat", "text", "a dog", "sunset"]
    samples = [Sample(prompt=p, index=i, image=_video(i, 1)) for i, p in enumerate(prompts)]
    batched = asyncio.run(batched_async_rm(_args(tiny_clip, pickscore_batch_size=4), samples))
    one_by_one = [asyncio.run(batched_async_rm(_args(tiny_clip, pickscore_batch_size=1), [s]))[0] for s in samples]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert len(set(round(score, 6) for score in batched)) > 1  # scores depend on the pair

    video = _video(7, 5)
    frame_scores = [
        asyncio.run(batched_async_rm(_args(tiny_clip), [Sample(prompt="a cat", image=video[i : i + 1])]))[0]
        for i in range(5)
    ]
    whole = asyncio.run(batched_async_rm(_args(tiny_clip), [Sample(prompt="a cat", image=video)]))[0]
    assert whole == pytest.approx(np.mean(frame_scores), abs=1e-5)
    sampled = asyncio.run(batched_async_rm(_args(tiny_clip, pickscore_num_frames=3), [Sample(prompt="a cat", image=video)]))[0]
    assert sampled == pytest.approx(np.mean([frame_scores[i] for i in (0, 2, 4)]), abs=1e-5)


def test_missing_paths_are_user_errors(tiny_clip, tmp_path):
    sample = Sample(prompt="a cat", image=_video(0, 1))
    with pytest.raises(MilesUserError, match="needs --pickscore-model-path"):
        asyncio.run(batched_async_rm(_args(None), [sample]))
    with pytest.raises(MilesUserError, match="--pickscore-model-path"):
        asyncio.run(batched_async_rm(_args(str(tmp_path / "nowhere"), pickscore_processor_path=tiny_clip), [sample]))



def _rendered_word(word: str) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=40)
    image = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(image).text((16, 24), word, fill="black", font=font)
    return torch.from_numpy(np.array(image))[None]


@pytest.mark.slow
def test_ray_worker_pools_give_the_in_process_scores(tiny_clip):
    """PickScore and OCR actor pools in one Ray session; samples routed by metadata.rm_type."""
    ray = pytest.importorskip("ray")
    from miles.rollout.rm_hub import shutdown_reward_pools

    samples = [Sample(prompt=p, index=i, image=_video(i, 2)) for i, p in enumerate(["a cat", "a dog", "a red apple"])]
    local = asyncio.run(batched_async_rm(_args(tiny_clip), samples))
    samples.append(Sample(prompt='a sign saying "miles"', index=3, image=_rendered_word("miles"), metadata={"rm_type": "ocr"}))
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        # A fractional GPU request: on a GPU-less cluster the worker falls back to CPU. Batches of 2 over 6 frames.
        args = _args(tiny_clip, pickscore_num_workers=1, pickscore_num_gpus_per_worker=0.5, pickscore_batch_size=2,
                     ocr_num_workers=1)
        remote = asyncio.run(batched_async_rm(args, samples))
    finally:
        shutdown_reward_pools()
        ray.shutdown()
    assert remote[:3] == pytest.approx(local, abs=1e-5)
    assert remote[3] == 1.0


@pytest.mark.slow
def test_a_reward_worker_killed_mid_rollout_is_restarted_and_every_sample_scored(tiny_clip, monkeypatch):
    """SIGKILL of the PickScore worker while a rollout's batches wait on it: Ray restarts it and runs them again,
    so every sample gets its in-process score. With the restarts used up the rollout ends in one line."""
    import os
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    ray = pytest.importorskip("ray")
    from miles.rollout.rm_hub import shutdown_reward_pools, workers
    from miles.rollout.rm_hub.pickscore import get_pickscore_pool
    from miles.utils.errors import PartDiedError

    samples = [Sample(prompt=f"prompt {i}", index=i, group_index=i // 4, image=_video(i, 1)) for i in range(12)]
    local = asyncio.run(batched_async_rm(_args(tiny_clip), samples))
    args = _args(tiny_clip, pickscore_num_workers=1, pickscore_num_gpus_per_worker=0.0, pickscore_batch_size=2)

    def kill_worker_while_the_rollout_waits_on_it() -> tuple[list, int]:
        """Score on a worker kept busy by a slow call (so that every batch is queued on it), kill it, return
        (the rewards or the error, the worker's pid at the start)."""
        worker = get_pickscore_pool(args).actors[0]
        pid = ray.get(worker.__ray_call__.remote(lambda scorer: os.getpid()))
        worker.__ray_call__.remote(lambda scorer: time.sleep(1.0))  # the worker is busy: the batches queue
        with ThreadPoolExecutor(1) as executor:
            rollout = executor.submit(asyncio.run, batched_async_rm(args, samples))
            time.sleep(0.3)
            assert not rollout.done()
            os.kill(pid, signal.SIGKILL)
            try:
                return rollout.result(timeout=120), pid
            except PartDiedError as err:
                return err, pid

    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        rewards, first_pid = kill_worker_while_the_rollout_waits_on_it()
        assert rewards == pytest.approx(local, abs=1e-5)
        restarted = get_pickscore_pool(args).actors[0]
        assert ray.get(restarted.__ray_call__.remote(lambda scorer: os.getpid())) != first_pid
        shutdown_reward_pools()

        monkeypatch.setattr(workers, "MAX_RESTARTS", 0)
        error, _ = kill_worker_while_the_rollout_waits_on_it()
        assert isinstance(error, PartDiedError) and str(error) == (
            "a pickscore reward worker died more often than its 0 restarts allow (killed, out of memory, or crashed "
            "while scoring); the run is stopped")
    finally:
        shutdown_reward_pools()
        ray.shutdown()

