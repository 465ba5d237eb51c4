"""Cosmos 3 text-to-image family on its tiny checkpoint: load, encode (token ids), denoise, decode, and parity
with `Cosmos3OmniPipeline.__call__` (which generates one sample per call)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.diffusion.sde import DiffusersSdeStepBackend
from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=1)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
CFG = GuidanceConfig(guidance_scale=4.0)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("cosmos3")


def load(path, euler: bool):
    """The family and its pipeline; `euler` swaps in flow-match Euler so that diffusers' loop takes the same
    Euler steps as ours."""
    family = get_family_class("cosmos3")()
    pipe = family.load_pipeline(path, torch.float32)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return family, pipe


@pytest.fixture(scope="module")
def loaded(path):
    return load(path, euler=True)


def diffusers_one(pipe, b, guidance_scale, num_steps, output_type):
    return pipe(
        PROMPTS[b],
        negative_prompt=" ",
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=1,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=generators_from_seeds([SEEDS[b]])[0],
        output_type=output_type,
    ).video


def ours(family, pipe, guidance, num_steps, decode=False, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE,
                            guidance=guidance, negative_prompt=" ", decode=decode, **kwargs)


def test_encode_prompt_is_padded_token_ids_of_the_pipelines_templates(loaded):
    family, pipe = loaded
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=SHAPE)
    assert set(cond) == {"input_ids", "input_ids_length", "negative_input_ids", "negative_input_ids_length",
                         "encoded_shape"}
    assert cond["input_ids"].shape == (2, 1024) and cond["input_ids"].dtype == torch.long
    for b, prompt in enumerate(PROMPTS):
        expected, expected_negative = pipe.tokenize_prompt(prompt, " ", num_frames=1, height=32, width=32)
        assert cond["input_ids_length"][b] == len(expected)
        assert cond["input_ids"][b, : len(expected)].tolist() == expected
        assert cond["negative_input_ids"][b, : len(expected_negative)].tolist() == expected_negative
    text = pipe.text_tokenizer.decode(cond["input_ids"][0, : cond["input_ids_length"][0]])
    assert "This image is of 32x32 resolution." in text and text.endswith("<|vision_start|>")
    negative = pipe.text_tokenizer.decode(cond["negative_input_ids"][0, : cond["negative_input_ids_length"][0]])
    assert "This image is not of 32x32 resolution." in negative
    assert cond["encoded_shape"].tolist() == [[32, 32, 1], [32, 32, 1]]
    assert set(family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0), shape=SHAPE)) == {
        "input_ids", "input_ids_length", "encoded_shape"}


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_loop_matches_diffusers_per_sample(loaded, guidance_scale):
    family, pipe = loaded
    out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 3)
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 16, 1, 4, 4)
    for b in range(2):
        reference = diffusers_one(pipe, b, guidance_scale, 3, "latent")
        torch.testing.assert_close(out.latents[b], reference.reshape(out.latents[b].shape), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_decoded_images_match_diffusers(loaded):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 32, 3)
    for b in range(2):
        reference = torch.from_numpy(np.asarray(diffusers_one(pipe, b, 4.0, 2, "np")))  # [1, H, W, 3] in [0, 1]
        assert (out.images[b].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_timestep_convention_reaches_transformer_as_1000_sigma(loaded):
    family, pipe = loaded
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["vision_timesteps"].clone()), with_kwargs=True)
    try:
        out = ours(family, pipe, CFG, 2)
        ours_seen = seen[:]
        seen.clear()
        diffusers_one(pipe, 0, 4.0, 2, "latent")
    finally:
        hook.remove()
    # per step: (negative, positive) for sample 0, then for sample 1; one timestep per vision token (2x2 patches)
    assert len(ours_seen) == 8 and ours_seen[0].shape == (4,) and ours_seen[0].dtype == torch.float32
    assert torch.all(ours_seen[0] == 1000.0)
    torch.testing.assert_close(ours_seen[4], torch.full((4,), float(out.sigmas[1]) * 1000.0))
    # diffusers' calls for sample 0: (cond, uncond) per step, same timesteps
    torch.testing.assert_close(ours_seen[0], seen[0], atol=0, rtol=0)
    torch.testing.assert_close(ours_seen[5], seen[3], atol=0, rtol=0)


def test_shape_mismatch_and_missing_negatives_are_refused(loaded):
    family, pipe = loaded
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    modules = {"transformer": pipe.transformer}
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=SHAPE)
    with pytest.raises(ValueError, match="encoded for"):
        family.predict_velocity(modules, latents, torch.ones(2), cond, CFG, GenerationShape(64, 32, 1), torch.float32)
    no_cfg = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=1.0), shape=SHAPE)
    with pytest.raises(ValueError, match="negative_input_ids"):
        family.predict_velocity(modules, latents, torch.ones(2), no_cfg, CFG, SHAPE, torch.float32)
    with pytest.raises(MilesUserError, match="text-to-image only"):
        family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=GenerationShape(32, 32, 5))
    with pytest.raises(MilesUserError, match="the limit is 1024"):
        family.encode_prompt(pipe, ["x" * 1200], " ", CFG, shape=SHAPE)
    with pytest.raises(MilesUserError, match="multiples of 8"):
        family.prepare_latents(pipe, GenerationShape(36, 32, 1), generators_from_seeds([0]), torch.float32)


def test_sigmas_follow_the_checkpoints_unipc_grid_and_native_schedule(path):
    family, pipe = load(path, euler=False)
    pipe.scheduler.set_timesteps(8)
    sigmas = family.sigmas(pipe, 8, SHAPE, None)
    assert sigmas[0] == 1.0  # diffusers nudges it to 1 - 1e-6 for UniPC's log-SNR; Euler / SDE steps need exactly 1
    torch.testing.assert_close(sigmas[1:], pipe.scheduler.sigmas[1:].float(), atol=1e-7, rtol=0)
    pipe.register_to_config(use_native_flow_schedule=True)
    pipe.scheduler.set_timesteps(8, sigmas=np.linspace(1.0 - 1.0 / 1000, 0.0, 9)[:-1])
    native = family.sigmas(pipe, 8, SHAPE, None)
    torch.testing.assert_close(native, pipe.scheduler.sigmas.float(), atol=1e-7, rtol=0)
    assert native[0] < 0.9999


def test_prepare_latents_per_sample_lora_targets_and_no_cp_plan(loaded):
    family, pipe = loaded
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert batch.shape == (2, 16, 1, 4, 4) and torch.equal(batch[1], alone[0])
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith("self_attn." + target) for name in names), target
    assert family.context_parallel_plan(pipe.transformer) is None  # CP lives outside the model in diffusers


def test_sde_rollout_and_load_modules(loaded, path):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True,
               sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 32, 3)
    assert len(out.log_probs) == 2 and all(torch.isfinite(lp).all() for lp in out.log_probs)
    modules = get_family_class("cosmos3")().load_modules(path, ["transformer"], torch.float32)
    loaded_params = dict(modules["transformer"].named_parameters())
    for name, param in pipe.transformer.named_parameters():
        assert torch.equal(loaded_params[name], param), name


def test_encode_images_is_the_inverse_of_decode(loaded):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    family, pipe = loaded
    pixels = gradient_pixels(2, 1, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()  # [B, C, 1, h, w]
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample)
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(view)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view)
    check_encode_images(family, pipe, SHAPE, pixels, (posterior - mean) * inverse_std, expected_pixels)
