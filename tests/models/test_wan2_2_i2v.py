"""Wan 2.2 TI2V 5B image-to-video on its tiny checkpoint (`make_tiny --family wan2_2 --variant ti2v_5b`): parity with
`WanImageToVideoPipeline.__call__` (`expand_timesteps`) given the same input image, the first frame pinned to the
image, the layouts that refuse an image, and an engine rollout of an image row + one train step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.models.wan2_2 import IMAGE_LATENTS, Wan22TrainPipelineConfig
from miles.testing.reference_loop import sample_reference
from miles.testing.tiny import wan2_2 as tiny_wan
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5)  # latents [48, 2, 2, 2]: 2 latent frames of one token
PROMPTS = ["the cat starts to run", "the sun sets slowly"]
SEEDS = [3, 11]
TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def path_5b(tmp_path_factory):
    return tiny_wan.build(str(tmp_path_factory.mktemp("tiny-wan-i2v")), seed=0, variant="ti2v_5b")


@pytest.fixture(scope="module")
def family_and_pipe(path_5b):
    family = get_family_class("wan2_2")()
    family.max_sequence_length = TEXT_LENGTH
    pipe = family.load_pipeline(path_5b, torch.float32)
    # flow-match Euler, so that diffusers' loop takes our Euler steps (the published UniPC solver is multistep)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return family, pipe


def input_image(height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    phase = torch.rand(3, generator=generator)
    channels = [(torch.sin(5 * (xs - ys) + 6 * phase[c]) * 0.5 + 0.5) for c in range(3)]
    return (torch.stack(channels, dim=-1) * 255).round().to(torch.uint8)


def diffusers_i2v(pipe, image: torch.Tensor, guidance: GuidanceConfig, num_steps: int, output_type: str):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    i2v = WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                  scheduler=pipe.scheduler, transformer=pipe.transformer, expand_timesteps=True)
    # the text through WanPipeline.encode_prompt: diffusers 0.42's image-to-video prompt cleaning needs ftfy
    prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
        prompt=PROMPTS, negative_prompt=" ", do_classifier_free_guidance=True, max_sequence_length=TEXT_LENGTH)
    return i2v(
        image=Image.fromarray(image.numpy()),
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        num_inference_steps=num_steps,
        guidance_scale=guidance.guidance_scale,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=TEXT_LENGTH,
    ).frames


def ours(family, pipe, image, guidance, num_steps, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
                            negative_prompt=" ", condition_image=image, **kwargs)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_image_to_video_matches_diffusers_latents(family_and_pipe, guidance_scale):
    family, pipe = family_and_pipe
    guidance = GuidanceConfig(guidance_scale=guidance_scale)
    image = input_image(40, 24)  # resized to the output size, as the pipeline's video processor does
    out = ours(family, pipe, image, guidance, 3)
    reference = diffusers_i2v(pipe, image, guidance, 3, "latent")
    assert out.latents.shape == (2, 48, 2, 2, 2) and out.conditioning[IMAGE_LATENTS].shape == (2, 48, 1, 2, 2)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.latents[:, :, :1], out.conditioning[IMAGE_LATENTS], atol=0, rtol=0)


def test_decoded_video_matches_diffusers(family_and_pipe):
    family, pipe = family_and_pipe
    guidance = GuidanceConfig(guidance_scale=4.0)
    image = input_image(seed=2)
    out = ours(family, pipe, image, guidance, 2, decode=True)
    reference = torch.from_numpy(diffusers_i2v(pipe, image, guidance, 2, "np"))
    assert out.images.shape == (2, 5, 32, 32, 3)
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_first_frame_tokens_see_t_zero_and_get_no_velocity(family_and_pipe):
    family, pipe = family_and_pipe
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True)
    conditioning = {**family.encode_prompt(pipe, PROMPTS[:1], None, GuidanceConfig(guidance_scale=1.0)),
                    **family.encode_condition_image(pipe, input_image(), SHAPE)}
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS[:1]), torch.float32).requires_grad_()
    try:
        velocity = family.predict_velocity({"transformer": pipe.transformer}, latents, torch.full((1,), 0.5),
                                           conditioning, GuidanceConfig(guidance_scale=1.0), SHAPE, torch.float32)
    finally:
        hook.remove()
    torch.testing.assert_close(seen[0], torch.tensor([[0.0, 500.0]]))  # frame 0's token at t = 0
    assert torch.all(velocity[:, :, 0] == 0) and velocity[:, :, 1:].abs().sum() > 0
    velocity.sum().backward()  # the noisy first frame is replaced by the image: it gets no gradient
    assert torch.all(latents.grad[:, :, 0] == 0) and latents.grad[:, :, 1:].abs().sum() > 0


def test_only_the_ti2v_layout_takes_an_image(tiny_checkpoint, path_5b):
    path_a14b = tiny_checkpoint("wan2_2")
    assert Wan22TrainPipelineConfig.condition_image_policy(path_5b) == "optional"
    assert Wan22TrainPipelineConfig.condition_image_policy(path_a14b) == "none"
    assert Wan22TrainPipelineConfig.condition_image_policy("Wan-AI/Wan2.2-TI2V-5B-Diffusers") == "optional"
    a14b = get_family_class("wan2_2")()
    pipe = a14b.load_pipeline(path_a14b, torch.float32)
    assert a14b.condition_image == "none"
    with pytest.raises(MilesUserError, match="family 'wan2_2' takes no input image"):
        a14b.encode_condition_image(pipe, input_image(), SHAPE)


def test_engine_rollout_of_an_image_row_and_one_train_step(path_5b):
    """The engine encodes the image once per request and returns videos whose first latent frame is the image; the
    trainer replays the rollout's velocities from the samples' conditioning, and one LoRA step moves the adapters."""

    from miles.engine.protocol import ConditionImage, GenerateRequest
    from miles.testing.tiny_rollout import (build_tiny_family, cpu_runner, samples_through_the_engine,
                                            tiny_trainer_config, train_step_on_one_rank)

    config = tiny_trainer_config(
        path_5b, diffusion_num_steps=3, diffusion_guidance_scale=4.0, use_lora=True, micro_batch_size_sample=2,
        micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True,
        diffusion_output_num_frames=5,
    )
    family = build_tiny_family(config)
    pipe = family.load_pipeline(path_5b, torch.float32)
    runner = cpu_runner(path_5b, family, pipe)
    samples = samples_through_the_engine(runner, GenerateRequest(
        prompt=PROMPTS[0], num_samples=2, seed=7, num_steps=3, height=32, width=32, num_frames=5,
        guidance=GuidanceConfig(guidance_scale=4.0), sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2],
        debug=True, request_id="i2v", image=ConditionImage.from_tensor(input_image())))
    image_latents = samples[0].conditioning[IMAGE_LATENTS]
    assert image_latents.shape == (48, 1, 2, 2) and samples[0].image.shape == (5, 32, 32, 3)
    assert torch.equal(samples[1].clean_latents[:, :1], image_latents)  # the first frame is the input image

    metrics, before, after = train_step_on_one_rank(config, family, samples)
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and np.isfinite(metrics["train/loss"])
    assert any(not torch.equal(before[name], after[name]) for name in before if "lora_B" in name)
