"""A sequence-parallel engine (tp_size 2, Ulysses: rank 0 + one follower process, gloo on CPU) gives the velocities,
latents, log-probs and images of a one-process engine (tiny SD3 and tiny Wan 2.2 A14B; fp32 with and without
the batch_invariant group, bf16), before and after a weight update; four ranks on 4-head DiTs equal one
process; impossible combinations are one-line user errors."""

from __future__ import annotations

import dataclasses
import multiprocessing
from datetime import timedelta

import pytest
import torch

from miles.engine.cfg_parallel import MODE_CFG_PARALLEL, MODE_SEQUENCE_PARALLEL, engine_parallel_mode
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import GenerateRequest, ProtocolError
from miles.engine.sequence_parallel import sequence_parallel_layouts
from miles.models import get_family_class
from miles.testing.tiny_rollout import max_result_difference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

pytestmark = pytest.mark.timeout(240)

# A rank's projections, norms and MLPs see S/N token rows instead of S: the GEMM library may block them
# differently, ~1 fp32 ulp per op; attention itself is per head and sees every token on both engines.
ATOL = 1e-6
BF16_ATOL = 1e-2  # a few bf16 ulps of the velocity (measured: 0.0)
# (height, width, frames) giving 1 x 3 patch tokens (tiny SD3: VAE 4x, patch 2; tiny Wan: VAE 8x, patch 1x2x2)
ODD_TOKEN_SIZES = {"sd3": (8, 24, 1), "wan2_2": (16, 48, 1)}


def _requests(family: str, guidance_scale: float):
    """Two requests (different prompts, 2 + 1 samples) sharing each step's forward."""
    if family == "sd3":
        size = dict(height=32, width=32, num_steps=3, sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2])
        guidance = GuidanceConfig(guidance_scale=guidance_scale)
    else:  # Wan A14B: both experts run; step 0 stays ODE (the tiny schedule starts just below sigma 1)
        size = dict(height=32, width=32, num_frames=5, num_steps=4, sde_step_indices=[1, 3],
                    return_latent_indices=[1, 2, 3, 4])
        guidance = GuidanceConfig(guidance_scale=guidance_scale, guidance_scale_2=max(1.0, guidance_scale - 1))
    return [
        GenerateRequest(prompt=prompt, num_samples=m, seed=seed, guidance=guidance, noise_level=0.7, debug=True,
                        request_id=prompt, **size)
        for prompt, m, seed in (("a red cube", 2, 0), ("two cats under a tree", 1, 7))
    ]


def _run(runner: ModelRunner, family: str, guidance_scale: float = 4.5):
    trajectories = [runner.start(request) for request in _requests(family, guidance_scale)]
    while not trajectories[0].done:
        runner.step(trajectories)
    return [sample for t in trajectories for sample in runner.finish(t).samples]


def _max_difference(a, b) -> float:
    worst, worst_pixel = max_result_difference(a, b)
    assert worst_pixel <= 1  # uint8 pixels: at most one rounding step
    return worst


def _perturb(runner: ModelRunner) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in sorted(runner.modules):
            for param in runner.modules[name].parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)


# each numerics once, each family in two of them (the family only changes the token layout the ranks split)
@pytest.mark.parametrize(("family", "patch_group", "dtype"), [
    ("sd3", None, "fp32"), ("sd3", "batch_invariant", "fp32"), ("sd3", None, "bf16"),
    ("wan2_2", "batch_invariant", "fp32"), ("wan2_2", None, "bf16"),
])
def test_sequence_parallel_engine_matches_one_process(family, patch_group, dtype, tiny_checkpoint, make_server_args):
    path = tiny_checkpoint(family)
    numerics = dict(model_family=family, rollout_patch_group=patch_group, forward_tile=2 if patch_group else 0,
                    dtype=dtype)
    single = ModelRunner(make_server_args(path, **numerics))
    parallel = ModelRunner(make_server_args(path, tp_size=2, ulysses_degree=2, **numerics))
    try:
        assert parallel.sequence_parallel is not None and parallel.cfg_parallel is None
        assert parallel.sequence_parallel.process.is_alive()
        assert parallel.parallel_info() == {"processes": 2, "mode": "sequence"}
        assert single.parallel_info() == {"processes": 1, "mode": None}
        differences = {
            "cfg": _max_difference(_run(single, family), _run(parallel, family)),
            "no cfg": _max_difference(_run(single, family, 1.0), _run(parallel, family, 1.0)),
        }
        # a weight update reaches the follower: without the sync its half of the tokens would see old weights
        _perturb(single)
        _perturb(parallel)
        stale = _run(parallel, family)
        stale_difference = (stale[0].clean_latents - _run(single, family)[0].clean_latents).abs().max().item()
        assert stale_difference > 10 * BF16_ATOL
        parallel.weights_updated()
        differences["after update"] = _max_difference(_run(single, family), _run(parallel, family))
        print(f"{family} ({patch_group}, {dtype}) sequence-parallel vs one process, max |difference|: {differences}")
        # measured on CPU (gloo, tiny models): 0.0 in every case; exact is required with the group
        tolerance = 0.0 if patch_group else ATOL if dtype == "fp32" else BF16_ATOL
        assert max(differences.values()) <= tolerance, differences

        # a size whose token count does not split over the ranks is refused before any forward (a 400)
        odd = _requests(family, 4.5)[0]
        odd.height, odd.width, odd.num_frames = ODD_TOKEN_SIZES[family]
        with pytest.raises(ProtocolError, match="do not split over the 2 ranks"):
            parallel.start(odd)
        assert len(_run(parallel, family)) == 3  # and the engine serves on
    finally:
        followers = parallel.sequence_parallel.processes
        parallel.close()
        assert not any(process.is_alive() for process in followers)


def test_impossible_combinations_are_user_errors(sd3_path, make_server_args):
    sd3, flux2 = get_family_class("sd3"), get_family_class("flux2")
    assert engine_parallel_mode(2, 0, sd3) == MODE_CFG_PARALLEL  # auto: sd3's CFG splits into two forwards
    assert engine_parallel_mode(2, 0, flux2) == MODE_SEQUENCE_PARALLEL  # FLUX.2 has no CFG to split
    assert engine_parallel_mode(2, 0, None) == MODE_SEQUENCE_PARALLEL  # family unknown before loading
    assert engine_parallel_mode(4, 0, sd3) == MODE_SEQUENCE_PARALLEL
    assert engine_parallel_mode(2, 2, sd3) == MODE_SEQUENCE_PARALLEL
    assert engine_parallel_mode(1, 0, sd3) is None
    with pytest.raises(MilesUserError, match="CFG-parallel and sequence parallel in one engine"):
        engine_parallel_mode(4, 2, sd3)
    with pytest.raises(MilesUserError, match="exactly 2 GPUs"):
        engine_parallel_mode(4, 1, sd3)
    with pytest.raises(MilesUserError, match="needs that many GPUs"):
        engine_parallel_mode(1, 2, sd3)
    with pytest.raises(MilesUserError, match="family 'flux2' has no CFG of two forwards to split"):
        engine_parallel_mode(2, 1, flux2)

    with pytest.raises(MilesUserError, match="enable-torch-compile with a sequence-parallel engine"):
        ModelRunner(make_server_args(sd3_path, tp_size=2, ulysses_degree=2, enable_torch_compile=True))

    with pytest.raises(MilesUserError, match="2 heads, not divisible by 4"):
        ModelRunner(make_server_args(sd3_path, tp_size=4))
    assert not [p for p in multiprocessing.active_children() if "follower" in p.name]  # the followers were stopped

    single = ModelRunner(make_server_args(sd3_path))

    class NoLayout:
        family = "flux"

        def sequence_parallel_layout(self, module):
            return None

    with pytest.raises(MilesUserError, match="the 'flux' family has no sequence-parallel layout"):
        sequence_parallel_layouts(NoLayout(), single.modules, 2)


def builder_failing_on_followers(server_args):
    """A `--pipeline-builder-path` that loads on rank 0 and fails in every follower process."""
    if multiprocessing.current_process().name != "MainProcess":
        raise RuntimeError("this follower cannot load its pipeline")
    runner = ModelRunner(dataclasses.replace(server_args, pipeline_builder_path=None, tp_size=1, ulysses_degree=0))
    return runner.family, runner.pipe


def test_a_follower_that_dies_while_loading_fails_the_start_up(sd3_path, make_server_args):
    builder = f"{__name__}.builder_failing_on_followers"
    with pytest.raises(RuntimeError, match="follower-1 exited with code 1 during start-up"):
        ModelRunner(make_server_args(sd3_path, tp_size=2, ulysses_degree=2, pipeline_builder_path=builder))


# ---- four ranks, straight on the DiTs (the tiny pipelines have 2 heads; these have 4) ------------------------
def _small_dit(family_name: str, dtype: torch.dtype = torch.float32):
    """(family, module, inputs): a seeded 4-head DiT and a batch of inputs, identical in every process."""
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    from miles.models.sd3 import SD3TrainPipelineConfig
    from miles.models.wan2_2 import Wan22TrainPipelineConfig

    torch.manual_seed(0)
    if family_name == "sd3":  # dual attention (image-only attn2) in block 0, qk norms
        module = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                       num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32,
                                       pooled_projection_dim=8, out_channels=4, dual_attention_layers=(0,),
                                       qk_norm="rms_norm")
        inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 7, 16),
                      pooled_projections=torch.randn(2, 8), timestep=torch.tensor([500.0, 20.0]))
        family = SD3TrainPipelineConfig()
    else:  # per-token timesteps, as the TI2V 5B takes them: the plan splits them with the tokens
        module = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4,
                                       out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                       qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        inputs = dict(hidden_states=torch.randn(2, 4, 2, 8, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                      timestep=torch.tensor([500.0, 20.0])[:, None].expand(2, 32).contiguous())
        family = Wan22TrainPipelineConfig()
    inputs = {key: value.to(dtype) if key != "timestep" else value for key, value in inputs.items()}
    return family, module.eval().to(dtype), inputs


def _sequence_parallel_forward(family_name: str, dtype: torch.dtype, port: int, rank: int, world_size: int,
                               listen_socket=None):
    """This rank's (output, tokens its first block saw) of the sequence-parallel forward of `_small_dit`."""
    from miles.engine.sequence_parallel import UlyssesComm, install_sequence_parallel
    from miles.engine.weight_broadcast import _connect

    family, module, inputs = _small_dit(family_name, dtype)
    layouts = sequence_parallel_layouts(family, {"transformer": module}, world_size)
    group = _connect("127.0.0.1", port, rank, world_size, "sp-test", "gloo", timedelta(seconds=120),
                     torch.device("cpu"), listen_socket=listen_socket)
    seen = []
    try:
        install_sequence_parallel(layouts, {"transformer": module}, UlyssesComm(group))
        # registered after the plan's split hook, so it sees what the block sees
        family.transformer_block_lists(module)[0][0].register_forward_pre_hook(lambda _m, args, kwargs: seen.append(
            (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]), with_kwargs=True)
        with torch.no_grad():
            return module(**inputs, return_dict=False)[0], seen[0]
    finally:
        group.close()


def _helper_rank(family_name: str, dtype: torch.dtype, port: int, rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    _sequence_parallel_forward(family_name, dtype, port, rank, world_size)


@pytest.mark.parametrize(("family", "dtype"), [("sd3", torch.bfloat16), ("wan2_2", torch.float32)])
def test_four_ranks_match_one_process(family, dtype):
    import socket

    _, module, inputs = _small_dit(family, dtype)
    with torch.no_grad():
        expected = module(**inputs, return_dict=False)[0]
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.bind(("127.0.0.1", 0))
    listen.listen()
    port = listen.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    helpers = [context.Process(target=_helper_rank, args=(family, dtype, port, rank, 4), daemon=True) for rank in (1, 2, 3)]
    for helper in helpers:
        helper.start()
    try:
        actual, local_tokens = _sequence_parallel_forward(family, dtype, port, 0, 4, listen_socket=listen)
    finally:
        for helper in helpers:
            helper.join(timeout=60)
    assert all(helper.exitcode == 0 for helper in helpers)
    assert local_tokens == {"sd3": 16, "wan2_2": 32}[family] // 4  # each rank's blocks saw a quarter of the tokens
    difference = (actual - expected).abs().max().item()
    print(f"{family} {dtype}: 4 ranks vs one process, max |difference| {difference}")
    assert difference <= (ATOL if dtype == torch.float32 else BF16_ATOL)
