"""Wan 2.2 family on its tiny checkpoints (dual-expert A14B and single-expert TI2V 5B layouts): load, encode,
denoise, decode, the expert switch, and parity with `WanPipeline.__call__`."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.diffusion.schedules import flow_match_sigmas
from miles.diffusion.sde import DiffusersSdeStepBackend
from miles.models import get_family_class
from miles.models.base import GenerationShape
from miles.models.common import generators_from_seeds
from miles.testing.reference_loop import sample_reference
from miles.testing.tiny import wan2_2 as tiny_wan
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
DUAL = GuidanceConfig(guidance_scale=4.0, guidance_scale_2=2.0)


@pytest.fixture(scope="module")
def path_a14b(tiny_checkpoint):
    return tiny_checkpoint("wan2_2")


@pytest.fixture(scope="module")
def path_5b(tmp_path_factory):
    return tiny_wan.build(str(tmp_path_factory.mktemp("tiny-wan2_2-5b")), seed=0, variant="ti2v_5b")


def load(path, euler: bool):
    """A family object and its pipeline; `euler` swaps in flow-match Euler so that diffusers' own loop takes
    the same Euler steps as ours (the published UniPC solver is multistep, which no RL step reproduces)."""
    family = get_family_class("wan2_2")()
    pipe = family.load_pipeline(path, torch.float32)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return family, pipe


@pytest.fixture(scope="module")
def a14b(path_a14b):
    return load(path_a14b, euler=True)


@pytest.fixture(scope="module")
def ti2v(path_5b):
    return load(path_5b, euler=True)


def diffusers_frames(pipe, guidance, num_steps, output_type):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=" ",
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        num_inference_steps=num_steps,
        guidance_scale=guidance.guidance_scale,
        guidance_scale_2=guidance.guidance_scale_2,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=512,
    ).frames


def ours(family, pipe, guidance, num_steps, decode=False, **kwargs):
    return sample_reference(
        family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
        negative_prompt=" ", decode=decode, **kwargs,
    )


def count_calls(module, sink: list):
    return module.register_forward_pre_hook(lambda m, args, kwargs: sink.append(kwargs["timestep"].clone()),
                                            with_kwargs=True)


def test_layouts_trainable_modules_and_cp_plan(a14b, ti2v):
    family, pipe = a14b
    assert family.trainable_modules == ("transformer", "transformer_2") and family.boundary_ratio == 0.875
    five_b, pipe_5b = ti2v
    assert five_b.trainable_modules == ("transformer",) and five_b.boundary_ratio is None and five_b.expand_timesteps
    assert pipe_5b.transformer_2 is None
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    plan = family.context_parallel_plan(pipe.transformer)
    assert plan is type(pipe.transformer)._cp_plan and "blocks.0" in plan


def test_encode_prompt_fixed_length_padding_zeroed(a14b):
    family, pipe = a14b
    cond = family.encode_prompt(pipe, PROMPTS, " ", DUAL)
    assert set(cond) == {"prompt_embeds", "negative_prompt_embeds"}
    assert cond["prompt_embeds"].shape == (2, 512, 32) == cond["negative_prompt_embeds"].shape
    assert torch.equal(cond["negative_prompt_embeds"][0], cond["negative_prompt_embeds"][1])
    tokens = len(pipe.tokenizer("a cat").input_ids)
    assert cond["prompt_embeds"][0, tokens:].abs().max() == 0 and cond["prompt_embeds"][0, :tokens].abs().max() > 0
    # guidance_scale_2 alone still asks for negatives (the low-noise phase uses them)
    only_low = family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0, guidance_scale_2=3.0))
    assert "negative_prompt_embeds" in only_low
    assert set(family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))) == {"prompt_embeds"}


def test_dual_expert_ode_loop_matches_diffusers_latents(a14b):
    family, pipe = a14b
    high, low = [], []
    hooks = [count_calls(pipe.transformer, high), count_calls(pipe.transformer_2, low)]
    try:
        out = ours(family, pipe, DUAL, num_steps=4)
    finally:
        for hook in hooks:
            hook.remove()
    # sigmas 1.0 | 0.858, 0.602, 0.009: one high-noise step, then the low-noise expert
    assert len(high) == 1 and len(low) == 3
    reference = diffusers_frames(pipe, DUAL, 4, "latent")
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 16, 2, 4, 4)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_guidance_scale_2_changes_only_the_low_noise_phase(a14b):
    family, pipe = a14b
    other = GuidanceConfig(guidance_scale=4.0, guidance_scale_2=6.0)
    first, second = ours(family, pipe, DUAL, 4), ours(family, pipe, other, 4)
    assert torch.equal(first.trajectory[1], second.trajectory[1])  # the high-noise step used scale 4 in both
    assert not torch.allclose(first.trajectory[2], second.trajectory[2])
    torch.testing.assert_close(second.latents, diffusers_frames(pipe, other, 4, "latent"), atol=1e-5, rtol=0)


def test_decoded_frames_match_diffusers(a14b):
    family, pipe = a14b
    out = ours(family, pipe, DUAL, num_steps=2, decode=True)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    reference = torch.from_numpy(diffusers_frames(pipe, DUAL, 2, "np"))  # float [B, F, H, W, 3] in [0, 1]
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_timestep_convention_reaches_both_experts_as_1000_sigma(a14b):
    family, pipe = a14b
    ours_seen, theirs = [], []
    for sink, run in ((ours_seen, lambda: ours(family, pipe, DUAL, 3)),
                      (theirs, lambda: diffusers_frames(pipe, DUAL, 3, "latent"))):
        hooks = [count_calls(pipe.transformer, sink), count_calls(pipe.transformer_2, sink)]
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
    sigmas = family.sigmas(pipe, 3, SHAPE, None)
    assert len(ours_seen) == 3
    for k, t in enumerate(ours_seen):
        assert t.dtype == torch.float32 and t.shape == (4,)  # CFG doubled batch, one timestep per sample
        torch.testing.assert_close(t, torch.full((4,), float(sigmas[k]) * 1000.0))
    # diffusers runs cond and uncond as two calls with the same timestep
    for k, t in enumerate(ours_seen):
        torch.testing.assert_close(t[:2], theirs[2 * k], atol=0, rtol=0)


def test_expert_switch_at_the_boundary_and_mixed_batches_refused(a14b):
    family, pipe = a14b
    assert family.expert_for(1.0) == "transformer" and family.expert_for(0.875) == "transformer"
    assert family.expert_for(0.8749) == "transformer_2" and family.expert_for(0.0) == "transformer_2"
    modules = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    cond = family.encode_prompt(pipe, PROMPTS, " ", DUAL)
    latents = family.prepare_latents(pipe, SHAPE, generators_from_seeds(SEEDS), torch.float32)
    with pytest.raises(ValueError, match="mixes expert phases"):
        family.predict_velocity(modules, latents, torch.tensor([0.9, 0.5]), cond, DUAL, SHAPE, torch.float32)
    with pytest.raises(ValueError, match="transformer_2"):
        family.predict_velocity({"transformer": pipe.transformer}, latents, torch.tensor([0.5, 0.5]), cond, DUAL,
                                SHAPE, torch.float32)
    # the low-noise phase combines transformer_2's branches with guidance_scale_2
    v = family.predict_velocity(modules, latents, torch.tensor([0.5, 0.5]), cond, DUAL, SHAPE, torch.float32)
    kwargs = dict(hidden_states=latents, timestep=torch.tensor([500.0, 500.0]), return_dict=False)
    v_pos = pipe.transformer_2(encoder_hidden_states=cond["prompt_embeds"], **kwargs)[0]
    v_neg = pipe.transformer_2(encoder_hidden_states=cond["negative_prompt_embeds"], **kwargs)[0]
    torch.testing.assert_close(v, v_neg + 2.0 * (v_pos - v_neg), atol=1e-5, rtol=0)


def test_single_expert_5b_matches_diffusers_with_per_token_timesteps(ti2v):
    family, pipe = ti2v
    guidance = GuidanceConfig(guidance_scale=4.0)
    seen: list[torch.Tensor] = []
    hook = count_calls(pipe.transformer, seen)
    try:
        out = ours(family, pipe, guidance, num_steps=3)
    finally:
        hook.remove()
    assert out.latents.shape == (2, 48, 2, 2, 2)
    # per-token timesteps [2B, F·(H/2)·(W/2)], all equal to 1000·σ_k
    assert seen[0].shape == (4, 2) and torch.all(seen[0] == 1000.0)
    torch.testing.assert_close(seen[1], torch.full((4, 2), float(out.sigmas[1]) * 1000.0))
    torch.testing.assert_close(out.latents, diffusers_frames(pipe, guidance, 3, "latent"), atol=1e-5, rtol=0)
    assert family.expert_for(0.1) == "transformer"


def test_sigmas_follow_the_checkpoints_unipc_flow_grid(path_a14b):
    family, pipe = load(path_a14b, euler=False)
    pipe.scheduler.set_timesteps(10)
    sigmas = family.sigmas(pipe, 10, SHAPE, None)
    # the scheduler's grid, except that its first sigma is exactly 1 (diffusers nudges it to 1 - 1e-6 for UniPC)
    assert sigmas[0] == 1.0 and abs(float(pipe.scheduler.sigmas[0]) - (1.0 - 1e-6)) < 1e-7
    torch.testing.assert_close(sigmas[1:], pipe.scheduler.sigmas[1:].float(), atol=1e-7, rtol=0)
    overridden = family.sigmas(pipe, 10, SHAPE, 1.0)
    torch.testing.assert_close(overridden[1:-1], torch.linspace(1.0, 0.001, 11, dtype=torch.float64)[1:-1].float())
    euler_family, euler_pipe = load(path_a14b, euler=True)
    torch.testing.assert_close(euler_family.sigmas(euler_pipe, 10, SHAPE, None), flow_match_sigmas(10, shift=3.0))


def test_prepare_latents_per_sample_generators_and_size_errors(a14b):
    family, pipe = a14b
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert batch.shape == (2, 16, 2, 4, 4) and batch.dtype == torch.float32
    assert torch.equal(batch[1], alone[0])
    with pytest.raises(MilesUserError, match="--diffusion-output-num-frames 4"):
        family.prepare_latents(pipe, GenerationShape(32, 32, 4), generators_from_seeds([0]), torch.float32)
    with pytest.raises(MilesUserError, match="multiples of 16"):
        family.prepare_latents(pipe, GenerationShape(40, 32, 5), generators_from_seeds([0]), torch.float32)


def test_sde_rollout_decodes_uint8_video(a14b):
    family, pipe = a14b
    out = ours(family, pipe, DUAL, num_steps=2, decode=True,
               sde_backend=DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False))
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    assert len(out.log_probs) == 2 and all(torch.isfinite(lp).all() for lp in out.log_probs)


def test_load_modules_both_experts_and_5b_refuses_transformer_2(path_a14b, path_5b, a14b):
    _, pipe = a14b
    family = get_family_class("wan2_2")()
    modules = family.load_modules(path_a14b, ["transformer", "transformer_2"], torch.float32)
    assert family.boundary_ratio == 0.875
    loaded = dict(modules["transformer_2"].named_parameters())
    for name, param in pipe.transformer_2.named_parameters():
        assert torch.equal(loaded[name], param), name
    five_b = get_family_class("wan2_2")()
    with pytest.raises(MilesUserError, match="single-expert"):
        five_b.load_modules(path_5b, ["transformer", "transformer_2"], torch.float32)
    with pytest.raises(MilesUserError, match="no transformer_2"):
        five_b.configure(0.875, False, has_transformer_2=False)


def test_unsupported_schedulers_are_user_errors():
    from diffusers import DDIMScheduler, UniPCMultistepScheduler

    from miles.models.wan2_2 import flow_sigmas_for_scheduler, unipc_flow_sigmas

    with pytest.raises(MilesUserError, match="DDIMScheduler is not supported"):
        flow_sigmas_for_scheduler(DDIMScheduler(), 4, None)
    with pytest.raises(MilesUserError, match="use_flow_sigmas=False"):
        flow_sigmas_for_scheduler(UniPCMultistepScheduler(), 4, None)
    with pytest.raises(MilesUserError, match="use_karras_sigmas"):
        unipc_flow_sigmas({"use_flow_sigmas": True, "use_karras_sigmas": True}, 4, None)
    sigma_min_terminal = unipc_flow_sigmas({"use_flow_sigmas": True, "final_sigmas_type": "sigma_min"}, 4, 2.0)
    assert sigma_min_terminal[-1] == sigma_min_terminal[-2] > 0


def test_flow_grpo_step_zero_noise_is_eta_on_the_unipc_grid(path_a14b):
    # docs/algorithms.md §2: with sigma_0 = 1 exactly, the 'sde' kind's first step has std = eta; diffusers' 1 - 1e-6
    # nudge would make it ~1000x larger.
    family, pipe = load(path_a14b, euler=False)
    sigmas = family.sigmas(pipe, 10, SHAPE, None)
    backend = DiffusersSdeStepBackend(noise_level=0.7, log_prob_no_const=False)
    latents = torch.zeros(1, 4)
    _, std, _ = backend.mean_std(latents, latents, sigmas[0].expand(1), sigmas[1].expand(1), float(sigmas[1]))
    torch.testing.assert_close(std, torch.tensor([0.7]))


@pytest.mark.parametrize("layout", ["a14b", "ti2v"])
def test_encode_images_is_the_inverse_of_decode(layout, request):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    family, pipe = request.getfixturevalue(layout)
    pixels = gradient_pixels(2, SHAPE.num_frames, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()  # the i2v pipeline's "argmax"
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample)
    # WanImageToVideoPipeline.prepare_latents' normalisation.
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(view)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view)
    check_encode_images(family, pipe, SHAPE, pixels, (posterior - mean) * inverse_std, expected_pixels)
    with pytest.raises(MilesUserError, match="trains on video of 5 frame"):
        family.encode_images(pipe, gradient_pixels(1, 3, SHAPE.height, SHAPE.width), SHAPE)
