"""SD3 family on its tiny checkpoint: load, encode, denoise, decode, and parity with the diffusers pipeline."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.schedules import flow_match_sigmas
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
    return get_family_class("sd3")()


@pytest.fixture(scope="module")
def pipe(family, tiny_checkpoint):
    return family.load_pipeline(tiny_checkpoint("sd3"), torch.float32)


def diffusers_output(pipe, guidance_scale, num_steps, output_type, negative_prompt=" ", seeds=SEEDS):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=negative_prompt,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        height=SHAPE.height,
        width=SHAPE.width,
        generator=generators_from_seeds(seeds),
        output_type=output_type,
    ).images


def test_encode_prompt_fixed_lengths_and_negatives(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=4.0))
    assert set(cond) == {
        "prompt_embeds",
        "pooled_prompt_embeds",
        "negative_prompt_embeds",
        "negative_pooled_prompt_embeds",
    }
    # 77 CLIP tokens + the T5 length, whatever the prompt length, so samples of any prompts stack.
    assert cond["prompt_embeds"].shape == (2, 77 + family.max_sequence_length, 32)
    assert cond["pooled_prompt_embeds"].shape == (2, 32)
    assert torch.equal(cond["negative_prompt_embeds"][0], cond["negative_prompt_embeds"][1])
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])
    no_cfg = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=1.0))
    assert set(no_cfg) == {"prompt_embeds", "pooled_prompt_embeds"}
    torch.testing.assert_close(no_cfg["prompt_embeds"], cond["prompt_embeds"])


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_loop_matches_diffusers_latents(family, pipe, guidance_scale):
    ours = sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=4, shape=SHAPE,
        guidance=GuidanceConfig(guidance_scale=guidance_scale), negative_prompt=" ", decode=False,
    )
    reference = diffusers_output(pipe, guidance_scale, 4, "latent")
    assert ours.latents.dtype == torch.float32
    torch.testing.assert_close(ours.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_decoded_pixels_match_diffusers(family, pipe):
    ours = sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=3, shape=SHAPE,
        guidance=GuidanceConfig(guidance_scale=4.0), negative_prompt=" ",
    )
    assert ours.images.dtype == torch.uint8 and ours.images.shape == (2, 1, 32, 32, 3)
    reference = torch.from_numpy(diffusers_output(pipe, 4.0, 3, "np"))  # float [B, H, W, 3] in [0, 1]
    # Our uint8 is the pipeline's float image rounded: within half a level (plus the 1e-6 latent noise).
    assert (ours.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_timestep_convention_reaches_transformer_as_1000_sigma(family, pipe):
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    try:
        ours = sample_reference(
            family, pipe, PROMPTS, seeds=SEEDS, num_steps=3, shape=SHAPE,
            guidance=GuidanceConfig(guidance_scale=4.0), decode=False,
        )
        ours_seen = seen[:]
        seen.clear()
        diffusers_output(pipe, 4.0, 3, "latent")
    finally:
        hook.remove()
    assert len(ours_seen) == 3
    for k, (ours_t, diffusers_t) in enumerate(zip(ours_seen, seen)):
        assert ours_t.dtype == torch.float32 and ours_t.shape == (4,)  # doubled CFG batch
        torch.testing.assert_close(ours_t, diffusers_t, atol=0, rtol=0)
        torch.testing.assert_close(ours_t, torch.full((4,), float(ours.sigmas[k]) * 1000.0))
    assert float(ours_seen[0][0]) == 1000.0


def test_prepare_latents_draws_each_sample_from_its_own_generator(family, pipe):
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert batch.shape == (2, 4, 8, 8) and batch.dtype == torch.float32
    assert torch.equal(batch[1], alone[0])


def test_sigmas_static_shift_and_flow_shift_override(family, pipe):
    torch.testing.assert_close(family.sigmas(pipe, 10, SHAPE, None), flow_match_sigmas(10, shift=3.0))
    overridden = family.sigmas(pipe, 10, SHAPE, 1.0)
    torch.testing.assert_close(overridden, flow_match_sigmas(10, shift=1.0))
    assert overridden[0] == 1.0 and overridden[-1] == 0.0


def test_sde_rollout_denoises_and_decodes_uint8(family, pipe):
    out = sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=3, shape=SHAPE, guidance=GuidanceConfig(guidance_scale=4.0),
        sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False),
    )
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 32, 3)
    assert len(out.log_probs) == 3 and all(torch.isfinite(lp).all() for lp in out.log_probs)
    assert len(out.trajectory) == 4 and not torch.equal(out.trajectory[0], out.trajectory[-1])


def test_velocity_is_fp32_and_cfg_needs_negatives(family, pipe):
    guidance = GuidanceConfig(guidance_scale=4.0)
    cond = family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        family.predict_velocity({"transformer": pipe.transformer}, latents, torch.ones(2), cond, guidance, SHAPE,
                                torch.float32)
    v = family.predict_velocity({"transformer": pipe.transformer}, latents, torch.ones(2), cond,
                                GuidanceConfig(guidance_scale=1.0), SHAPE, torch.float32)
    assert v.dtype == torch.float32 and v.shape == latents.shape


def test_lora_targets_exist_and_no_cp_plan(family, pipe):
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    assert family.context_parallel_plan(pipe.transformer) is None  # SD3Transformer2DModel has no _cp_plan


def test_load_modules_matches_pipeline_transformer(family, pipe, tiny_checkpoint):
    modules = family.load_modules(tiny_checkpoint("sd3"), ["transformer"], torch.float32)
    loaded = dict(modules["transformer"].named_parameters())
    for name, param in pipe.transformer.named_parameters():
        assert torch.equal(loaded[name], param), name


def test_size_not_divisible_is_a_user_error(family, pipe):
    with pytest.raises(MilesUserError, match="multiples of 8"):
        family.prepare_latents(pipe, GenerationShape(height=36, width=32), generators_from_seeds([0]), torch.float32)


def test_largest_image_side_is_where_the_transformers_position_table_ends(family, pipe, tiny_checkpoint):
    largest = family.largest_image_side(tiny_checkpoint("sd3"))
    assert largest == pipe.transformer.config.pos_embed_max_size * 2 * pipe.vae_scale_factor
    step = 2 * pipe.vae_scale_factor  # the smallest size change the DiT's patches allow

    def latents(side: int) -> torch.Tensor:
        return torch.zeros(1, pipe.transformer.config.in_channels, side // pipe.vae_scale_factor, step // 2)

    pipe.transformer.pos_embed(latents(largest))  # the largest side fits the table
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        pipe.transformer.pos_embed(latents(largest + step))
    assert family.largest_image_side("stabilityai/stable-diffusion-3.5-medium") is None  # a hub id: not read


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    pixels = gradient_pixels(2, 1, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior_mean = vae.encode(vae_input(pixels, video=False)).latent_dist.mean
        expected_pixels = vae_output_to_uint8(vae.decode(posterior_mean).sample)
    expected = (posterior_mean - vae.config.shift_factor) * vae.config.scaling_factor
    check_encode_images(family, pipe, SHAPE, pixels, expected, expected_pixels)
    with pytest.raises(MilesUserError, match="trains on images"):
        family.encode_images(pipe, gradient_pixels(1, 2, SHAPE.height, SHAPE.width), SHAPE)
    odd = 3 * pipe.vae_scale_factor  # an odd latent size: the DiT's 2×2 patches cannot tile it
    with pytest.raises(MilesUserError, match="must be multiples of"):
        family.encode_images(pipe, gradient_pixels(1, 1, odd, odd), GenerationShape(height=odd, width=odd))


def test_a_t5_tokenizer_shorter_than_256_sets_the_t5_length(family):
    """A small checkpoint whose T5 tokenizer says 16 (miles/tasks/shapes) gets 16 T5 tokens; SD3.5's says 512."""
    from miles.tasks.shapes import PRETRAINED_SD3

    pipe = family.load_pipeline(PRETRAINED_SD3, torch.float32)
    assert family.t5_sequence_length(pipe) == 16
    cond = family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))
    assert cond["prompt_embeds"].shape[1] == pipe.tokenizer.model_max_length + 16 == 32
