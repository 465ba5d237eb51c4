"""SFT data: JSONL rows, frames, center crop, VAE + text encoding with the tiny SD3, and the cache."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

import miles.rollout.sft_data as sft_data
from miles.rollout.sft_data import SftDataSource, SftRow, build_sft_dataset, build_sft_samples, center_crop, load_sft_rows, read_frames
from miles.testing.config import trainer_config
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError


def _with(config, **changes):
    """The same run's configuration with some flag values changed."""
    return config.replace(**changes)


def _save_image(path, height: int, width: int, seed: int) -> np.ndarray:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels


def _write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_resolve_relative_paths_and_name_bad_lines(tmp_path):
    (tmp_path / "media").mkdir()
    _save_image(tmp_path / "media" / "a.png", 8, 8, 0)
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"caption": "a", "image": "media/a.png"}])
    (row,) = load_sft_rows(data, "caption")
    assert row.media_path == str(tmp_path / "media" / "a.png") and row.media_kind == "image" and row.line == 1
    bad_rows = [
        ({"image": "media/a.png"}, "non-empty caption string under 'caption'"),
        ({"caption": "a"}, "exactly one of the keys"),
        ({"caption": "a", "image": "media/a.png", "video": "media"}, "exactly one of the keys"),
        ({"caption": "a", "image": "media/missing.png"}, "missing.png' does not exist"),
    ]
    for record, message in bad_rows:
        path = _write_jsonl(tmp_path / "bad.jsonl", [{"caption": "ok", "image": "media/a.png"}, record])
        with pytest.raises(MilesUserError, match=f"bad.jsonl:2: .*{message}"):
            load_sft_rows(path, "caption")
    (tmp_path / "broken.jsonl").write_text("{nope\n")
    with pytest.raises(MilesUserError, match="broken.jsonl:1: not valid JSON"):
        load_sft_rows(str(tmp_path / "broken.jsonl"), "caption")


def test_center_crop_and_frame_stride(tmp_path):
    wide = np.random.default_rng(0).integers(0, 256, size=(32, 64, 3), dtype=np.uint8)
    assert np.array_equal(center_crop(wide, 32, 32), wide[:, 16:48])  # no resize needed: the middle columns
    assert center_crop(wide, 16, 16).shape == (16, 16, 3)  # downscaled to cover, then cropped
    assert center_crop(wide[:8, :8], 16, 24).shape == (16, 24, 3)  # upscaled to cover
    folder = tmp_path / "clip"
    folder.mkdir()
    for i in range(6):
        Image.fromarray(np.full((16, 16, 3), i * 40, np.uint8)).save(folder / f"{i:03d}.png")
    row = SftRow(caption="c", media_path=str(folder), media_kind="video", line=1, raw="")
    frames = read_frames(row, 16, 16, frame_stride=2)
    assert frames.shape == (3, 16, 16, 3) and frames[:, 0, 0, 0].tolist() == [0, 80, 160]
    assert read_frames(row, 16, 16, frame_stride=1, num_frames=4).shape[0] == 4
    with pytest.raises(MilesUserError, match="has 3 frames after --sft-frame-stride 2"):
        read_frames(row, 16, 16, frame_stride=2, num_frames=5)
    gif = tmp_path / "clip.gif"
    images = [Image.fromarray(np.full((16, 16, 3), i * 40, np.uint8)) for i in range(4)]
    images[0].save(gif, save_all=True, append_images=images[1:])
    gif_row = SftRow(caption="c", media_path=str(gif), media_kind="video", line=1, raw="")
    assert read_frames(gif_row, 16, 16, frame_stride=3).shape[0] == 2
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(MilesUserError, match="cannot read image"):
        read_frames(SftRow("c", str(tmp_path / "bad.png"), "image", 1, ""), 16, 16)


def test_family_without_encode_images_is_a_clear_error(tmp_path):
    from miles.models.base import GenerationShape, TrainPipelineConfig

    class NoEncoder(TrainPipelineConfig):  # the interface's default encode_images
        family = "my_family"
        load_pipeline = load_modules = encode_prompt = sigmas = prepare_latents = predict_velocity = decode = None

    pixels = torch.zeros(1, 1, 8, 8, 3, dtype=torch.uint8)
    with pytest.raises(MilesUserError, match="not supported for family 'my_family': .* no encode_images"):
        NoEncoder().encode_images(None, pixels, GenerationShape(8, 8))
    _save_image(tmp_path / "a.png", 16, 16, 0)
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"input": "a", "image": "a.png"}])
    config = trainer_config(prompt_data=data, input_key="input", hf_checkpoint="unused", sft_encoder_checkpoint=None,
                            diffusion_height=16, diffusion_width=16, sft_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MilesUserError, match="not supported for family 'my_family'"):
        build_sft_samples(config.sft_data, family=NoEncoder(), pipe=object())


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint):
    from miles.models.common import build_train_pipeline_config
    from miles.rollout.sft_data import load_encoder_pipeline

    path = tiny_checkpoint("sd3")
    family = build_train_pipeline_config(path, diffusion_model_family="sd3")
    return path, family, load_encoder_pipeline(family, path, torch.float32, "cpu")


def test_sd3_encoding_and_cache(tmp_path, sd3, monkeypatch):
    path, family, pipe = sd3
    assert getattr(pipe, "transformer", None) is None  # encoders only
    originals = [_save_image(tmp_path / f"{i}.png", 40, 56, i) for i in range(3)]
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"input": f"caption {i}", "image": f"{i}.png"} for i in range(3)])
    config = trainer_config(prompt_data=data, input_key="input", hf_checkpoint=path, diffusion_model_family="sd3",
                            sft_encoder_checkpoint=None, diffusion_height=32, diffusion_width=32, sft_frame_stride=1,
                            diffusion_output_num_frames=1, sft_cache_dir=str(tmp_path / "cache"))
    samples = build_sft_samples(config.sft_data, family=family, pipe=pipe, batch_size=2)
    assert [s.prompt for s in samples] == ["caption 0", "caption 1", "caption 2"]
    assert [s.metadata["line"] for s in samples] == [1, 2, 3]
    assert samples[0].clean_latents.shape == (4, 8, 8)

    # x0 = (mean(VAE posterior) - shift) * scale of the center-cropped image (the inverse of the family's decode).
    cropped = torch.from_numpy(center_crop(originals[1], 32, 32)).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        posterior_mean = pipe.vae.encode(cropped).latent_dist.mean
    expected = (posterior_mean - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    torch.testing.assert_close(samples[1].clean_latents, expected[0], rtol=1e-5, atol=1e-5)
    conditioning = family.encode_prompt(pipe, ["caption 1"], None, GuidanceConfig(guidance_scale=1.0))
    assert set(samples[1].conditioning) == set(conditioning) == {"prompt_embeds", "pooled_prompt_embeds"}
    for key, value in conditioning.items():
        torch.testing.assert_close(samples[1].conditioning[key], value[0])

    # A second pass reads the cache; an edited image is re-encoded alone.
    encoded_batches = []
    real_encode = family.encode_images
    monkeypatch.setattr(family, "encode_images", lambda p, pixels, shape: encoded_batches.append(len(pixels)) or real_encode(p, pixels, shape))
    again = build_sft_samples(config.sft_data, family=family, pipe=pipe)
    assert encoded_batches == []
    for first, second in zip(samples, again):
        assert torch.equal(first.clean_latents, second.clean_latents)
    _save_image(tmp_path / "2.png", 40, 56, 99)
    os.utime(tmp_path / "2.png", (1, 1))  # a different modification time
    edited = build_sft_samples(config.sft_data, family=family, pipe=pipe)
    assert encoded_batches == [1]
    assert not torch.equal(edited[2].clean_latents, samples[2].clean_latents)
    assert torch.equal(edited[0].clean_latents, samples[0].clean_latents)

    # The run's entry point reads the complete cache without loading any model, then serves batches.
    monkeypatch.setattr(sft_data, "load_encoder_pipeline", lambda *a: pytest.fail("the cache was complete"))
    dataset = build_sft_dataset(_with(config, rollout_batch_size=2, n_samples_per_prompt=1))
    batch = dataset.next_batch(0)
    assert [s.index for s in batch] == [0, 1] and len(dataset.next_batch(1)) == 2
    by_prompt = {s.prompt: s for s in edited}
    for sample in batch:
        assert torch.equal(sample.clean_latents, by_prompt[sample.prompt].clean_latents)

    video_data = _write_jsonl(tmp_path / "video.jsonl", [{"input": "v", "video": str(tmp_path)}])
    with pytest.raises(MilesUserError, match="trains on images"):
        build_sft_samples(_with(config, prompt_data=video_data).sft_data, family=family, pipe=pipe)

    # A damaged cache entry is loaded with weights_only=True and named in one line.
    for cache_file in (tmp_path / "cache").rglob("*.pt"):  # every entry (the edited row left a stale one too)
        cache_file.write_bytes(cache_file.read_bytes()[:50])
    damaged = rf"SFT cache of {re.escape(data)}:1 .*: {re.escape(str(tmp_path / 'cache'))}/.*\.pt is truncated or corrupt"
    with pytest.raises(MilesUserError, match=damaged):
        build_sft_samples(config.sft_data, family=family, pipe=pipe)


def test_wan2_2_video_samples_build_from_a_gif(tmp_path, tiny_checkpoint):
    """A video family: GIF frames strided to --diffusion-output-num-frames, encoded to [C, F', h, w] latents."""
    from miles.models.base import GenerationShape
    from miles.models.common import build_train_pipeline_config
    from miles.rollout.sft_data import load_encoder_pipeline

    path = tiny_checkpoint("wan2_2")
    family = build_train_pipeline_config(path, diffusion_model_family="wan2_2")
    pipe = load_encoder_pipeline(family, path, torch.float32, "cpu")
    assert pipe.transformer is None and pipe.transformer_2 is None  # encoders only
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8)) for _ in range(10)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:])
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"input": "a clip", "video": "clip.gif"}])
    config = trainer_config(prompt_data=data, input_key="input", hf_checkpoint=path, diffusion_model_family="wan2_2",
                            sft_encoder_checkpoint=None, diffusion_height=32, diffusion_width=32, sft_frame_stride=2,
                            diffusion_output_num_frames=5, sft_cache_dir=str(tmp_path / "cache"))
    (sample,) = build_sft_samples(config.sft_data, family=family, pipe=pipe)
    shape = GenerationShape(height=32, width=32, num_frames=5)
    pixels = torch.from_numpy(read_frames(load_sft_rows(data)[0], 32, 32, frame_stride=2, num_frames=5))[None]
    expected = family.encode_images(pipe, pixels, shape)[0]
    assert sample.clean_latents.shape == (pipe.vae.config.z_dim, 2, 4, 4) == expected.shape
    torch.testing.assert_close(sample.clean_latents, expected)
    assert set(sample.conditioning) == {"prompt_embeds"}
    with pytest.raises(MilesUserError, match="has 10 frames after --sft-frame-stride 1; --diffusion-output-num-frames asks for 13"):
        build_sft_samples(_with(config, sft_frame_stride=1, diffusion_output_num_frames=13).sft_data, family=family,
                          pipe=pipe)


def test_cosmos3_video_samples_carry_the_fps_they_were_encoded_for(tmp_path, tiny_checkpoint):
    """Cosmos 3 writes a video's fps into its prompt: the encoding uses --diffusion-fps, and the cache key holds it."""
    from miles.models.base import GenerationShape
    from miles.models.common import build_train_pipeline_config
    from miles.rollout.sft_data import load_encoder_pipeline, sft_cache_folder

    path = tiny_checkpoint("cosmos3")
    family = build_train_pipeline_config(path, diffusion_model_family="cosmos3")
    pipe = load_encoder_pipeline(family, path, torch.float32, "cpu")
    assert pipe.transformer is None  # encoders only: the tokenizer and the VAE
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, size=(64, 40, 3), dtype=np.uint8)) for _ in range(10)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:])
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"input": "a clip", "video": "clip.gif"}])
    config = trainer_config(prompt_data=data, input_key="input", hf_checkpoint=path, diffusion_model_family="cosmos3",
                            sft_encoder_checkpoint=None, diffusion_height=64, diffusion_width=32, sft_frame_stride=2,
                            diffusion_output_num_frames=5, diffusion_fps=16.0, sft_cache_dir=str(tmp_path / "cache"))
    (sample,) = build_sft_samples(config.sft_data, family=family, pipe=pipe)
    shape = GenerationShape(height=64, width=32, num_frames=5, fps=16.0)
    pixels = torch.from_numpy(read_frames(load_sft_rows(data)[0], 64, 32, frame_stride=2, num_frames=5))[None]
    torch.testing.assert_close(sample.clean_latents, family.encode_images(pipe, pixels, shape)[0])
    assert sample.clean_latents.shape == (48, 2, 4, 2)
    assert sample.conditioning["encoded_shape"].tolist() == [64, 32, 5, 16000]
    expected_ids = pipe.tokenize_prompt("a clip", None, num_frames=5, height=64, width=32, fps=16.0)[0]
    assert sample.conditioning["input_ids"][: len(expected_ids)].tolist() == expected_ids
    at_24 = _with(config, diffusion_fps=None).sft_data
    assert sft_cache_folder(at_24, data, "cosmos3", path) != sft_cache_folder(config.sft_data, data, "cosmos3", path)
    (sample_24,) = build_sft_samples(at_24, family=family, pipe=pipe)
    assert sample_24.conditioning["encoded_shape"].tolist() == [64, 32, 5, 24000]


def test_sft_data_source_epochs_and_resume():
    from miles.types import Sample

    samples = [Sample(prompt=f"c{i}", index=i) for i in range(5)]
    config = trainer_config(rollout_seed=3, rollout_batch_size=1)
    source = SftDataSource(config.sft_data, samples)
    order = [s.index for _ in range(4) for s in source.get_samples(3)]  # 12 = 2 epochs + 2
    assert sorted(order[:5]) == sorted(order[5:10]) == [0, 1, 2, 3, 4] and order[:5] != order[5:10]
    first = SftDataSource(config.sft_data, samples)
    first.get_samples(7)
    resumed = SftDataSource(config.sft_data, samples)
    resumed.load_state_dict(first.state_dict())
    assert [s.index for s in resumed.get_samples(5)] == order[7:12]
    with pytest.raises(MilesUserError, match="no samples"):
        SftDataSource(config.sft_data, [])
