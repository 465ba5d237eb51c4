"""LTX-2 image-to-video on its tiny checkpoint saved as an `LTX2ImageToVideoPipeline` (`make_tiny --family ltx
--variant ltx2_i2v`): resolution, parity with `LTX2ImageToVideoPipeline.__call__` (guidance off, `image_crf=0`)
given the same input image, the first frame pinned to the image, LTX-Video refusing an image, and an engine rollout
of an image row + one train step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.models.ltx import IMAGE_LATENTS, LTXTrainPipelineConfig, pack_latents, unpack_audio_latents, unpack_latents
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.testing.tiny.ltx import LTX2_GUIDANCE_OFF
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5, fps=25.0)  # video [8, 2, 8, 8], audio [2, 5, 2]
FIRST_FRAME = 8 * 8  # packed tokens of the first latent frame
VIDEO_SIZE = 2 * 8 * 8 * 8
PROMPTS = ["the cat starts to run", "the sun sets slowly over the sea"]
SEEDS = [3, 11]
NO_CFG = GuidanceConfig(guidance_scale=1.0)
TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("ltx", str(tmp_path_factory.mktemp("i2v") / "tiny-av"), variant="ltx2_i2v")


@pytest.fixture(scope="module")
def family_and_pipe(path):
    family = get_family_class("ltx")()
    family.max_sequence_length = TEXT_LENGTH
    return family, family.load_pipeline(path, torch.float32)


def input_image(height: int = 32, width: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    phase = torch.rand(3, generator=generator)
    channels = [(torch.sin(5 * (xs - ys) + 6 * phase[c]) * 0.5 + 0.5) for c in range(3)]
    return (torch.stack(channels, dim=-1) * 255).round().to(torch.uint8)


def diffusers_i2v(pipe, image: torch.Tensor, num_steps: int, output_type: str):
    """`LTX2ImageToVideoPipeline.__call__` with every guidance term off and no H.264 re-compression of the image."""
    from PIL import Image

    return pipe(
        image=[Image.fromarray(image.numpy())] * len(PROMPTS),  # one per prompt: its prepare_latents indexes them
        prompt=PROMPTS,
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        frame_rate=SHAPE.fps,
        num_inference_steps=num_steps,
        **LTX2_GUIDANCE_OFF,
        image_crf=0,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=TEXT_LENGTH,
    )


def ours(family, pipe, image, num_steps, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=NO_CFG,
                            condition_image=image, **kwargs)


def test_the_image_to_video_checkpoint_resolves_to_ltx2(path, family_and_pipe):
    family, pipe = family_and_pipe
    assert resolve_family_name(path, None) == "ltx"
    assert type(pipe).__name__ == "LTX2ImageToVideoPipeline" and family.generation == "ltx2"
    assert family.condition_image == "optional" and LTXTrainPipelineConfig.condition_image_policy(path) == "optional"
    trainer_side = get_family_class("ltx")()  # the trainer reads the generation from model_index.json alone
    trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert trainer_side.generation == "ltx2" and trainer_side.latent_grid(SHAPE) == (2, 8, 8)


def test_ltx_video_takes_no_image(tiny_checkpoint):
    path = tiny_checkpoint("ltx")
    assert LTXTrainPipelineConfig.condition_image_policy(path) == "none"
    assert LTXTrainPipelineConfig.condition_image_policy("Lightricks/LTX-2") == "optional"  # a hub id: the engine
    family = get_family_class("ltx")()
    pipe = family.load_pipeline(path, torch.float32)
    assert family.condition_image == "none"
    with pytest.raises(MilesUserError, match="family 'ltx' takes no input image"):
        family.encode_condition_image(pipe, input_image(), SHAPE)


def test_image_to_video_matches_diffusers_video_and_audio(family_and_pipe):
    family, pipe = family_and_pipe
    image = input_image(40, 24)  # resized to the output size (bilinear), as the pipeline's video processor does
    out = ours(family, pipe, image, 3, decode=False)
    reference = diffusers_i2v(pipe, image, 3, "latent")  # unpacked, denormalised video and audio
    assert out.conditioning[IMAGE_LATENTS].shape == (2, FIRST_FRAME, 8)
    video, audio = family.split_modalities(out.latents, SHAPE)
    torch.testing.assert_close(video[:, :FIRST_FRAME], out.conditioning[IMAGE_LATENTS], atol=0, rtol=0)
    video = unpack_latents(video, 2, 8, 8, 1, 1)
    mean = pipe.vae.latents_mean.view(1, -1, 1, 1, 1)
    std = pipe.vae.latents_std.view(1, -1, 1, 1, 1)
    video = video * std / pipe.vae.config.scaling_factor + mean
    audio = unpack_audio_latents(audio * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean, 2)
    torch.testing.assert_close(video, reference.frames, atol=1e-5, rtol=0)
    torch.testing.assert_close(audio, reference.audio, atol=1e-5, rtol=0)


def test_decoded_video_matches_diffusers(family_and_pipe):
    family, pipe = family_and_pipe
    image = input_image(seed=2)
    out = ours(family, pipe, image, 2)
    reference = torch.from_numpy(np.asarray(diffusers_i2v(pipe, image, 2, "np").frames))
    assert out.images.shape == (2, 5, 32, 32, 3)
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_the_image_latents_are_the_pipelines_first_frame(family_and_pipe):
    family, pipe = family_and_pipe
    from PIL import Image

    image = input_image(seed=1)
    pixels = pipe.video_processor.preprocess(Image.fromarray(image.numpy()), height=32, width=32)
    latents, mask = pipe.prepare_latents(pixels, 1, 8, 32, 32, 5, 0.0, torch.float32, "cpu",
                                         generators_from_seeds([0]))
    assert torch.equal(mask[0], (torch.arange(VIDEO_SIZE // 8) < FIRST_FRAME).float())
    encoded = family.encode_condition_image(pipe, image, SHAPE)[IMAGE_LATENTS]
    torch.testing.assert_close(encoded, latents[:, :FIRST_FRAME], atol=0, rtol=0)
    assert torch.equal(encoded, pack_latents(unpack_latents(encoded, 1, 8, 8, 1, 1), 1, 1))


def test_first_frame_tokens_see_t_zero_and_get_no_gradient(family_and_pipe):
    family, pipe = family_and_pipe
    seen: list[dict] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({key: kwargs[key].clone() for key in ("timestep", "audio_timestep")}),
        with_kwargs=True)
    conditioning = {**family.encode_prompt(pipe, PROMPTS[:1], None, NO_CFG),
                    **family.encode_condition_image(pipe, input_image(), SHAPE)}
    state = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS[:1]), torch.float32).requires_grad_()
    try:
        velocity = family.predict_velocity({"transformer": pipe.transformer}, state, torch.full((1,), 0.5),
                                           conditioning, NO_CFG, SHAPE, torch.float32)
    finally:
        hook.remove()
    timestep = seen[0]["timestep"]
    assert timestep.shape == (1, VIDEO_SIZE // 8) and torch.all(timestep[:, :FIRST_FRAME] == 0)
    assert torch.all(timestep[:, FIRST_FRAME:] == 500.0)
    assert torch.equal(seen[0]["audio_timestep"], torch.tensor([500.0]))  # the audio keeps the per-sample t
    pinned = FIRST_FRAME * 8
    assert torch.all(velocity[:, :pinned] == 0) and velocity[:, pinned:VIDEO_SIZE].abs().sum() > 0
    assert velocity[:, VIDEO_SIZE:].abs().sum() > 0  # the audio still moves
    velocity.sum().backward()  # the noisy first frame is replaced by the image: it gets no gradient
    assert torch.all(state.grad[:, :pinned] == 0) and state.grad[:, pinned:].abs().sum() > 0
    final = family.final_latents(state.detach(), conditioning)
    assert torch.equal(final[:, :pinned], conditioning[IMAGE_LATENTS].flatten(1))
    assert torch.equal(final[:, pinned:], state.detach()[:, pinned:])


def test_engine_rollout_of_an_image_row_and_one_train_step(path):
    """The engine encodes the image once per request and returns videos whose first latent frame is the image; the
    trainer replays the rollout's velocities from the samples' conditioning, and one full fine-tuning step (CPS)
    moves the video weights."""

    from miles.engine.protocol import ConditionImage, GenerateRequest
    from miles.testing.tiny_rollout import (build_tiny_family, cpu_runner, samples_through_the_engine,
                                            tiny_trainer_config, train_step_on_one_rank)

    config = tiny_trainer_config(
        path, diffusion_output_num_frames=5, diffusion_fps=25.0, diffusion_num_steps=3, diffusion_guidance_scale=1.0,
        diffusion_sde_type="cps", micro_batch_size_sample=2, micro_batch_size_tstep=1,
        diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True, lr=1e-3,
    )
    family = build_tiny_family(config)
    pipe = family.load_pipeline(path, torch.float32)
    runner = cpu_runner(path, family, pipe)
    samples = samples_through_the_engine(runner, GenerateRequest(
        prompt=PROMPTS[0], num_samples=2, seed=7, num_steps=3, height=32, width=32, num_frames=5, fps=25.0,
        guidance=NO_CFG, sde_type="cps", noise_level=0.7, sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2],
        debug=True, request_id="i2v", image=ConditionImage.from_tensor(input_image())))
    image_latents = samples[0].conditioning[IMAGE_LATENTS]
    assert image_latents.shape == (FIRST_FRAME, 8) and samples[0].image.shape == (5, 32, 32, 3)
    assert torch.equal(samples[1].clean_latents[: FIRST_FRAME * 8], image_latents.flatten())  # the first frame

    metrics, before, after = train_step_on_one_rank(config, family, samples)
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and np.isfinite(metrics["train/loss"])
    assert "transformer.proj_out.weight" in before
    assert not torch.equal(before["transformer.proj_out.weight"], after["transformer.proj_out.weight"])
