"""FLUX.2 family on its tiny checkpoint (`make_tiny --family flux2`): resolution from the checkpoint, parity with
`Flux2Pipeline.__call__`, decode, SFT encoding, the empirical-μ schedule, and a rollout + train step."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.flux2 import Flux2TrainPipelineConfig, empirical_mu, patch_latents, unpatch_latents
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32)  # latents [4, 8, 8] -> 4x4 tokens of 16 channels
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
GUIDANCE = GuidanceConfig(guidance_scale=4.0)  # the distilled guidance embedding (diffusers' default)
TEXT_LENGTH = 24


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("flux2", str(tmp_path_factory.mktemp("f2") / "tiny-mmdit"))


@pytest.fixture(scope="module")
def family():
    family = get_family_class("flux2")()
    family.max_sequence_length = TEXT_LENGTH
    return family


@pytest.fixture(scope="module")
def pipe(family, path):
    return family.load_pipeline(path, torch.float32)


def diffusers_images(pipe, guidance_scale, num_steps, output_type):
    return pipe(
        prompt=PROMPTS,
        height=SHAPE.height,
        width=SHAPE.width,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=TEXT_LENGTH,
    ).images


def ours(family, pipe, num_steps, guidance=GUIDANCE, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
                            **kwargs)


def test_the_checkpoint_resolves_to_flux2(path, pipe):
    assert resolve_family_name(path, None) == "flux2"  # from model_index.json: the name has no hint
    for name in ("black-forest-labs/FLUX.2-dev", "/ckpt/flux2-ft", "my-flux-2"):
        assert resolve_family_name(name, None) == "flux2"
    assert resolve_family_name("black-forest-labs/FLUX.1-dev", None) == "flux"
    config = build_train_pipeline_config(**dict(
        hf_checkpoint=path, diffusion_model_family=None, train_pipeline_config_path=None, model_backend_path=None))
    assert isinstance(config, Flux2TrainPipelineConfig)
    trainer_side = get_family_class("flux2")()
    modules = trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert trainer_side.vae_scale_factor == pipe.vae_scale_factor == 4
    loaded = dict(modules["transformer"].named_parameters())
    assert all(torch.equal(loaded[name], param) for name, param in pipe.transformer.named_parameters())


def test_encode_prompt_stacks_three_hidden_layers(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, None, GUIDANCE)
    assert set(cond) == {"prompt_embeds"} and cond["prompt_embeds"].shape == (2, TEXT_LENGTH, 3 * 16)
    with pytest.raises(MilesUserError, match="--diffusion-true-cfg-scale 3: FLUX.2 is guidance-distilled"):
        family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=4.0, true_cfg_scale=3.0))


@pytest.mark.parametrize("guidance_scale", [4.0, 2.5])
def test_ode_loop_matches_diffusers_latents(family, pipe, guidance_scale):
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["guidance"].clone()), with_kwargs=True)
    try:
        out = ours(family, pipe, 3, GuidanceConfig(guidance_scale=guidance_scale), decode=False)
    finally:
        hook.remove()
    reference = diffusers_images(pipe, guidance_scale, 3, "latent")
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 16, 16)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    assert torch.equal(seen[0], torch.full((2,), guidance_scale))


def test_decoded_images_match_diffusers(family, pipe):
    out = ours(family, pipe, 2)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 1, 32, 32, 3)
    reference = torch.from_numpy(np.asarray(diffusers_images(pipe, 4.0, 2, "np")))
    assert (out.images[:, 0].float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_sigmas_use_the_empirical_mu_and_the_flow_shift_override(family, pipe):
    sigmas = family.sigmas(pipe, 6, SHAPE, None)
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=empirical_mu(16, 6))
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    assert empirical_mu(5000, 6) == empirical_mu(5000, 50)  # above 4300 tokens the step count does not matter
    assert empirical_mu(1000, 6) != empirical_mu(1000, 50)
    static = family.sigmas(pipe, 6, SHAPE, 1.0)
    torch.testing.assert_close(static[:-1], torch.linspace(1.0, 1 / 6, 6), atol=1e-6, rtol=0)


def test_noise_is_drawn_patched_per_sample_and_patches_roundtrip(family, pipe):
    batch = family.prepare_latents(pipe, SHAPE, generators_from_seeds([5, 6]), torch.float32)
    alone = family.prepare_latents(pipe, SHAPE, generators_from_seeds([6]), torch.float32)
    assert batch.shape == (2, 16, 16) and torch.equal(batch[1], alone[0])
    noise = torch.randn((1, 16, 4, 4), generator=torch.Generator().manual_seed(6))
    assert torch.equal(alone, noise.flatten(2).transpose(1, 2))
    latents = torch.randn(2, 4, 8, 6)
    assert torch.equal(unpatch_latents(patch_latents(latents)), latents)
    assert torch.equal(patch_latents(latents), pipe._patchify_latents(latents))


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    pixels = gradient_pixels(2, 1, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=False)).latent_dist.mode()
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample)
        expected = pipe._pack_latents(pipe._encode_vae_image(vae_input(pixels, video=False), None))
    check_encode_images(family, pipe, SHAPE, pixels, expected, expected_pixels)
    with pytest.raises(MilesUserError, match="multiples of 8"):
        family.encode_images(pipe, gradient_pixels(1, 1, 36, 32), GenerationShape(36, 32))


def test_lora_targets_reach_both_block_kinds(family, pipe):
    names = [name for name, _ in pipe.transformer.named_modules()]
    for target in family.default_lora_target_modules:
        assert any(name.endswith(target) for name in names), target
    assert any(name.startswith("single_transformer_blocks") and name.endswith("to_qkv_mlp_proj") for name in names)


def test_rollout_and_train_step(path):
    """A Flow-GRPO rollout and one LoRA train step on a one-rank gloo group: the trainer's velocities equal the
    rollout's, and the step moves the adapters."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import rollout_and_train_step, tiny_trainer_config

    args = tiny_trainer_config(
        path, diffusion_num_steps=3, diffusion_guidance_scale=4.0, use_lora=True, micro_batch_size_sample=4,
        micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major", diffusion_debug_mode=True,
    )
    init_distributed(0, 1, "gloo", free_port())
    try:
        samples, metrics, before, after = rollout_and_train_step(args, ["a red cube", "two cats"], 2, [0, 1], seed=5)
    finally:
        dist.destroy_process_group()
    assert samples[0].clean_latents.shape == (16, 16) and samples[0].conditioning["prompt_embeds"].shape == (8, 48)
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    lora_b = [name for name in before if "lora_B" in name]
    assert any("single_transformer_blocks" in name for name in lora_b)
    assert any(not torch.equal(before[name], after[name]) for name in lora_b)


def test_the_engine_returns_the_reference_loops_images(path):
    """What the rewards receive: the engine's uint8 image for one request equals the reference loop's."""
    from miles.engine.model_runner import ModelRunner
    from miles.engine.protocol import GenerateRequest
    from miles.engine.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=path, model_family="flux2", device="cpu", dtype="fp32",
                                    generator_device="cpu"))
    request = GenerateRequest(prompt=PROMPTS[1], num_samples=1, seed=SEEDS[1], num_steps=2, height=SHAPE.height,
                              width=SHAPE.width, guidance=GUIDANCE, request_id="flux2")
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    image = runner.finish(trajectory).samples[0].image
    assert image.dtype == torch.uint8 and image.shape == (1, 32, 32, 3)
    family = get_family_class("flux2")()  # the engine's text length: the pipeline default, 512 tokens
    pipe = family.load_pipeline(path, torch.float32)
    reference = sample_reference(family, pipe, [PROMPTS[1]], seeds=[SEEDS[1]], num_steps=2, shape=SHAPE,
                                 guidance=GUIDANCE)
    assert torch.equal(image, reference.images[0])
