"""LTX-Video family on its tiny checkpoint: load, encode, denoise, decode, and parity with `LTXPipeline.__call__`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.diffusion.sde import DiffusersSdeStepBackend
from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.models.ltx import pack_latents, unpack_latents
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
CFG = GuidanceConfig(guidance_scale=3.0)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("ltx")


@pytest.fixture(scope="module")
def family():
    return get_family_class("ltx")()


@pytest.fixture(scope="module")
def pipe(family, path):
    return family.load_pipeline(path, torch.float32)


def diffusers_frames(pipe, guidance_scale, num_steps, output_type, frame_rate=25):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=" ",
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        frame_rate=frame_rate,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
    ).frames


def ours(family, pipe, guidance, num_steps, shape=SHAPE, **kwargs):
    return sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=shape, guidance=guidance,
        negative_prompt=" ", **kwargs,
    )


def test_encode_prompt_fixed_length_with_masks(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG)
    assert set(cond) == {"prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds",
                         "negative_prompt_attention_mask"}
    assert cond["prompt_embeds"].shape == (2, 128, 32) and cond["prompt_attention_mask"].shape == (2, 128)
    assert cond["prompt_attention_mask"].dtype == torch.bool
    tokens = len(pipe.tokenizer(PROMPTS[0]).input_ids)
    assert cond["prompt_attention_mask"][0].sum() == tokens
    assert torch.equal(cond["negative_prompt_embeds"][0], cond["negative_prompt_embeds"][1])
    assert set(family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))) == {
        "prompt_embeds", "prompt_attention_mask"}


@pytest.mark.parametrize("guidance_scale", [3.0, 1.0])
def test_ode_loop_matches_diffusers_packed_latents(family, pipe, guidance_scale):
    out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 4, decode=False)
    reference = diffusers_frames(pipe, guidance_scale, 4, "latent")
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 2 * 8 * 8, 8)  # packed [N, C]
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)


def test_fps_reaches_the_rope_scale(family, pipe):
    shape = GenerationShape(height=32, width=32, num_frames=5, fps=12.0)
    out = ours(family, pipe, CFG, 2, shape=shape, decode=False)
    torch.testing.assert_close(out.latents, diffusers_frames(pipe, 3.0, 2, "latent", frame_rate=12), atol=1e-5,
                               rtol=0)
    assert not torch.allclose(out.latents, ours(family, pipe, CFG, 2, decode=False).latents)


def test_decoded_frames_match_diffusers(family, pipe):
    out = ours(family, pipe, CFG, 2)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    reference = torch.from_numpy(np.asarray(diffusers_frames(pipe, 3.0, 2, "np")))
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_timestep_convention_reaches_transformer_as_1000_sigma(family, pipe):
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True)
    try:
        out = ours(family, pipe, CFG, 3, decode=False)
        ours_seen = seen[:]
        seen.clear()
        diffusers_frames(pipe, 3.0, 3, "latent")
    finally:
        hook.remove()
    assert len(ours_seen) == 3
    for k, (ours_t, diffusers_t) in enumerate(zip(ours_seen, seen)):
        assert ours_t.dtype == torch.float32 and ours_t.shape == (4,)
        torch.testing.assert_close(ours_t, diffusers_t, atol=2e-4, rtol=0)
        torch.testing.assert_close(ours_t, torch.full((4,), float(out.sigmas[k]) * 1000.0))


def test_sigmas_dynamic_shift_from_token_count_terminal_and_override(family, pipe):
    small = family.sigmas(pipe, 6, SHAPE, None)
    large = family.sigmas(pipe, 6, GenerationShape(height=64, width=64, num_frames=9), None)
    assert small[0] == 1.0 and small[-1] == 0.0
    torch.testing.assert_close(small[-2], torch.tensor(0.1))  # shift_terminal
    assert torch.all(large[1:-2] > small[1:-2])  # more tokens, larger mu, more time at high noise
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=pipe.scheduler.config.base_shift
                                 + (128 - 1024) * (2.05 - 0.95) / (4096 - 1024))
    torch.testing.assert_close(small, pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    static = family.sigmas(pipe, 6, SHAPE, 1.0)
    torch.testing.assert_close(static[-2], torch.tensor(0.1))
    assert not torch.allclose(static, small)


def test_pack_unpack_roundtrip_and_per_sample_noise(family, pipe):
    video = torch.randn(2, 8, 3, 4, 6)
    packed = pack_latents(video, 2, 1)
    assert packed.shape == (2, 3 * 2 * 3, 32)
    assert torch.equal(unpack_latents(packed, 3, 4, 6, 2, 1), video)
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert batch.shape == (2, 128, 8) and torch.equal(batch[1], alone[0])


def test_size_errors_name_the_flags(family, pipe):
    with pytest.raises(MilesUserError, match="--diffusion-output-num-frames 6"):
        family.prepare_latents(pipe, GenerationShape(32, 32, 6), generators_from_seeds([0]), torch.float32)
    with pytest.raises(MilesUserError, match="multiples of 32"):
        family.prepare_latents(pipe, GenerationShape(48, 32, 5), generators_from_seeds([0]), torch.float32)


def test_sde_rollout_and_cfg_needs_negatives(family, pipe):
    out = ours(family, pipe, CFG, 2, sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    assert len(out.log_probs) == 2 and all(torch.isfinite(lp).all() for lp in out.log_probs)
    cond = family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        family.predict_velocity({"transformer": pipe.transformer}, out.trajectory[0], torch.ones(2), cond, CFG, SHAPE,
                                torch.float32)


def test_lora_targets_cp_plan_and_load_modules(family, pipe, path):
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    assert family.context_parallel_plan(pipe.transformer) is type(pipe.transformer)._cp_plan
    trainer_side = get_family_class("ltx")()
    modules = trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert (trainer_side.spatial_ratio, trainer_side.temporal_ratio) == (4, 4)
    assert trainer_side.latent_grid(SHAPE) == family.latent_grid(SHAPE)
    loaded = dict(modules["transformer"].named_parameters())
    for name, param in pipe.transformer.named_parameters():
        assert torch.equal(loaded[name], param), name


@pytest.mark.parametrize("class_name", ["LTXImageToVideoPipeline", "LTX2ConditionPipeline"])
def test_other_ltx_pipelines_are_refused_before_loading(path, tmp_path, class_name):
    import json
    import shutil

    folder = tmp_path / "other"
    shutil.copytree(path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = class_name
    (folder / "model_index.json").write_text(json.dumps(index))
    message = (f"holds a {class_name}; the ltx family supports LTXPipeline .*, LTX2Pipeline and "
               "LTX2ImageToVideoPipeline .* only")
    with pytest.raises(MilesUserError, match=message):
        get_family_class("ltx")().load_pipeline(str(folder), torch.float32)
    with pytest.raises(MilesUserError, match=message):
        get_family_class("ltx")().load_modules(str(folder), ["transformer"], torch.float32)


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from diffusers import LTXImageToVideoPipeline, LTXPipeline

    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    pixels = gradient_pixels(2, SHAPE.num_frames, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()
        timestep = torch.zeros(len(pixels)) if vae.config.timestep_conditioning else None
        expected_pixels = vae_output_to_uint8(vae.decode(posterior, timestep).sample)
    normalised = LTXImageToVideoPipeline._normalize_latents(
        posterior, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
    )
    expected = LTXPipeline._pack_latents(normalised, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
    check_encode_images(family, pipe, SHAPE, pixels, expected, expected_pixels)
    with pytest.raises(MilesUserError, match="must be 8·k \\+ 1|must be"):
        family.encode_images(pipe, gradient_pixels(1, 4, SHAPE.height, SHAPE.width), GenerationShape(32, 32, 4))
