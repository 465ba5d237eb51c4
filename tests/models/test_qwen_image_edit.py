"""Qwen-Image-Edit family on its tiny checkpoint (`make_tiny --family qwen_image --variant edit`): resolution,
parity with `QwenImageEditPipeline.__call__` given the same input image (with and without true CFG), the image in
both the text encoder and the DiT, and an engine rollout of an image row + one train step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.qwen_image_edit import IMAGE_LATENTS, QwenImageEditTrainPipelineConfig
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32)  # 8x8 latents -> 16 tokens, and 16 more for the input image
PROMPTS = ["make the cat red", "add a small hat to the dog"]
SEEDS = [3, 11]
VISION_TOKENS = 4  # the processor upsizes 32x32 to 56x56: 4x4 patches of 14, merged 2x2


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("qwen_image", str(tmp_path_factory.mktemp("edit") / "tiny-editor"), variant="edit")


@pytest.fixture(scope="module")
def family():
    return get_family_class("qwen_image_edit")()


@pytest.fixture(scope="module")
def pipe(family, path):
    return family.load_pipeline(path, torch.float32)


@pytest.fixture
def output_sized_pipeline(monkeypatch):
    """The pipeline resizes its input image to about 1024² px (`calculate_dimensions`) whatever the output size; the
    family uses it at the output size. Patched to the output size so the two runs read the same image."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                        lambda area, ratio: (SHAPE.width, SHAPE.height, None))


def input_image(height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    phase = torch.rand(3, generator=generator)
    channels = [(torch.sin(6 * (xs + ys) + 6 * phase[c]) * 0.5 + 0.5) for c in range(3)]
    return (torch.stack(channels, dim=-1) * 255).round().to(torch.uint8)


def diffusers_output(pipe, image: torch.Tensor, guidance: GuidanceConfig, num_steps: int, output_type: str):
    """One `QwenImageEditPipeline.__call__` per prompt (its processor takes one image per prompt), stacked."""
    from PIL import Image

    cfg = guidance.scale > 1.0
    outputs = []
    for prompt, seed in zip(PROMPTS, SEEDS):
        outputs.append(pipe(
            image=Image.fromarray(image.numpy()),
            prompt=prompt,
            negative_prompt=" " if cfg else None,
            true_cfg_scale=guidance.scale,
            num_inference_steps=num_steps,
            height=SHAPE.height,
            width=SHAPE.width,
            generator=generators_from_seeds([seed]),
            output_type=output_type,
        ).images)
    return torch.cat(outputs) if output_type == "latent" else np.concatenate(outputs)


def ours(family, pipe, image, guidance, num_steps, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
                            negative_prompt=" ", condition_image=image, **kwargs)


def test_the_checkpoint_resolves_to_qwen_image_edit(path, pipe, family):
    assert resolve_family_name(path, None) == "qwen_image_edit"
    assert resolve_family_name("Qwen/Qwen-Image-Edit", None) == "qwen_image_edit"
    assert resolve_family_name("Qwen/Qwen-Image", None) == "qwen_image"
    config = build_train_pipeline_config(hf_checkpoint=path, diffusion_model_family=None,
                                         train_pipeline_config_path=None, model_backend_path=None)
    assert isinstance(config, QwenImageEditTrainPipelineConfig)
    assert config.condition_image == "required" and get_family_class("qwen_image").condition_image == "none"
    assert type(pipe).__name__ == "QwenImageEditPipeline" and pipe.processor.video_processor is None
    # the system turn of the edit template, counted with the loaded tokenizer (64 with the real one)
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert pipe.prompt_template_encode_start_idx == len(pipe.tokenizer(prefix).input_ids)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_loop_matches_diffusers_latents(family, pipe, output_sized_pipeline, guidance_scale):
    guidance = GuidanceConfig(guidance_scale=guidance_scale)
    image = input_image()
    out = ours(family, pipe, image, guidance, 3)
    reference = diffusers_output(pipe, image, guidance, 3, "latent")
    assert out.latents.shape == (2, 16, 16)  # only the generated image's tokens
    assert out.conditioning[IMAGE_LATENTS].shape == (2, 16, 16)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-7, rtol=0)


def test_decoded_image_matches_diffusers(family, pipe, output_sized_pipeline):
    guidance = GuidanceConfig(guidance_scale=4.0)
    image = input_image(seed=2)
    out = ours(family, pipe, image, guidance, 2, decode=True)
    reference = torch.from_numpy(diffusers_output(pipe, image, guidance, 2, "np"))
    assert out.images.shape == (2, 1, 32, 32, 3)
    assert (out.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_the_text_encoder_and_the_dit_both_read_the_image(family, pipe):
    guidance = GuidanceConfig(guidance_scale=4.0)
    conditionings = [family.encode_conditioning(pipe, PROMPTS, None, guidance, shape=SHAPE, image=input_image(seed=s))
                     for s in (0, 1)]
    first, second = conditionings
    length = family.prompt_pad_length + VISION_TOKENS
    assert first["prompt_embeds"].shape == (2, length, 32) and first["negative_prompt_embeds"].shape == (2, length, 32)
    assert not torch.allclose(first["prompt_embeds"], second["prompt_embeds"])  # Qwen2.5-VL saw the image
    assert not torch.allclose(first["negative_prompt_embeds"], second["negative_prompt_embeds"])
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["hidden_states"].clone(), kwargs["img_shapes"])),
        with_kwargs=True)
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    try:
        with torch.no_grad():
            family.predict_velocity({"transformer": pipe.transformer}, latents, torch.full((2,), 0.5), first,
                                    guidance, SHAPE, torch.float32)
    finally:
        hook.remove()
    hidden, img_shapes = seen[0]
    assert hidden.shape == (4, 32, 16) and img_shapes[0] == [(1, 4, 4), (1, 4, 4)]
    assert torch.equal(hidden[:2, 16:], hidden[2:, 16:])  # both true-CFG branches see the same input image
    assert torch.equal(hidden[2:, 16:], first[IMAGE_LATENTS])


def test_a_row_without_an_image_is_refused(family, pipe):
    with pytest.raises(MilesUserError, match="family 'qwen_image_edit' needs an input image in every prompt row"):
        family.encode_conditioning(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0), shape=SHAPE)
    short = get_family_class("qwen_image_edit")()
    short.prompt_pad_length = 2  # room for the image's vision tokens and two more
    with pytest.raises(MilesUserError, match="qwen_image_edit family is .* tokens with its image and template, more"):
        short.encode_conditioning(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0), shape=SHAPE,
                                  image=input_image())
    with pytest.raises(MilesUserError, match="SFT .* is not supported for family 'qwen_image_edit'"):
        family.encode_images(pipe, torch.zeros(1, 1, 32, 32, 3, dtype=torch.uint8), SHAPE)


def test_engine_rollout_of_an_image_row_and_one_train_step(path):
    """The engine encodes the request's prompt with its image once; the samples carry the image latents and the
    image-aware prompt embeddings; the trainer replays the rollout's velocities and one LoRA step moves the adapters."""

    from miles.engine.protocol import ConditionImage, GenerateRequest, ProtocolError
    from miles.testing.tiny_rollout import (build_tiny_family, cpu_runner, samples_through_the_engine,
                                            tiny_trainer_config, train_step_on_one_rank)

    config = tiny_trainer_config(
        path, diffusion_num_steps=3, diffusion_guidance_scale=4.0, use_lora=True, micro_batch_size_sample=2,
        micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True,
    )
    family = build_tiny_family(config)
    pipe = family.load_pipeline(path, torch.float32)
    runner = cpu_runner(path, family, pipe)
    samples = samples_through_the_engine(runner, GenerateRequest(
        prompt=PROMPTS[0], num_samples=2, seed=7, num_steps=3, height=32, width=32,
        guidance=GuidanceConfig(guidance_scale=4.0), sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2],
        debug=True, request_id="edit", image=ConditionImage.from_tensor(input_image())))
    conditioning = samples[0].conditioning
    assert conditioning[IMAGE_LATENTS].shape == (16, 16) and samples[0].image.shape == (1, 32, 32, 3)
    assert conditioning["prompt_embeds"].shape == (family.prompt_pad_length + VISION_TOKENS, 32)
    with pytest.raises(ProtocolError, match="needs an input image in every prompt row"):
        runner.start(GenerateRequest(prompt="no image", num_steps=2, height=32, width=32))

    metrics, before, after = train_step_on_one_rank(config, family, samples)
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and np.isfinite(metrics["train/loss"])
    assert any(not torch.equal(before[name], after[name]) for name in before if "lora_B" in name)
