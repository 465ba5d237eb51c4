"""FLUX family on its tiny checkpoint: packed latents, distilled guidance, true CFG, parity with FluxPipeline."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.schedules import dynamic_shift_mu, flow_match_sigmas
from miles.diffusion.sde import DiffusersSdeStepBackend
from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.models.flux import pack_latents, unpack_latents
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def family():
    return get_family_class("flux")()


@pytest.fixture(scope="module")
def pipe(family, tiny_checkpoint):
    return family.load_pipeline(tiny_checkpoint("flux"), torch.float32)


def diffusers_output(pipe, guidance: GuidanceConfig, num_steps, output_type, shape=SHAPE):
    true_cfg = guidance.true_cfg_scale
    return pipe(
        prompt=PROMPTS,
        negative_prompt=" " if true_cfg else None,
        true_cfg_scale=true_cfg or 1.0,
        guidance_scale=guidance.guidance_scale,
        num_inference_steps=num_steps,
        height=shape.height,
        width=shape.width,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
    ).images


def ours(family, pipe, guidance, num_steps, decode=False, shape=SHAPE, **kwargs):
    return sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=shape, guidance=guidance,
        negative_prompt=" ", decode=decode, **kwargs,
    )


@pytest.mark.parametrize("true_cfg_scale", [None, 3.0])
def test_ode_loop_matches_diffusers_latents(family, pipe, true_cfg_scale):
    guidance = GuidanceConfig(guidance_scale=3.5, true_cfg_scale=true_cfg_scale)
    out = ours(family, pipe, guidance, 4)
    reference = diffusers_output(pipe, guidance, 4, "latent")
    assert out.latents.shape == (2, 16, 16)  # packed: 4×4 tokens of 4 channels × 2×2
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-7, rtol=0)


def test_non_square_parity_and_decode(family, pipe):
    shape = GenerationShape(height=32, width=48)
    guidance = GuidanceConfig(guidance_scale=3.5, true_cfg_scale=2.0)
    out = ours(family, pipe, guidance, 3, decode=True, shape=shape)
    reference = torch.from_numpy(diffusers_output(pipe, guidance, 3, "np", shape=shape))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 48, 3)
    assert (out.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_encode_prompt_negatives_only_with_true_cfg(family, pipe):
    plain = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=3.5))
    assert set(plain) == {"prompt_embeds", "pooled_prompt_embeds"}  # guidance_scale alone is not CFG
    assert plain["prompt_embeds"].shape == (2, family.max_sequence_length, 32)
    assert plain["pooled_prompt_embeds"].shape == (2, 16)
    cfg = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=3.5, true_cfg_scale=2.0))
    assert cfg["negative_prompt_embeds"].shape == plain["prompt_embeds"].shape
    assert cfg["negative_pooled_prompt_embeds"].shape == (2, 16)


def test_dit_receives_sigma_and_distilled_guidance(family, pipe):
    seen: list[dict] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({k: kwargs[k].clone() for k in ("timestep", "guidance")}),
        with_kwargs=True,
    )
    guidance = GuidanceConfig(guidance_scale=2.5, true_cfg_scale=2.0)
    try:
        out = ours(family, pipe, guidance, 3)
        ours_seen = seen[:]
        seen.clear()
        diffusers_output(pipe, guidance, 3, "latent")
    finally:
        hook.remove()
    assert len(ours_seen) == 3
    for k, inputs in enumerate(ours_seen):
        assert inputs["timestep"].shape == (4,)  # one doubled batch for both CFG branches
        torch.testing.assert_close(inputs["timestep"], torch.full((4,), float(out.sigmas[k])))
        torch.testing.assert_close(inputs["guidance"], torch.full((4,), 2.5))
        # diffusers calls the DiT twice per step (cond, then uncond) with the same time input
        torch.testing.assert_close(inputs["timestep"][:2], seen[2 * k]["timestep"], atol=0, rtol=0)
    assert float(ours_seen[0]["timestep"][0]) == 1.0
    torch.testing.assert_close(family.timesteps_from_sigmas(out.sigmas), out.sigmas)


def test_distilled_guidance_changes_velocity(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=3.5))
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    modules = {"transformer": pipe.transformer}
    with torch.no_grad():
        v1 = family.predict_velocity(modules, latents, torch.full((2,), 0.5), cond, GuidanceConfig(guidance_scale=1.0),
                                     SHAPE, torch.float32)
        v2 = family.predict_velocity(modules, latents, torch.full((2,), 0.5), cond, GuidanceConfig(guidance_scale=5.0),
                                     SHAPE, torch.float32)
    assert v1.dtype == torch.float32 and v1.shape == latents.shape
    assert not torch.allclose(v1, v2)


def test_sigmas_dynamic_shift_from_token_count(family, pipe):
    tokens = family.num_image_tokens(GenerationShape(64, 64))  # 16×16 latent -> 8×8 tokens
    assert tokens == 64
    mu = dynamic_shift_mu(tokens, 256, 4096, 0.5, 1.15)
    expected = flow_match_sigmas(6, mu=mu, sigmas=[1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    torch.testing.assert_close(family.sigmas(pipe, 6, GenerationShape(64, 64), None), expected)
    torch.testing.assert_close(
        family.sigmas(pipe, 6, GenerationShape(64, 64), 3.0),
        flow_match_sigmas(6, shift=3.0, sigmas=[1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    )


def test_pack_unpack_roundtrip_and_per_sample_noise(family, pipe):
    x = torch.randn(2, 4, 8, 12)
    assert torch.equal(unpack_latents(pack_latents(x), 8, 12), x)
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert torch.equal(batch[1], alone[0])


def test_sde_rollout_and_lora_targets_and_cp_plan(family, pipe):
    out = ours(family, pipe, GuidanceConfig(guidance_scale=3.5), 3, decode=True,
               sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and len(out.log_probs) == 3
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    plan = family.context_parallel_plan(pipe.transformer)
    assert plan is not None and plan is type(pipe.transformer)._cp_plan


def test_trainer_side_load_modules_knows_the_packing(tiny_checkpoint):
    fresh = get_family_class("flux")()
    modules = fresh.load_modules(tiny_checkpoint("flux"), ["transformer"], torch.float32)
    assert fresh.vae_scale_factor == 4 and fresh.num_image_tokens(SHAPE) == 16
    assert modules["transformer"].config.guidance_embeds


def test_too_small_size_is_a_user_error(family):
    with pytest.raises(MilesUserError, match="smaller than one FLUX latent patch"):
        family.latent_grid(GenerationShape(height=4, width=32))


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    shape = GenerationShape(height=32, width=48)  # non-square: the packed token order matters
    pixels = gradient_pixels(2, 1, shape.height, shape.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior_mean = vae.encode(vae_input(pixels, video=False)).latent_dist.mean
        expected_pixels = vae_output_to_uint8(vae.decode(posterior_mean).sample)
    scaled = (posterior_mean - vae.config.shift_factor) * vae.config.scaling_factor  # FluxImg2ImgPipeline
    batch, channels, height, width = scaled.shape
    expected = pipe._pack_latents(scaled, batch, channels, height, width)
    check_encode_images(family, pipe, shape, pixels, expected, expected_pixels)
    odd = 3 * pipe.vae_scale_factor  # an odd latent height: the 2×2 packing cannot tile it
    with pytest.raises(MilesUserError, match=f"must be multiples of {2 * pipe.vae_scale_factor}"):
        family.encode_images(pipe, gradient_pixels(1, 1, odd, 32), GenerationShape(height=odd, width=32))
