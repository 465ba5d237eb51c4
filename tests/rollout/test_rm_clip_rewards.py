"""clipscore and aesthetic on a tiny random CLIP built offline: the formulas against a direct CLIP forward, video
frame means, the head file's checks, and the worker pool (in-process; Ray actors with --colocate-reward style
placement in the slow test)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from miles.config.sections import HookArgs
from miles.rollout.rm_hub import batched_async_rm
from miles.rollout.rm_hub.aesthetic import AestheticScorer, load_aesthetic_head
from miles.rollout.rm_hub.clipscore import ClipScoreScorer
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError

PROJECTION_DIM = 8


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> str:
    from miles.testing.tiny.clip import build_tiny_clip

    # seed 2: its cosines have both signs, so the clip at 0 is exercised
    return build_tiny_clip(str(tmp_path_factory.mktemp("tiny-clip")), projection_dim=PROJECTION_DIM, seed=2)


@pytest.fixture(scope="module")
def laion_style_head(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """The LAION predictor's layout (layers.0/2/4/6/7, dropouts between), narrowed to the tiny embedding."""
    generator = torch.Generator().manual_seed(1)
    widths = [PROJECTION_DIM, 12, 6, 4, 3, 1]
    names = ["layers.0", "layers.2", "layers.4", "layers.6", "layers.7"]
    tensors = {}
    for name, (fan_in, fan_out) in zip(names, zip(widths, widths[1:])):
        tensors[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=generator)
        tensors[f"{name}.bias"] = torch.randn(fan_out, generator=generator)
    path = tmp_path_factory.mktemp("head") / "aesthetic_head.safetensors"
    save_file(tensors, str(path))
    return str(path), tensors


def _args(**overrides) -> HookArgs:
    values = dict(rm_type=None, custom_rm_path=None, group_rm=False, reward_weights=None, reward_key=None,
                  clipscore_model_path=None, aesthetic_model_path=None, aesthetic_head_path=None,
                  clip_reward_num_workers=1, clip_reward_num_gpus_per_worker=1.0, clip_reward_batch_size=8,
                  pickscore_num_frames=None)
    values.update(overrides)
    return hook_args(**values)


def _image(seed: int, frames: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 40, 48, 3), generator=generator, dtype=torch.uint8)


def _reference_embeddings(folder: str, prompts: list[str], frames: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm text and image embeddings from a plain CLIPModel forward."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder), CLIPProcessor.from_pretrained(folder)
    inputs = processor(text=prompts, images=[Image.fromarray(f) for f in frames], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    return out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True), out.image_embeds / out.image_embeds.norm(
        dim=-1, keepdim=True)


def test_clipscore_is_100_times_the_cosine_clipped_at_zero(tiny_clip):
    prompts = ["a red apple", "a blue car", "a cat", "text", "a dog", "sunset", "moon", "sea"]
    frames = [_image(i)[0].numpy() for i in range(len(prompts))]
    text, image = _reference_embeddings(tiny_clip, prompts, frames)
    expected = (100 * (text * image).sum(-1)).clamp_min(0).tolist()
    scores = ClipScoreScorer(tiny_clip, device="cpu").score(prompts, frames)
    assert scores == pytest.approx(expected, abs=1e-4)
    assert any(value == 0.0 for value in scores) and any(value > 0 for value in scores)  # the clip at 0 is exercised


def test_clipscore_through_the_dispatcher_batches_and_averages_video_frames(tiny_clip):
    samples = [Sample(prompt=p, index=i, image=_image(i)) for i, p in enumerate(["a cat", "a dog", "a red apple"])]
    batched = asyncio.run(batched_async_rm(_args(rm_type="clipscore", clipscore_model_path=tiny_clip,
                                                 clip_reward_batch_size=2), samples))
    direct = ClipScoreScorer(tiny_clip, device="cpu").score([s.prompt for s in samples],
                                                            [s.image[0].numpy() for s in samples])
    assert batched == pytest.approx(direct, abs=1e-4)
    video = _image(9, frames=5)
    per_frame = ClipScoreScorer(tiny_clip, device="cpu").score(["a cat"] * 5, list(video.numpy()))
    args = _args(rm_type="clipscore", clipscore_model_path=tiny_clip, pickscore_num_frames=3)
    sampled = asyncio.run(batched_async_rm(args, [Sample(prompt="a cat", image=video)]))[0]
    assert sampled == pytest.approx(sum(per_frame[i] for i in (0, 2, 4)) / 3, abs=1e-4)


def test_aesthetic_applies_the_linear_chain_to_unit_image_embeddings(tiny_clip, laion_style_head):
    head_path, tensors = laion_style_head
    frames = [_image(i)[0].numpy() for i in range(3)]
    _, image = _reference_embeddings(tiny_clip, ["x"] * 3, frames)
    hidden = image
    for name in ["layers.0", "layers.2", "layers.4", "layers.6", "layers.7"]:
        hidden = hidden @ tensors[f"{name}.weight"].T + tensors[f"{name}.bias"]
    scores = AestheticScorer(tiny_clip, head_path, device="cpu").score(["ignored"] * 3, frames)
    assert scores == pytest.approx(hidden[:, 0].tolist(), abs=1e-4)
    args = _args(rm_type="aesthetic", aesthetic_model_path=tiny_clip, aesthetic_head_path=head_path)
    samples = [Sample(prompt="anything", index=i, image=torch.from_numpy(f)[None]) for i, f in enumerate(frames)]
    assert asyncio.run(batched_async_rm(args, samples)) == pytest.approx(scores, abs=1e-5)


def test_a_single_linear_head_loads(tmp_path):
    path = tmp_path / "linear.safetensors"
    save_file({"weight": torch.ones(1, 4), "bias": torch.zeros(1)}, str(path))
    [(weight, bias)] = load_aesthetic_head(str(path))
    assert weight.shape == (1, 4) and bias.shape == (1,)


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"head.0.weight": torch.ones(3, 4)}, "layer 0 needs both a weight and a bias"),
        ({"head.0.weight": torch.ones(3, 4), "head.0.bias": torch.ones(3), "head.1.weight": torch.ones(1, 2),
          "head.1.bias": torch.ones(1)}, "layer 1 takes 2 inputs but the layer before gives 3"),
        ({"weight": torch.ones(2, 4), "bias": torch.ones(2)}, "the last layer gives 2 outputs"),
        ({"proj": torch.ones(1, 4)}, "unexpected tensor 'proj'"),
    ],
)
def test_bad_heads_name_the_flag_and_the_problem(tmp_path, tensors, message):
    path = tmp_path / "head.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(MilesUserError, match=message) as info:
        load_aesthetic_head(str(path))
    assert "--aesthetic-head-path" in str(info.value)


def test_a_pickle_head_is_refused_and_a_head_for_another_clip_is_named(tmp_path, tiny_clip):
    pickled = tmp_path / "head.pth"
    torch.save({"weight": torch.ones(1, 768), "bias": torch.zeros(1)}, str(pickled))
    with pytest.raises(MilesUserError, match="cannot read it as safetensors"):
        load_aesthetic_head(str(pickled))
    wide = tmp_path / "wide.safetensors"
    save_file({"weight": torch.ones(1, 768), "bias": torch.zeros(1)}, str(wide))
    with pytest.raises(MilesUserError, match="takes 768-dim embeddings but --aesthetic-model-path"):
        AestheticScorer(tiny_clip, str(wide), device="cpu")


def test_missing_paths_are_user_errors(tmp_path):
    sample = Sample(prompt="a cat", image=_image(0))
    with pytest.raises(MilesUserError, match="needs --clipscore-model-path"):
        asyncio.run(batched_async_rm(_args(rm_type="clipscore"), [sample]))
    with pytest.raises(MilesUserError, match="needs --aesthetic-model-path"):
        asyncio.run(batched_async_rm(_args(rm_type="aesthetic"), [sample]))
    with pytest.raises(MilesUserError, match="--clipscore-model-path .*cannot load the CLIP processor"):
        asyncio.run(batched_async_rm(_args(rm_type="clipscore", clipscore_model_path=str(tmp_path)), [sample]))
