"""Cosmos 3 family on its tiny checkpoint, text-to-image and text-to-video: load, encode (token ids), denoise,
decode, SFT encoding, parity with `Cosmos3OmniPipeline.__call__` (which generates one sample per call), and a
rollout + train step on a video."""

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

SHAPE = GenerationShape(height=64, width=64, num_frames=1)  # the tiny VAE is 16x: latents [48, 1, 4, 4]
VIDEO = GenerationShape(height=64, width=32, num_frames=5, fps=16.0)  # latents [48, 2, 4, 2]; fps ≠ 24
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


def ours(family, pipe, guidance, num_steps, decode=False, shape=SHAPE, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=shape,
                            guidance=guidance, negative_prompt=" ", decode=decode, **kwargs)


def test_encode_prompt_is_padded_token_ids_of_the_pipelines_templates(loaded):
    family, pipe = loaded
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=SHAPE)
    assert set(cond) == {"input_ids", "input_ids_length", "negative_input_ids", "negative_input_ids_length",
                         "encoded_shape"}
    assert cond["input_ids"].shape == (2, 1024) and cond["input_ids"].dtype == torch.long
    for b, prompt in enumerate(PROMPTS):
        expected, expected_negative = pipe.tokenize_prompt(prompt, " ", num_frames=1, height=64, width=64)
        assert cond["input_ids_length"][b] == len(expected)
        assert cond["input_ids"][b, : len(expected)].tolist() == expected
        assert cond["negative_input_ids"][b, : len(expected_negative)].tolist() == expected_negative
    text = pipe.text_tokenizer.decode(cond["input_ids"][0, : cond["input_ids_length"][0]])
    assert "This image is of 64x64 resolution." in text and text.endswith("<|vision_start|>")
    negative = pipe.text_tokenizer.decode(cond["negative_input_ids"][0, : cond["negative_input_ids_length"][0]])
    assert "This image is not of 64x64 resolution." in negative
    assert cond["encoded_shape"].tolist() == [[64, 64, 1, 24000], [64, 64, 1, 24000]]
    assert set(family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0), shape=SHAPE)) == {
        "input_ids", "input_ids_length", "encoded_shape"}


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_loop_matches_diffusers_per_sample(loaded, guidance_scale):
    family, pipe = loaded
    out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 3)
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 48, 1, 4, 4)
    for b in range(2):
        reference = diffusers_one(pipe, b, guidance_scale, 3, "latent")
        torch.testing.assert_close(out.latents[b], reference.reshape(out.latents[b].shape), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_decoded_images_match_diffusers(loaded):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 64, 64, 3)
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
        family.predict_velocity(modules, latents, torch.ones(2), cond, CFG, GenerationShape(32, 64, 1), torch.float32)
    no_cfg = family.encode_prompt(pipe, PROMPTS, " ", GuidanceConfig(guidance_scale=1.0), shape=SHAPE)
    with pytest.raises(ValueError, match="negative_input_ids"):
        family.predict_velocity(modules, latents, torch.ones(2), no_cfg, CFG, SHAPE, torch.float32)
    with pytest.raises(MilesUserError, match=r"--diffusion-output-num-frames 6 must be 4·k \+ 1"):
        family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=GenerationShape(64, 64, 6))
    with pytest.raises(MilesUserError, match="the limit is 1024"):
        family.encode_prompt(pipe, ["x" * 1200], " ", CFG, shape=SHAPE)
    with pytest.raises(MilesUserError, match="multiples of 16"):
        family.prepare_latents(pipe, GenerationShape(72, 64, 1), generators_from_seeds([0]), torch.float32)


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
    assert batch.shape == (2, 48, 1, 4, 4) and torch.equal(batch[1], alone[0])
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith("self_attn." + target) for name in names), target
    assert family.context_parallel_plan(pipe.transformer) is None  # CP lives outside the model in diffusers


def test_sde_rollout_and_load_modules(loaded, path):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True,
               sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 64, 64, 3)
    assert len(out.log_probs) == 2 and all(torch.isfinite(lp).all() for lp in out.log_probs)
    trainer_family = get_family_class("cosmos3")()
    modules = trainer_family.load_modules(path, ["transformer"], torch.float32)
    assert trainer_family.vae_temporal_compression == 4  # read from vae/config.json: the trainer loads no VAE
    backend_family = get_family_class("cosmos3")(model_backend=lambda path, dtype: pipe)  # --model-backend-path
    assert backend_family.load_modules(path, ["transformer"], torch.float32)["transformer"] is pipe.transformer
    assert backend_family.vae_temporal_compression == 4
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


# ---- text-to-video ---------------------------------------------------------------------------------------


def diffusers_video(pipe, b, guidance_scale, num_steps, output_type, shape=VIDEO):
    return pipe(
        PROMPTS[b],
        negative_prompt=" ",
        height=shape.height,
        width=shape.width,
        num_frames=shape.num_frames,
        fps=shape.fps,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=generators_from_seeds([SEEDS[b]])[0],
        output_type=output_type,
    ).video


def capture_transformer_inputs(pipe, sink: list):
    """Every transformer call's keyword inputs except the noisy tokens (positions, indexes, timesteps, ids)."""
    def hook(module, args, kwargs):
        sink.append({key: value for key, value in kwargs.items() if key != "vision_tokens"})
    return pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def test_video_prompt_states_duration_fps_and_size(loaded):
    family, pipe = loaded
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=VIDEO)
    expected, expected_negative = pipe.tokenize_prompt(PROMPTS[0], " ", num_frames=5, height=64, width=32, fps=16.0)
    assert cond["input_ids"][0, : cond["input_ids_length"][0]].tolist() == expected
    assert cond["negative_input_ids"][0, : cond["negative_input_ids_length"][0]].tolist() == expected_negative
    text = pipe.text_tokenizer.decode(expected)
    assert "generate videos" in text  # the video system prompt
    assert "The video is 0.3 seconds long and is of 16 FPS. This video is of 64x32 resolution." in text
    assert cond["encoded_shape"].tolist() == [[64, 32, 5, 16000]] * 2


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_video_ode_loop_matches_diffusers_with_the_same_transformer_inputs(loaded, guidance_scale):
    family, pipe = loaded
    seen: list[dict] = []
    hook = capture_transformer_inputs(pipe, seen)
    try:
        out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 3, shape=VIDEO)
        ours_seen = seen[:]
        seen.clear()
        references = [diffusers_video(pipe, b, guidance_scale, 3, "latent") for b in range(2)]
    finally:
        hook.remove()
    assert out.latents.shape == (2, 48, 2, 4, 2)
    for b in range(2):
        torch.testing.assert_close(out.latents[b], references[b].reshape(out.latents[b].shape), atol=1e-5, rtol=0)
    # Sample 0, step 0: our (negative, positive) calls against diffusers' (cond, uncond); the fps-scaled float
    # positions of the 2 latent frames, the token indexes and the per-token timesteps are the same tensors.
    calls = 2 if guidance_scale > 1 else 1
    pairs = [(ours_seen[calls - 1], seen[0])] + ([(ours_seen[0], seen[1])] if calls == 2 else [])
    for mine, theirs in pairs:
        for key in ("input_ids", "text_indexes", "position_ids", "vision_sequence_indexes",
                    "vision_mse_loss_indexes", "vision_timesteps"):
            torch.testing.assert_close(mine[key], theirs[key], atol=0, rtol=0, msg=key)
        assert mine["vision_token_shapes"] == theirs["vision_token_shapes"] == [(2, 2, 1)]
        assert mine["und_len"] == theirs["und_len"] and mine["sequence_length"] == theirs["sequence_length"]
    frame_positions = ours_seen[0]["position_ids"][0, -4:]  # temporal axis of the 4 vision tokens (2 per frame)
    assert frame_positions.dtype == torch.float32 and frame_positions[2] - frame_positions[0] == 24 / 16  # base_fps/fps


def test_video_fps_changes_the_positions_and_mismatches_are_refused(loaded):
    family, pipe = loaded
    at_24 = GenerationShape(VIDEO.height, VIDEO.width, VIDEO.num_frames)  # fps None: the pipeline's 24
    first, second = ours(family, pipe, CFG, 1, shape=VIDEO), ours(family, pipe, CFG, 1, shape=at_24)
    assert not torch.allclose(first.latents, second.latents)
    latents = family.prepare_latents(pipe, VIDEO, generators_from_seeds(SEEDS), torch.float32)
    cond = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=VIDEO)
    modules = {"transformer": pipe.transformer}
    with pytest.raises(ValueError, match=r"encoded for \(height, width, frames, 1000·fps\) \[64, 32, 5, 16000\]"):
        family.predict_velocity(modules, latents, torch.ones(2), cond, CFG, at_24, torch.float32)
    nine = GenerationShape(64, 32, 9, 16.0)
    cond_nine = family.encode_prompt(pipe, PROMPTS, " ", CFG, shape=nine)
    with pytest.raises(ValueError, match=r"2 latent frames do not match .*-num-frames 9 \(the VAE compresses time 4x\)"):
        family.predict_velocity(modules, latents, torch.ones(2), cond_nine, CFG, nine, torch.float32)


def test_video_decodes_to_the_pipelines_uint8_frames(loaded):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True, shape=VIDEO)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 64, 32, 3)  # [B, F, H, W, 3]
    for b in range(2):
        reference = torch.from_numpy(np.asarray(diffusers_video(pipe, b, 4.0, 2, "np")))  # [F, H, W, 3] in [0, 1]
        assert (out.images[b].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_video_encode_images_is_the_pipelines_encode_video(loaded):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    family, pipe = loaded
    pixels = gradient_pixels(2, VIDEO.num_frames, VIDEO.height, VIDEO.width)
    with torch.no_grad():
        expected = pipe._encode_video(vae_input(pixels, video=True))  # the pipeline's own normalised posterior mode
        posterior = pipe.vae.encode(vae_input(pixels, video=True)).latent_dist.mode()
        expected_pixels = vae_output_to_uint8(pipe.vae.decode(posterior).sample)
    latents = check_encode_images(family, pipe, VIDEO, pixels, expected, expected_pixels)
    assert latents.shape == (2, 48, 2, 4, 2)
    with pytest.raises(MilesUserError, match="trains on video of 5 frame"):
        family.encode_images(pipe, gradient_pixels(1, 1, VIDEO.height, VIDEO.width), VIDEO)


def test_video_rollout_and_train_step(path):
    """A Flow-GRPO rollout of 5-frame videos and one LoRA train step on it, on a one-rank gloo group: the trainer's
    velocities equal the rollout's bit for bit, and the step moves the adapters."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import rollout_and_train_step, tiny_trainer_config

    args = tiny_trainer_config(
        path, diffusion_height=VIDEO.height, diffusion_width=VIDEO.width, diffusion_output_num_frames=5,
        diffusion_fps=VIDEO.fps, diffusion_num_steps=3, use_lora=True, micro_batch_size=2, diffusion_debug_mode=True,
    )
    init_distributed(0, 1, "gloo", free_port())
    try:
        samples, metrics, before, after = rollout_and_train_step(args, ["a red cube", "two cats"], 2, [0, 1], seed=5)
    finally:
        dist.destroy_process_group()
    assert samples[0].clean_latents.shape == (48, 2, 4, 2) and samples[0].conditioning["encoded_shape"].tolist() == [
        64, 32, 5, 16000]
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    lora_b = [name for name in before if "lora_B" in name]
    assert lora_b and any(not torch.equal(before[name], after[name]) for name in lora_b)


def test_the_engine_returns_the_reference_loops_uint8_frames_for_a_video_request(path):
    """What the rewards receive: the engine's frames for one video request, uint8 [F, H, W, 3], equal to the
    reference loop's (same seed, the checkpoint's own UniPC grid, Euler steps)."""
    from miles.engine.model_runner import ModelRunner
    from miles.engine.protocol import GenerateRequest
    from miles.engine.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=path, model_family="cosmos3", device="cpu", dtype="fp32",
                                    generator_device="cpu"))
    request = GenerateRequest(prompt=PROMPTS[1], negative_prompt=" ", num_samples=1, seed=SEEDS[1], num_steps=2,
                              height=VIDEO.height, width=VIDEO.width, num_frames=VIDEO.num_frames, fps=VIDEO.fps,
                              guidance=CFG, request_id="video")
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    frames = runner.finish(trajectory).samples[0].image
    assert frames.dtype == torch.uint8 and frames.shape == (5, 64, 32, 3)
    family, pipe = load(path, euler=False)
    reference = sample_reference(family, pipe, [PROMPTS[1]], seeds=[SEEDS[1]], num_steps=2, shape=VIDEO,
                                 guidance=CFG, negative_prompt=" ")
    assert torch.equal(frames, reference.images[0])
