"""Wan 2.1 T2V (1.3B / 14B) as the `wan2_2` family's single-expert layout, on its tiny checkpoint
(`make_tiny --family wan2_2 --variant wan2_1`): resolution from the checkpoint, the layout, parity with
`WanPipeline.__call__`, decode, SFT encoding, and a rollout + train step."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.wan2_2 import Wan22TrainPipelineConfig
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5)  # latents [16, 2, 4, 4] (8x spatial, 4x temporal)
PROMPTS = ["a cat", "a red dog sitting in the park at night"]
SEEDS = [3, 11]
CFG = GuidanceConfig(guidance_scale=5.0)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("wan2_2", str(tmp_path_factory.mktemp("t2v") / "tiny-t2v"), variant="wan2_1")


def load(path, euler: bool):
    """The family and its pipeline; `euler` swaps in flow-match Euler with the checkpoint's shift, so that
    diffusers' loop takes the same Euler steps as ours (the published UniPC solver is multistep)."""
    family = get_family_class("wan2_2")()
    pipe = family.load_pipeline(path, torch.float32)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return family, pipe


@pytest.fixture(scope="module")
def loaded(path):
    return load(path, euler=True)


def diffusers_frames(pipe, guidance_scale, num_steps, output_type):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=" ",
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=generators_from_seeds(SEEDS),
        output_type=output_type,
        max_sequence_length=512,
    ).frames


def ours(family, pipe, guidance, num_steps, decode=False, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
                            negative_prompt=" ", decode=decode, **kwargs)


def test_the_checkpoint_resolves_to_wan2_2_and_reads_as_wan2_1(path, loaded):
    with open(f"{path}/model_index.json") as f:
        index = json.load(f)
    assert index["_class_name"] == "WanPipeline"
    assert not {"transformer_2", "boundary_ratio", "expand_timesteps"} & set(index)  # the pre-Wan 2.2 format
    assert resolve_family_name(path, None) == "wan2_2"  # from model_index.json: the name has no hint
    for name in ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "/ckpt/wan2_1-ft"):
        assert resolve_family_name(name, None) == "wan2_2"
    config = build_train_pipeline_config(**dict(
        hf_checkpoint=path, diffusion_model_family=None, train_pipeline_config_path=None, model_backend_path=None))
    assert isinstance(config, Wan22TrainPipelineConfig)

    family, pipe = loaded
    assert family.layout == "wan2_1" and family.trainable_modules == ("transformer",)
    assert family.boundary_ratio is None and not family.expand_timesteps and pipe.transformer_2 is None
    assert pipe.vae.config.z_dim == 16 and pipe.vae_scale_factor_spatial == 8 and pipe.vae_scale_factor_temporal == 4
    assert family.expert_for(1.0) == family.expert_for(0.01) == "transformer"

    trainer_family = get_family_class("wan2_2")()  # the trainer reads the layout from model_index.json alone
    modules = trainer_family.load_modules(path, ["transformer"], torch.float32)
    assert trainer_family.layout == "wan2_1" and trainer_family.trainable_modules == ("transformer",)
    assert all(torch.equal(p, q) for p, q in zip(modules["transformer"].parameters(), pipe.transformer.parameters()))
    with pytest.raises(MilesUserError, match=r"single-expert \(Wan 2.1 T2V"):
        get_family_class("wan2_2")().load_modules(path, ["transformer", "transformer_2"], torch.float32)


def test_an_index_with_the_wan22_entries_unset_reads_as_wan2_1_too(path, tmp_path):
    listed = tmp_path / "listed"
    shutil.copytree(path, listed)
    index = json.loads((listed / "model_index.json").read_text())
    index.update(transformer_2=[None, None], boundary_ratio=None, expand_timesteps=False)  # as diffusers 0.42 saves it
    (listed / "model_index.json").write_text(json.dumps(index))
    family = get_family_class("wan2_2")()
    family.load_modules(str(listed), ["transformer"], torch.float32)
    assert family.layout == "wan2_1" and family.trainable_modules == ("transformer",)


def test_a_wan_folder_of_another_pipeline_is_refused_before_loading(path, tmp_path):
    i2v = tmp_path / "Wan2.1-I2V-14B-480P-Diffusers"
    shutil.copytree(path, i2v)
    index = json.loads((i2v / "model_index.json").read_text())
    index["_class_name"] = "WanImageToVideoPipeline"
    (i2v / "model_index.json").write_text(json.dumps(index))
    assert resolve_family_name(str(i2v), None) == "wan2_2"  # an unknown pipeline class: the name hint decides
    family = get_family_class("wan2_2")()
    for load_it in (lambda: family.load_pipeline(str(i2v), torch.float32),
                    lambda: family.load_modules(str(i2v), ["transformer"], torch.float32)):
        with pytest.raises(MilesUserError, match="holds a WanImageToVideoPipeline; the wan2_2 family supports WanPipeline"):
            load_it()


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])
def test_ode_loop_matches_diffusers_with_one_timestep_per_sample(loaded, guidance_scale):
    family, pipe = loaded
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True)
    try:
        out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 3)
    finally:
        hook.remove()
    batch = 4 if guidance_scale > 1 else 2  # CFG: one doubled batch [negatives; positives]
    assert len(seen) == 3 and seen[0].shape == (batch,) and seen[0].dtype == torch.float32
    for k, t in enumerate(seen):
        torch.testing.assert_close(t, torch.full((batch,), float(out.sigmas[k]) * 1000.0))
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 16, 2, 4, 4)
    reference = diffusers_frames(pipe, guidance_scale, 3, "latent")
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_decoded_frames_match_diffusers(loaded):
    family, pipe = loaded
    out = ours(family, pipe, CFG, 2, decode=True)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    reference = torch.from_numpy(diffusers_frames(pipe, 5.0, 2, "np"))  # float [B, F, H, W, 3] in [0, 1]
    assert (out.images.float() - reference * 255).abs().max() <= 0.5 + 1e-3


def test_sigmas_are_the_checkpoints_unipc_grid(path):
    family, pipe = load(path, euler=False)
    pipe.scheduler.set_timesteps(8)
    sigmas = family.sigmas(pipe, 8, SHAPE, None)
    assert sigmas[0] == 1.0  # diffusers nudges it to 1 - 1e-6 for UniPC's log-SNR (docs/models.md, wan2_2)
    torch.testing.assert_close(sigmas[1:], pipe.scheduler.sigmas[1:].float(), atol=1e-7, rtol=0)


def test_encode_images_is_the_inverse_of_decode(loaded):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    family, pipe = loaded
    pixels = gradient_pixels(2, SHAPE.num_frames, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    with torch.no_grad():
        posterior = vae.encode(vae_input(pixels, video=True)).latent_dist.mode()
        expected_pixels = vae_output_to_uint8(vae.decode(posterior).sample)
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(view)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(view)
    latents = check_encode_images(family, pipe, SHAPE, pixels, (posterior - mean) * inverse_std, expected_pixels)
    assert latents.shape == (2, 16, 2, 4, 4)


def test_rollout_and_train_step(path):
    """A Flow-GRPO rollout of 5-frame videos and one LoRA train step on a one-rank gloo group: the trainer's
    velocities equal the rollout's bit for bit, and the step moves the adapters."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import rollout_and_train_step, tiny_trainer_config

    args = tiny_trainer_config(
        path, diffusion_output_num_frames=5, diffusion_num_steps=3, diffusion_guidance_scale=5.0, use_lora=True,
        micro_batch_size_sample=4, micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major",
        diffusion_debug_mode=True,
    )  # one micro-batch = the rollout's batch of 4 at one step, so the DiT sees the same batch
    init_distributed(0, 1, "gloo", free_port())
    try:
        samples, metrics, before, after = rollout_and_train_step(args, ["a red cube", "two cats"], 2, [0, 1], seed=5)
    finally:
        dist.destroy_process_group()
    assert samples[0].clean_latents.shape == (16, 2, 4, 4) and samples[0].conditioning["prompt_embeds"].shape == (8, 32)
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    lora_b = [name for name in before if "lora_B" in name]
    assert lora_b and all(name.startswith("transformer.") for name in before)
    assert any(not torch.equal(before[name], after[name]) for name in lora_b)


def test_make_tiny_variants_are_checked(tmp_path):
    with pytest.raises(ValueError, match="no tiny wan2_2 variant 'wan2_3'; one of a14b, ti2v_5b, wan2_1"):
        build_tiny_pipeline("wan2_2", str(tmp_path / "x"), variant="wan2_3")
    with pytest.raises(ValueError, match="no tiny cosmos3 variant 'wan2_1'; it has none"):
        build_tiny_pipeline("cosmos3", str(tmp_path / "y"), variant="wan2_1")
