"""The shapes base model: the shipped folder is the architecture `model.py` builds, and pretraining repeats
bit for bit."""

from __future__ import annotations

import json
import os
import signal

import torch
from safetensors.torch import load_file

from miles.tasks.shapes import PRETRAINED_SD3
from miles.tasks.shapes.evaluate import load_pipeline
from miles.tasks.shapes.model import (LARGE, SMALL, TEXT_LENGTH, WIDE, build_clip_tokenizer, build_t5_tokenizer,
                                      build_untrained_pipeline, prompt_words)
from miles.tasks.shapes.pretrain import (DenoiserSchedule, encode_latents, pretrain, render_dataset, train_denoiser,
                                        vae_roundtrip_score)
from miles.tasks.shapes.score import score_scene
from miles.tasks.shapes.spec import split_scenes


def test_every_prompt_word_is_one_token():
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    for word in prompt_words():
        assert clip.tokenize(word) == [word + "</w>"]
        assert t5.tokenize(word) == ["▁" + word]
    assert clip.model_max_length == t5.model_max_length == TEXT_LENGTH


def test_the_shipped_model_is_safetensors_of_the_wide_architecture():
    files = [os.path.join(root, name) for root, _, names in os.walk(PRETRAINED_SD3) for name in names]
    weights = [f for f in files if not f.endswith((".json", ".txt"))]
    assert weights and all(f.endswith(".safetensors") for f in weights), weights
    config = json.load(open(os.path.join(PRETRAINED_SD3, "transformer", "config.json")))
    assert (config["num_layers"], config["num_attention_heads"]) == (WIDE.num_layers, WIDE.num_heads)
    assert config["sample_size"] * 2 == WIDE.image_size
    assert sum(os.path.getsize(f) for f in files) < 8 * 2**20


def test_pretraining_is_deterministic(tmp_path):
    """A snapshot after N denoiser steps of one run has the same bits as another run with `--dit-steps N` (so
    runs repeat, and a snapshot is what a plain run of that length saves); with the text encoders trained
    too, the path with more state."""
    longer, shorter = str(tmp_path / "a"), str(tmp_path / "b")
    pretrain(longer, images_per_scene=1, vae_steps=2, schedule=DenoiserSchedule(steps=3), batch_size=4,
             snapshot_steps=(2,), train_text=True)
    pretrain(shorter, images_per_scene=1, vae_steps=2, schedule=DenoiserSchedule(steps=2), batch_size=4,
             train_text=True)
    for component, name in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                            ("text_encoder", "model"), ("text_encoder_3", "model")):
        a = load_file(os.path.join(longer + "-step2", component, f"{name}.safetensors"))
        b = load_file(os.path.join(shorter, component, f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), component
    final = load_file(os.path.join(longer, "transformer", "diffusion_pytorch_model.safetensors"))
    step2 = load_file(os.path.join(shorter, "transformer", "diffusion_pytorch_model.safetensors"))
    assert not all(torch.equal(final[k], step2[k]) for k in final)  # the third step changed it
    t5_final = load_file(os.path.join(longer, "text_encoder_3", "model.safetensors"))
    t5_step2 = load_file(os.path.join(shorter, "text_encoder_3", "model.safetensors"))
    assert not all(torch.equal(t5_final[k], t5_step2[k]) for k in t5_final)  # the text side trains too
    vae = json.load(open(os.path.join(longer, "vae", "config.json")))
    assert vae["scaling_factor"] != 1.0 and vae["shift_factor"] != 0.0  # set from the latents' statistics


def test_about_the_stray_fraction_of_the_pretraining_images_carry_a_stray():
    train, _ = split_scenes(seed=0)
    pixels, prompts = render_dataset(32, 1, seed=0, stray_fraction=0.5)
    images = ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    scores = [score_scene(scene, image) for scene, image in zip(train, images)]
    assert prompts == [scene.prompt() for scene in train]
    assert all(s.correct_but_strays == 1.0 for s in scores)  # the requested objects are all there
    assert 0.42 <= sum(s.strays == 1 for s in scores) / len(scores) <= 0.55
    clean, _ = render_dataset(32, 1, seed=0)
    assert all(score_scene(scene, image).correct == 1.0 for scene, image in
               zip(train, ((clean + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()))


def test_the_denoiser_schedule_warms_up_decays_and_stops_on_time():
    constant = DenoiserSchedule(steps=100, lr=1e-3)
    assert constant.rate(constant.progress(50, 0.0)) == 1e-3
    cosine = DenoiserSchedule(steps=100, lr=1e-3, shape="cosine", warmup=0.1, max_seconds=10.0)
    assert cosine.rate(0.05) == 0.5e-3  # halfway through the warm-up
    assert cosine.rate(0.1) == 1e-3 and abs(cosine.rate(0.55) - 0.5e-3) < 1e-12 and cosine.rate(1.0) < 1e-18
    assert cosine.progress(10, 0.0) == 0.1 and cosine.progress(10, 5.0) == 0.5  # the later of steps and time
    assert cosine.progress(10, 12.0) == 1.0  # time is up: training stops


def test_rendering_in_worker_processes_gives_the_same_images():
    one, prompts = render_dataset(32, 1, seed=3, stray_fraction=0.5)
    two, prompts_two = render_dataset(32, 1, seed=3, stray_fraction=0.5, workers=2)
    assert prompts == prompts_two and torch.equal(one, two)


def test_the_large_size_draws_128_px_through_an_8x_vae_onto_the_wide_sizes_latent_grid():
    pipe = build_untrained_pipeline(LARGE)
    assert (LARGE.image_size, pipe.vae_scale_factor) == (128, 8)
    assert pipe.transformer.config.sample_size == LARGE.image_size // LARGE.vae_scale_factor == 16
    latents = pipe.vae.encode(torch.zeros(1, 3, 128, 128)).latent_dist.mean
    assert latents.shape == (1, 4, 16, 16)


def test_the_shipped_vae_reconstructs_renders_the_scorer_accepts_and_a_random_one_does_not():
    _, pipe = load_pipeline(PRETRAINED_SD3)
    assert vae_roundtrip_score(pipe.vae, WIDE.image_size, count=32) >= 0.95
    assert vae_roundtrip_score(build_untrained_pipeline(WIDE).vae, WIDE.image_size, count=32) <= 0.1


def test_a_sigterm_while_the_denoiser_trains_stops_it_with_what_it_learned():
    """A caller's timeout ends the denoiser after its step, which then hands back the EMA weights so far (that
    `pretrain` saves): bit for bit what a run of that many steps gives. The handler is gone afterwards."""
    pixels, prompts = render_dataset(SMALL.image_size, 1, seed=0, stray_fraction=0.0)

    def trained(steps: int, snapshot=None) -> dict[str, torch.Tensor]:
        pipe = build_untrained_pipeline(SMALL, seed=0)
        latents = encode_latents(pipe.vae, pixels)
        train_denoiser(pipe, latents, prompts, DenoiserSchedule(steps=steps), batch_size=4,
                       generator=torch.Generator().manual_seed(0), snapshot=snapshot, snapshot_steps=(2,))
        return {k: v.clone() for k, v in pipe.transformer.state_dict().items()}

    handler = signal.getsignal(signal.SIGTERM)
    cut = trained(50, snapshot=lambda step: os.kill(os.getpid(), signal.SIGTERM))  # after its second step
    whole = trained(2)
    assert cut.keys() == whole.keys() and all(torch.equal(cut[k], whole[k]) for k in cut)
    assert signal.getsignal(signal.SIGTERM) is handler
