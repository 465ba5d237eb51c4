"""HunyuanVideo-1.5 family on its tiny checkpoint (`make_tiny --family hunyuan_video`): resolution from the
checkpoint, parity with `HunyuanVideo15Pipeline.__call__` (with and without CFG), decode, SFT encoding, and a
rollout + train step."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from miles.models import get_family_class, resolve_family_name
from miles.models.base import GenerationShape
from miles.models.common import build_train_pipeline_config, generators_from_seeds
from miles.models.hunyuan_video import HunyuanVideoTrainPipelineConfig
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.reference_loop import sample_reference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

SHAPE = GenerationShape(height=32, width=32, num_frames=5)  # latents [4, 3, 8, 8] (4x spatial, 2x temporal)
PROMPTS = ["a cat", 'a red sign saying "open late" in the rain']  # the second one reaches the ByT5 glyph encoder
SEEDS = [3, 11]
CFG = GuidanceConfig(guidance_scale=6.0)
GLYPH_LENGTH = 32  # ByT5 tokens (the pipeline's 256 would only make the tiny test slower)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # A folder name without a family hint: the family must come from model_index.json.
    return build_tiny_pipeline("hunyuan_video", str(tmp_path_factory.mktemp("hy") / "tiny-t2v"))


@pytest.fixture(scope="module")
def family():
    family = get_family_class("hunyuan_video")()
    family.glyph_sequence_length = GLYPH_LENGTH
    return family


@pytest.fixture(scope="module")
def pipe(family, path):
    pipe = family.load_pipeline(path, torch.float32)
    pipe.tokenizer_2_max_length = GLYPH_LENGTH
    return pipe


def diffusers_latents(pipe, guidance_scale, num_steps):
    from diffusers.guiders import ClassifierFreeGuidance

    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)  # the pipeline's CFG scale lives here
    return pipe(
        prompt=PROMPTS,
        height=SHAPE.height,
        width=SHAPE.width,
        num_frames=SHAPE.num_frames,
        num_inference_steps=num_steps,
        generator=generators_from_seeds(SEEDS),
        output_type="latent",  # diffusers 0.42's VAE cannot decode a batch of 2 (see the family's decode)
    ).frames


def ours(family, pipe, guidance, num_steps, **kwargs):
    return sample_reference(family, pipe, PROMPTS, seeds=SEEDS, num_steps=num_steps, shape=SHAPE, guidance=guidance,
                            **kwargs)


def test_the_checkpoint_resolves_to_hunyuan_video(path, pipe):
    assert resolve_family_name(path, None) == "hunyuan_video"  # from model_index.json: the name has no hint
    assert resolve_family_name("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", None) == "hunyuan_video"
    config = build_train_pipeline_config(**dict(
        hf_checkpoint=path, diffusion_model_family=None, train_pipeline_config_path=None, model_backend_path=None))
    assert isinstance(config, HunyuanVideoTrainPipelineConfig)
    trainer_side = get_family_class("hunyuan_video")()
    modules = trainer_side.load_modules(path, ["transformer"], torch.float32)
    assert (trainer_side.spatial_ratio, trainer_side.temporal_ratio) == (4, 2)
    loaded = dict(modules["transformer"].named_parameters())
    assert all(torch.equal(loaded[name], param) for name, param in pipe.transformer.named_parameters())


@pytest.mark.parametrize("class_name", ["HunyuanVideo15ImageToVideoPipeline", "HunyuanVideoPipeline"])
def test_other_hunyuan_pipelines_are_refused_before_loading(path, tmp_path, class_name):
    folder = tmp_path / "hunyuanvideo-other"
    shutil.copytree(path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = class_name
    (folder / "model_index.json").write_text(json.dumps(index))
    assert resolve_family_name(str(folder), None) == "hunyuan_video"  # an unknown class: the name hint decides
    with pytest.raises(MilesUserError, match=f"holds a {class_name}; the hunyuan_video family supports"):
        get_family_class("hunyuan_video")().load_pipeline(str(folder), torch.float32)


def test_encode_prompt_keys_glyphs_and_negatives(family, pipe):
    cond = family.encode_prompt(pipe, PROMPTS, None, CFG)
    assert set(cond) == {f"{prefix}{key}" for prefix in ("", "negative_") for key in (
        "prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")}
    assert cond["prompt_embeds"].shape == (2, 1000, 16) and cond["prompt_embeds_2"].shape == (2, GLYPH_LENGTH, 32)
    assert cond["prompt_embeds_mask_2"][0].sum() == 0 and cond["prompt_embeds_mask_2"][1].sum() > 0  # quoted text
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])  # the prompt survives the crop
    assert set(family.encode_prompt(pipe, PROMPTS, None, GuidanceConfig(guidance_scale=1.0))) == {
        "prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"}


@pytest.mark.parametrize("guidance_scale", [6.0, 1.0])
def test_ode_loop_matches_diffusers(family, pipe, guidance_scale):
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True)
    try:
        out = ours(family, pipe, GuidanceConfig(guidance_scale=guidance_scale), 2, decode=False)
    finally:
        hook.remove()
    batch = 4 if guidance_scale > 1 else 2  # CFG: one doubled batch [negatives; positives]
    assert len(seen) == 2 and seen[0].shape == (batch,)
    torch.testing.assert_close(seen[1], torch.full((batch,), float(out.sigmas[1]) * 1000.0))
    reference = diffusers_latents(pipe, guidance_scale, 2)
    assert out.latents.dtype == torch.float32 and out.latents.shape == (2, 4, 3, 8, 8)
    torch.testing.assert_close(out.latents, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)


def test_decode_per_sample_matches_the_pipelines_decode(family, pipe):
    out = ours(family, pipe, CFG, 1)
    assert out.images.dtype == torch.uint8 and out.images.shape == (2, 5, 32, 32, 3)
    for b in range(2):
        with torch.no_grad():
            video = pipe.vae.decode(out.latents[b : b + 1] / pipe.vae.config.scaling_factor).sample
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
        assert (out.images[b].float() - torch.from_numpy(frames[0]) * 255).abs().max() <= 0.5 + 1e-3


def test_size_errors_name_the_flags(family, pipe):
    with pytest.raises(MilesUserError, match="--diffusion-output-num-frames 4 must be 2·k \\+ 1"):
        family.prepare_latents(pipe, GenerationShape(32, 32, 4), generators_from_seeds([0]), torch.float32)
    with pytest.raises(MilesUserError, match="multiples of 4"):
        family.prepare_latents(pipe, GenerationShape(34, 32, 5), generators_from_seeds([0]), torch.float32)


def test_a_guider_with_rescale_is_refused(path, tmp_path):
    folder = tmp_path / "rescaled"
    shutil.copytree(path, folder)
    config_path = folder / "guider" / "guider_config.json"
    config = json.loads(config_path.read_text())
    config["guidance_rescale"] = 0.7
    config_path.write_text(json.dumps(config))
    with pytest.raises(MilesUserError, match="supports plain CFG only"):
        get_family_class("hunyuan_video")().load_pipeline(str(folder), torch.float32)


def test_encode_images_is_the_inverse_of_decode(family, pipe):
    from miles.models.common import vae_output_to_uint8
    from miles.testing.sft import check_encode_images, gradient_pixels, vae_input

    pixels = gradient_pixels(2, SHAPE.num_frames, SHAPE.height, SHAPE.width)
    vae = pipe.vae
    posteriors, expected_pixels = [], []
    with torch.no_grad():
        for b in range(2):  # diffusers 0.42's VAE runs one sample per call
            posterior = vae.encode(vae_input(pixels[b : b + 1], video=True)).latent_dist.mode()
            posteriors.append(posterior)
            expected_pixels.append(vae_output_to_uint8(vae.decode(posterior).sample))
    expected = torch.cat(posteriors) * vae.config.scaling_factor
    check_encode_images(family, pipe, SHAPE, pixels, expected, torch.cat(expected_pixels))


def test_rollout_and_train_step(path):
    """A Flow-GRPO rollout of 5-frame videos with CFG and one LoRA train step on a one-rank gloo group: the
    trainer's velocities equal the rollout's, and the step moves the adapters."""
    import torch.distributed as dist

    from miles.backends.fsdp_utils.spawn import free_port, init_distributed
    from miles.testing.tiny_rollout import rollout_and_train_step, tiny_trainer_config

    args = tiny_trainer_config(
        path, diffusion_output_num_frames=5, diffusion_num_steps=2, diffusion_guidance_scale=6.0, use_lora=True,
        micro_batch_size_sample=4, micro_batch_size_tstep=1, diffusion_train_iter_order="timestep_major",
        diffusion_debug_mode=True,
    )
    init_distributed(0, 1, "gloo", free_port())
    try:
        samples, metrics, before, after = rollout_and_train_step(args, ["a red cube", "two cats"], 2, [0], seed=5)
    finally:
        dist.destroy_process_group()
    assert samples[0].clean_latents.shape == (4, 3, 8, 8)
    assert samples[0].conditioning["negative_prompt_embeds"].shape == samples[0].conditioning["prompt_embeds"].shape
    assert metrics["train/model_output_max_abs_diff"] <= 1e-5
    assert metrics["train/log_prob_mean_abs_diff"] <= 1e-6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    lora_b = [name for name in before if "lora_B" in name]
    assert lora_b and any(not torch.equal(before[name], after[name]) for name in lora_b)


def test_the_engine_returns_the_reference_loops_frames_for_a_cfg_request(path, family):
    """What the rewards receive: the engine's uint8 frames [F, H, W, 3] for a CFG request equal the reference
    loop's (same seed, Euler steps)."""
    from miles.engine.model_runner import ModelRunner
    from miles.engine.protocol import GenerateRequest
    from miles.engine.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=path, model_family="hunyuan_video", device="cpu", dtype="fp32",
                                    generator_device="cpu"))
    request = GenerateRequest(prompt=PROMPTS[0], num_samples=2, seed=SEEDS[0], num_steps=2, height=SHAPE.height,
                              width=SHAPE.width, num_frames=SHAPE.num_frames, guidance=CFG, request_id="hy")
    trajectory = runner.start(request)
    while not trajectory.done:
        runner.step([trajectory])
    frames = [sample.image for sample in runner.finish(trajectory).samples]
    assert frames[0].dtype == torch.uint8 and frames[0].shape == (5, 32, 32, 3)
    engine_family = get_family_class("hunyuan_video")()  # the engine's text lengths: the pipeline's
    pipe = engine_family.load_pipeline(path, torch.float32)
    reference = sample_reference(engine_family, pipe, [PROMPTS[0]] * 2, seeds=[SEEDS[0], SEEDS[0] + 1], num_steps=2,
                                 shape=SHAPE, guidance=CFG)
    assert torch.equal(torch.stack(frames), reference.images)
