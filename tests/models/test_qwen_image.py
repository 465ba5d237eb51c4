"""Qwen-Image family on its tiny checkpoint: true CFG with renormalisation, σ time input, parity with diffusers."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.sde import DiffusersSdeStepBackend
from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def family():
    return get_family_class("qwen_image")()


@pytest.fixture(scope="module")
def pipe(family, tiny_checkpoint):
    return family.load_pipeline(tiny_checkpoint("qwen_image"), torch.float32)


def diffusers_output(pipe, cfg_scale, num_steps, output_type, prompts=PROMPTS, shape=SHAPE):
    return pipe(
        prompt=prompts,
        negative_prompt=" " if cfg_scale > 1 else None,
        true_cfg_scale=cfg_scale,
        num_inference_steps=num_steps,
        height=shape.height,
        width=shape.width,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
    ).images


def ours(family, pipe, guidance, num_steps, prompts=PROMPTS, decode=False, shape=SHAPE, **kwargs):
    return sample_reference(
        family, pipe, prompts, seeds=SEEDS, num_steps=num_steps, shape=shape, guidance=guidance,
        negative_prompt=" ", decode=decode, **kwargs,
    )


@pytest.mark.parametrize(
    "guidance, prompts",
    [
        (GuidanceConfig(guidance_scale=4.0), PROMPTS),  # prompts of different lengths: the pipeline masks
        (GuidanceConfig(guidance_scale=1.0, true_cfg_scale=3.0), ["a cat", "a dog"]),  # equal: no mask there
        (GuidanceConfig(guidance_scale=1.0), PROMPTS),  # CFG off
    ],
)
def test_ode_loop_matches_diffusers_latents(family, pipe, guidance, prompts):
    out = ours(family, pipe, guidance, 4, prompts=prompts)
    reference = diffusers_output(pipe, guidance.scale, 4, "latent", prompts=prompts)
    assert out.latents.shape == (2, 16, 16)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    # dynamic shift then shift_terminal: the last non-zero sigma is 0.02
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-7, rtol=0)
    assert abs(float(out.sigmas[-2]) - 0.02) < 1e-6


def test_decoded_pixels_match_diffusers(family, pipe):
    out = ours(family, pipe, GuidanceConfig(guidance_scale=4.0), 3, decode=True)
    reference = torch.from_numpy(diffusers_output(pipe, 4.0, 3, "np"))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 32, 3)
    assert (out.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_dit_receives_sigma_not_1000_sigma(family, pipe):
    seen: list[dict] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True
    )
    try:
        out = ours(family, pipe, GuidanceConfig(guidance_scale=4.0), 3)
    finally:
        hook.remove()
    assert len(seen) == 3
    for k, inputs in enumerate(seen):
        torch.testing.assert_close(inputs["timestep"], torch.full((4,), float(out.sigmas[k])))
        assert inputs["img_shapes"] == [[(1, 4, 4)]] * 4
        assert inputs["encoder_hidden_states_mask"].shape == (4, family.prompt_pad_length)
    assert float(seen[0]["timestep"][0]) == 1.0
    torch.testing.assert_close(family.timesteps_from_sigmas(out.sigmas), out.sigmas)


def test_true_cfg_renormalises_each_token_to_the_positive_norm(family, pipe):
    guidance = GuidanceConfig(guidance_scale=1.0, true_cfg_scale=5.0)
    cond = family.encode_prompt(pipe, PROMPTS, " ", guidance)
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    modules = {"transformer": pipe.transformer}
    sigmas = torch.full((2,), 0.6)
    with torch.no_grad():
        v_cfg = family.predict_velocity(modules, latents, sigmas, cond, guidance, SHAPE, torch.float32)
        v_pos = family.predict_velocity(modules, latents, sigmas, cond, GuidanceConfig(guidance_scale=1.0), SHAPE,
                                        torch.float32)
    assert v_cfg.dtype == torch.float32
    torch.testing.assert_close(v_cfg.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_cfg, v_pos, atol=1e-3)


def test_prompt_padding_is_fixed_and_does_not_change_the_velocity(family, pipe):
    guidance = GuidanceConfig(guidance_scale=4.0)
    cond = family.encode_prompt(pipe, PROMPTS, " ", guidance)
    assert cond["prompt_embeds"].shape == (2, family.prompt_pad_length, 32)
    assert cond["prompt_embeds_mask"].dtype == torch.long
    # the mask counts the prompt's tokens after the dropped template prefix
    template = pipe.prompt_template_encode
    expected = [len(pipe.tokenizer(template.format(p)).input_ids) - pipe.prompt_template_encode_start_idx
                for p in PROMPTS]
    assert cond["prompt_embeds_mask"].sum(dim=1).tolist() == expected
    assert pipe.prompt_template_encode_start_idx == len(pipe.tokenizer(template.split("{}")[0]).input_ids)

    short = get_family_class("qwen_image")()
    short.prompt_pad_length = 64
    short.vae_scale_factor = family.vae_scale_factor
    short_cond = short.encode_prompt(pipe, PROMPTS, " ", guidance)
    assert short_cond["prompt_embeds"].shape[1] == 64
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    modules = {"transformer": pipe.transformer}
    with torch.no_grad():
        v_long = family.predict_velocity(modules, latents, torch.full((2,), 0.7), cond, guidance, SHAPE, torch.float32)
        v_short = short.predict_velocity(modules, latents, torch.full((2,), 0.7), short_cond, guidance, SHAPE,
                                         torch.float32)
    torch.testing.assert_close(v_long, v_short, atol=1e-5, rtol=1e-5)


def test_sde_rollout_lora_targets_and_cp_plan(family, pipe):
    out = ours(family, pipe, GuidanceConfig(guidance_scale=4.0), 3, decode=True,
               sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and len(out.log_probs) == 3
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    assert family.context_parallel_plan(pipe.transformer) is type(pipe.transformer)._cp_plan is not None


def test_per_sample_noise_and_trainer_side_loading(family, pipe, tiny_checkpoint):
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert torch.equal(batch[1], alone[0])
    fresh = get_family_class("qwen_image")()
    fresh.load_modules(tiny_checkpoint("qwen_image"), ["transformer"], torch.float32)
    assert fresh.vae_scale_factor == 4 and fresh.num_image_tokens(SHAPE) == 16


def test_size_not_divisible_is_a_user_error(family):
    with pytest.raises(MilesUserError, match="multiples of 8"):
        family.latent_grid(GenerationShape(height=36, width=32))


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    shape = GenerationShape(height=32, width=48)  # non-square: the packed token order matters
    pixels = gradient_pixels(2, 1, shape.height, shape.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()  # [B, C, 1, h, w]
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample[:, :, 0])
    # QwenImageImg2ImgPipeline._encode_vae_image's normalisation, then the pipeline's own packing.
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(view)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view)
    normalised = ((posterior - mean) * inverse_std)[:, :, 0]
    batch, channels, height, width = normalised.shape
    expected = pipe._pack_latents(normalised, batch, channels, height, width)
    check_encode_images(family, pipe, shape, pixels, expected, expected_pixels)
