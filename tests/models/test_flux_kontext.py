"""FLUX.1-Kontext family on its tiny checkpoint (`make_tiny --family flux --variant kontext`): resolution from the
checkpoint, parity with `FluxKontextPipeline.__call__` given the same input image, the input image's tokens, the
image policy, and an engine rollout of an image row + one train step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape, condition_image_mismatch
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.flux_kontext import IMAGE_LATENTS, FluxKontextTrainPipelineConfig
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32)  # 8x8 latents -> 16 tokens, and 16 more for the input image
PROMPTS = ["make the cat red", "add a hat"]
SEEDS = [3, 11]
TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("flux", str(tmp_path_factory.mktemp("kontext") / "tiny-editor"), variant="kontext")


@pytest.fixture(scope="module")
def family():
    family = get_family_class("flux_kontext")()
    family.max_sequence_length = TEXT_LENGTH
    return family


@pytest.fixture(scope="module")
def pipe(family, path):
    return family.load_pipeline(path, torch.float32)


def input_image(height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    """A smooth uint8 [H, W, 3] picture (random pixels make a VAE's output meaningless, not the test)."""
    generator = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    phase = torch.rand(3, generator=generator)
    channels = [(torch.sin(6 * (xs + ys) + 6 * phase[c]) * 0.5 + 0.5) for c in range(3)]
    return (torch.stack(channels, dim=-1) * 255).round().to(torch.uint8)


def diffusers_output(pipe, image: torch.Tensor, guidance: GuidanceConfig, num_steps: int, output_type: str,
                     shape: GenerationShape = SHAPE):
    from PIL import Image

    true_cfg = guidance.true_cfg_scale
    return pipe(
        image=Image.fromarray(image.numpy()),
        prompt=PROMPTS,
        negative_prompt=" " if true_cfg else None,
        true_cfg_scale=true_cfg or 1.0,
        guidance_scale=guidance.guidance_scale,
        num_inference_steps=num_steps,
        height=shape.height,
        width=shape.width,
        max_area=shape.height * shape.width,  # keep the requested size (the pipeline rescales to ~1 MP by default)
        _auto_resize=False,  # the input image at its own size, not a preferred Kontext resolution
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=TEXT_LENGTH,
    ).images


def ours(family, pipe, image, guidance, num_steps, shape=SHAPE, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=shape, guidance=guidance,
                            negative_prompt=" ", condition_image=image, **kwargs)


def test_the_checkpoint_resolves_to_flux_kontext(path):
    assert resolve_family_name(path, None) == "flux_kontext"
    assert resolve_family_name("black-forest-labs/FLUX.1-Kontext-dev", None) == "flux_kontext"
    assert resolve_family_name("black-forest-labs/FLUX.1-dev", None) == "flux"
    config = build_train_pipeline_config(hf_checkpoint=path, diffusion_model_family=None,
                                         train_pipeline_config_path=None, model_backend_path=None)
    assert isinstance(config, FluxKontextTrainPipelineConfig)
    assert config.condition_image == "required" and get_family_class("flux").condition_image == "none"


@pytest.mark.parametrize("true_cfg_scale", [None, 3.0])
def test_ode_loop_matches_diffusers_latents(family, pipe, true_cfg_scale):
    guidance = GuidanceConfig(guidance_scale=2.5, true_cfg_scale=true_cfg_scale)
    image = input_image()
    out = ours(family, pipe, image, guidance, 4)
    reference = diffusers_output(pipe, image, guidance, 4, "latent")
    assert out.latents.shape == (2, 16, 16)  # only the generated image's tokens
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-7, rtol=0)


def test_an_input_image_of_another_size_and_decode_match_diffusers(family, pipe):
    """Input 44x28 (floored to 40x24 with the pipeline's Lanczos resize) for a 32x48 output."""
    shape = GenerationShape(height=32, width=48)
    guidance = GuidanceConfig(guidance_scale=3.5)
    image = input_image(44, 28, seed=1)
    out = ours(family, pipe, image, guidance, 3, shape=shape, decode=True)
    assert out.conditioning[IMAGE_LATENTS].shape == (2, 4, 10, 6)
    reference_latents = diffusers_output(pipe, image, guidance, 3, "latent", shape=shape)
    torch.testing.assert_close(out.latents, reference_latents, atol=1e-5, rtol=0)
    reference = torch.from_numpy(diffusers_output(pipe, image, guidance, 3, "np", shape=shape))
    assert out.images.shape == (2, 1, 32, 48, 3)
    assert (out.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_the_dit_sees_the_input_image_tokens_after_the_latents(family, pipe):
    seen: list[dict] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({k: kwargs[k].clone() for k in ("hidden_states", "img_ids")}),
        with_kwargs=True,
    )
    try:
        ours(family, pipe, input_image(), GuidanceConfig(guidance_scale=3.5, true_cfg_scale=2.0), 1)
    finally:
        hook.remove()
    hidden, ids = seen[0]["hidden_states"], seen[0]["img_ids"]
    assert hidden.shape == (4, 32, 16)  # [negative; positive] x (16 noisy + 16 input-image tokens)
    assert torch.equal(hidden[:2, 16:], hidden[2:, 16:])  # both CFG branches see the same input image
    assert ids.shape == (32, 3) and torch.all(ids[:16, 0] == 0) and torch.all(ids[16:, 0] == 1)
    assert torch.equal(ids[:16, 1:], ids[16:, 1:])


def test_the_input_image_changes_the_velocity_and_is_required(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS[:1], None, GuidanceConfig(guidance_scale=3.5))
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS[:1]), torch.float32)
    modules = {"transformer": pipe.transformer}
    velocities = []
    for seed in (0, 1):
        conditioning = {**cond, **family.encode_condition_image(pipe, input_image(seed=seed), SHAPE)}
        with torch.no_grad():
            velocities.append(family.predict_velocity(modules, latents, torch.full((1,), 0.5), conditioning,
                                                      GuidanceConfig(guidance_scale=3.5), SHAPE, torch.float32))
    assert not torch.allclose(*velocities)
    with pytest.raises(MilesUserError, match="needs the input image's latents"):
        family.predict_velocity(modules, latents, torch.full((1,), 0.5), cond, GuidanceConfig(guidance_scale=3.5),
                                SHAPE, torch.float32)
    assert "needs an input image in every prompt row" in condition_image_mismatch("flux_kontext", "required", False)
    assert "takes no input image" in condition_image_mismatch("flux", "none", True)
    assert condition_image_mismatch("flux_kontext", "required", True) is None


def test_engine_rollout_of_an_image_row_and_one_train_step(path):
    """The engine encodes the request's image once; its samples carry the image latents in their conditioning; the
    trainer replays the rollout's velocities from them (no re-encoding) and one LoRA step moves the adapters."""

    from miles.engine.protocol import ConditionImage, GenerateRequest, ProtocolError
    from miles.testing.tiny_rollout import (build_tiny_family, cpu_runner, samples_through_the_engine,
                                            tiny_trainer_config, train_step_on_one_rank)

    config = tiny_trainer_config(
        path, diffusion_num_steps=3, diffusion_guidance_scale=3.5, use_lora=True, micro_batch_size_sample=2,
        micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True,
    )
    family = build_tiny_family(config)
    pipe = family.load_pipeline(path, torch.float32)
    runner = cpu_runner(path, family, pipe)
    encoded_images = []
    original_encode = family.encode_condition_image
    family.encode_condition_image = lambda *a, **k: encoded_images.append(1) or original_encode(*a, **k)
    request = GenerateRequest(prompt=PROMPTS[0], num_samples=2, seed=7, num_steps=3, height=32, width=32,
                              guidance=GuidanceConfig(guidance_scale=3.5), sde_step_indices=[0, 1],
                              return_latent_indices=[0, 1, 2], debug=True, request_id="kontext",
                              image=ConditionImage.from_tensor(input_image()))
    samples = samples_through_the_engine(runner, request)
    assert len(encoded_images) == 1  # once per request, shared by its samples
    assert samples[0].conditioning[IMAGE_LATENTS].shape == (4, 8, 8)
    assert not samples[0].conditioning[IMAGE_LATENTS].requires_grad
    assert samples[0].image.shape == (1, 32, 32, 3)
    with pytest.raises(ProtocolError, match="needs an input image in every prompt row"):
        runner.start(GenerateRequest(prompt="no image", num_steps=2, height=32, width=32))

    metrics, before, after = train_step_on_one_rank(config, family, samples)
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and np.isfinite(metrics["train/loss"])
    assert any(not torch.equal(before[name], after[name]) for name in before if "lora_B" in name)
