"""LTX-2 as the `ltx` family's second generation, on its tiny checkpoint (`make_tiny --family ltx --variant ltx2`):
resolution from the checkpoint, parity with `LTX2Pipeline.__call__` (guidance off), decode, SFT encoding, the
frozen audio branch, and a CPS rollout + train step."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.ltx import (
    LTX2_LORA_TARGETS,
    LTXTrainPipelineConfig,
    is_ltx2_audio_parameter,
    pack_audio_latents,
    unpack_audio_latents,
    unpack_latents,
)
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.testing.tiny.ltx import LTX2_GUIDANCE_OFF
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5, fps=25.0)  # video [8, 2, 8, 8], audio [2, 5, 2]
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
NO_CFG = GuidanceConfig(guidance_scale=1.0)
TEXT_LENGTH = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("ltx", str(tmp_path_factory.mktemp("ltx2") / "tiny-av"), variant="ltx2")


@pytest.fixture(scope="module")
def family():
    family = get_family_class("ltx")()
    family.max_sequence_length = TEXT_LENGTH
    return family


@pytest.fixture(scope="module")
def pipe(family, path):
    return family.load_pipeline(path, torch.float32)


def diffusers_call(pipe, num_steps, output_type):
    """`LTX2Pipeline.__call__` with every guidance term off: CFG, STG, modality isolation and rescale."""
    return pipe(
        prompt=PROMPTS,
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        frame_rate=SHAPE.fps,
        num_inference_steps=num_steps,
        **LTX2_GUIDANCE_OFF,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=TEXT_LENGTH,
    )


def ours(family, pipe, num_steps, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=NO_CFG,
                            **kwargs)


def test_the_checkpoint_resolves_to_ltx_and_reads_as_ltx2(path, family, pipe):
    assert resolve_family_name(path, None) == "ltx"  # from model_index.json: the name has no hint
    assert resolve_family_name("Lightricks/LTX-2", None) == "ltx"
    config = build_train_pipeline_config(**dict(
        hf_checkpoint=path, diffusion_model_family=None, train_pipeline_config_path=None, model_backend_path=None))
    assert isinstance(config, LTXTrainPipelineConfig)
    assert type(pipe).__name__ == "LTX2Pipeline" and family.generation == "ltx2"
    assert family.default_lora_target_modules == LTX2_LORA_TARGETS

    trainer_side = get_family_class("ltx")()  # the trainer reads the generation and sizes from configs alone
    modules = trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert trainer_side.generation == "ltx2" and trainer_side.audio == family.audio
    assert (trainer_side.spatial_ratio, trainer_side.temporal_ratio) == (4, 4)
    assert trainer_side.split_modalities(torch.zeros(1, 2 * 8 * 8 * 8 + 5 * 4), SHAPE)[1].shape == (1, 5, 4)
    loaded = dict(modules["transformer"].named_parameters())
    assert all(torch.equal(loaded[name], param) for name, param in pipe.transformer.named_parameters())


def test_a_model_backend_pipeline_tells_the_generation(path, family):
    from diffusers import LTX2Pipeline

    def backend(checkpoint, dtype):
        return LTX2Pipeline.from_pretrained(checkpoint, dtype=dtype)

    trainer_side = LTXTrainPipelineConfig(model_backend=backend)
    modules = trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert trainer_side.generation == "ltx2" and trainer_side.audio == family.audio and "transformer" in modules
    assert trainer_side.latent_grid(SHAPE) == family.latent_grid(SHAPE)


def test_encode_prompt_runs_the_connectors_and_refuses_cfg(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, None, NO_CFG)
    assert set(cond) == {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}
    assert cond["prompt_embeds"].shape == (2, TEXT_LENGTH, 16)  # the connectors: 2 heads x 8
    assert cond["audio_prompt_embeds"].shape == (2, TEXT_LENGTH, 16)
    assert cond["prompt_attention_mask"].shape == (2, TEXT_LENGTH)
    with pytest.raises(MilesUserError, match="--diffusion-guidance-scale 3: LTX-2 trains and samples without CFG"):
        family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=3.0))
    state = family.prepare_latents(pipe, SHAPE, generators_from_seeds([0, 1]), torch.float32)
    with pytest.raises(MilesUserError, match="pass --diffusion-guidance-scale 1.0"):
        family.predict_velocity({"transformer": pipe.transformer}, state, torch.ones(2), cond,
                                GuidanceConfig(guidance_scale=4.0), SHAPE, torch.float32)


def test_ode_loop_matches_diffusers_video_and_audio(family, pipe):
    out = ours(family, pipe, 3, decode=False)
    reference = diffusers_call(pipe, 3, "latent")  # unpacked, denormalised video [B, C, F, H, W] and audio
    video, audio = family.split_modalities(out.latents, SHAPE)
    video = unpack_latents(video, 2, 8, 8, 1, 1)
    mean = pipe.vae.latents_mean.view(1, -1, 1, 1, 1)
    std = pipe.vae.latents_std.view(1, -1, 1, 1, 1)
    video = video * std / pipe.vae.config.scaling_factor + mean
    audio = unpack_audio_latents(audio * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean, 2)
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 2 * 8 * 8 * 8 + 5 * 4)
    torch.testing.assert_close(video, reference.frames, atol=1e-5, rtol=0)
    torch.testing.assert_close(audio, reference.audio, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)


def test_noise_is_video_then_audio_per_sample(family, pipe):
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert torch.equal(batch[1], alone[0])
    generator = torch.Generator().manual_seed(6)
    video = torch.randn((1, 8, 2, 8, 8), generator=generator)
    audio = torch.randn((1, 2, 5, 2), generator=generator)
    _, packed_audio = family.split_modalities(alone, SHAPE)
    assert torch.equal(packed_audio, pack_audio_latents(audio)) and torch.equal(alone[0, : video.numel()],
                                                                                 video.permute(0, 2, 3, 4, 1).flatten())


def test_decoded_frames_match_diffusers(family, pipe):
    out = ours(family, pipe, 2)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    reference = torch.from_numpy(np.asarray(diffusers_call(pipe, 2, "np").frames))
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.models.ltx import join_modalities, pack_latents
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    pixels = gradient_pixels(2, SHAPE.num_frames, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample)
    normalised = pipe._normalize_latents(posterior, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    expected = join_modalities(pack_latents(normalised, 1, 1), torch.zeros(2, 5, 4))  # SFT rows carry no sound
    check_encode_images(family, pipe, SHAPE, pixels, expected, expected_pixels)


def test_the_audio_branch_is_frozen_and_out_of_the_lora_targets(family, pipe):
    from peft import LoraConfig

    transformer = type(pipe.transformer).from_config(pipe.transformer.config)
    transformer.requires_grad_(True)
    family.freeze_untrained("transformer", transformer)
    frozen = {name for name, p in transformer.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in transformer.named_parameters() if is_ltx2_audio_parameter(name)}
    assert "audio_proj_out.weight" in frozen and "transformer_blocks.0.video_to_audio_attn.to_q.weight" in frozen
    assert "transformer_blocks.0.audio_to_video_attn.to_q.weight" not in frozen  # writes into the video stream
    assert "proj_out.weight" not in frozen and "transformer_blocks.0.attn1.to_q.weight" not in frozen
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(LTX2_LORA_TARGETS)))
    adapted = {name for name, p in transformer.named_parameters() if p.requires_grad}
    assert adapted and not any(is_ltx2_audio_parameter(name) for name in adapted)
    assert all(".attn1." in name or ".attn2." in name for name in adapted)


def test_cps_rollout_and_full_finetune_step_leave_the_audio_branch_alone(path):
    """A CPS rollout of 5-frame videos (with audio) and one full fine-tuning step on a one-rank gloo group: the
    trainer's velocities equal the rollout's bit for bit, the video weights move, the audio branch has no trainable
    parameter (hence no gradient and no optimizer state)."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import rollout_and_train_step, tiny_trainer_config

    args = tiny_trainer_config(
        path, diffusion_output_num_frames=5, diffusion_fps=25.0, diffusion_num_steps=3, diffusion_guidance_scale=1.0,
        diffusion_sde_type="cps", micro_batch_size_sample=4, micro_batch_size_tstep=1,
        diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True, lr=1e-3,
    )
    init_distributed(0, 1, "gloo", free_port())
    try:
        samples, metrics, before, after = rollout_and_train_step(args, ["a red cube", "two cats"], 2, [0, 1], seed=5)
    finally:
        dist.destroy_process_group()
    assert samples[0].clean_latents.shape == (2 * 8 * 8 * 8 + 5 * 4,)
    assert set(samples[0].conditioning) == {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}
    # The LTX-2 DiT's fp32 output moves by an ulp with the forward's batch size (the trainer's micro-batches are not
    # the rollout's batch); --parity-forward-tile is the bit-exact mode.
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert before and not any(is_ltx2_audio_parameter(name.removeprefix("transformer.")) for name in before)
    assert "transformer.proj_out.weight" in before
    assert not torch.equal(before["transformer.proj_out.weight"], after["transformer.proj_out.weight"])


def test_make_tiny_ltx_variants(tmp_path):
    with pytest.raises(ValueError, match="no tiny ltx variant 'ltx3'; one of ltx-video, ltx2"):
        build_tiny_pipeline("ltx", str(tmp_path / "x"), variant="ltx3")


def test_the_engine_serves_a_cps_request_with_the_reference_loops_frames(path):
    """What the rewards receive: the engine's uint8 frames [F, H, W, 3] for an LTX-2 request with CPS steps, equal
    to the reference loop's with the same kernel; the log-probs of the CPS steps come back finite."""
    from miles.diffusion.sde import build_sde_backend
    from miles.engine.model_runner import ModelRunner
    from miles.engine.protocol import GenerateRequest
    from miles.engine.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=path, model_family="ltx", device="cpu", dtype="fp32",
                                    generator_device="cpu"))
    request = GenerateRequest(prompt=PROMPTS[1], num_samples=1, seed=SEEDS[1], num_steps=3, height=SHAPE.height,
                              width=SHAPE.width, num_frames=SHAPE.num_frames, fps=SHAPE.fps, guidance=NO_CFG,
                              sde_type="cps", noise_level=0.7, sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2],
                              request_id="ltx2")
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    sample = runner.finish(trajectory).samples[0]
    assert sample.image.dtype == torch.uint8 and sample.image.shape == (5, 32, 32, 3)
    assert sample.rollout_log_probs.shape == (2,) and torch.isfinite(sample.rollout_log_probs).all()
    assert set(sample.conditioning) == {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}

    family = get_family_class("ltx")()  # the engine's text length: the pipeline default (1024 Gemma tokens)
    pipe = family.load_pipeline(path, torch.float32)
    reference = sample_reference(family, pipe, [PROMPTS[1]], seeds=[SEEDS[1]], num_steps=3, shape=SHAPE,
                                 guidance=NO_CFG, sde_backend=build_sde_backend("cps", 0.7, False),
                                 sde_step_indices=[0, 1])
    assert torch.equal(sample.image, reference.images[0])
    torch.testing.assert_close(sample.rollout_log_probs, torch.stack(reference.log_probs)[:, 0], atol=1e-6, rtol=0)
