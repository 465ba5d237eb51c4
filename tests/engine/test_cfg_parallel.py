"""A CFG-parallel engine (tp_size 2: rank 0 + one follower process, gloo on CPU) gives the velocities and latents
of a one-process engine, before and after a weight update (tiny SD3, fp32)."""

from __future__ import annotations

import pytest
import torch

from miles.engine.cfg_parallel import check_cfg_parallel_family
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import GenerateRequest
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

pytestmark = pytest.mark.timeout(120)

GUIDANCE = 4.5


def _run(runner: ModelRunner, guidance_scale: float = GUIDANCE):
    """Two requests (different prompts, 2 + 1 samples) sharing each step's forward; their samples."""
    requests = [
        GenerateRequest(prompt=prompt, num_samples=m, seed=seed, num_steps=3, height=32, width=32,
                        guidance=GuidanceConfig(guidance_scale=guidance_scale), noise_level=0.7, debug=True,
                        sde_step_indices=[0, 1], return_latent_indices=[0, 1, 2], request_id=prompt)
        for prompt, m, seed in (("a red cube", 2, 0), ("two cats under a tree", 1, 7))
    ]
    trajectories = [runner.start(request) for request in requests]
    while not trajectories[0].done:
        runner.step(trajectories)
    return [sample for t in trajectories for sample in runner.finish(t).samples]


# Each branch agrees to ~1 fp32 ulp (a batch of M samples per forward instead of the doubled 2M changes the GEMMs'
# blocking); `combine_cfg` amplifies a branch difference e to at most (2·scale − 1)·e in the guided velocity.
BRANCH_ATOL = 1e-6


def _assert_close(a, b, guidance_scale: float = GUIDANCE):
    atol = BRANCH_ATOL * max(1.0, 2 * guidance_scale - 1)
    for x, y in zip(a, b, strict=True):
        pairs = [(x.clean_latents, y.clean_latents), (x.rollout_log_probs, y.rollout_log_probs)]
        pairs += [(x.latents[k], y.latents[k]) for k in x.latents]
        pairs += [(x.debug_model_outputs[k], y.debug_model_outputs[k]) for k in x.debug_model_outputs]
        for p, q in pairs:
            torch.testing.assert_close(p, q, atol=atol, rtol=0)


def _perturb(runner: ModelRunner) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in runner.modules["transformer"].parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)


def test_cfg_parallel_engine_matches_one_process(sd3_path, make_server_args):
    single = ModelRunner(make_server_args(sd3_path))
    parallel = ModelRunner(make_server_args(sd3_path, tp_size=2))
    try:
        assert parallel.cfg_parallel is not None and parallel.cfg_parallel.process.is_alive()
        _assert_close(_run(single), _run(parallel))
        _assert_close(_run(single, guidance_scale=1.0), _run(parallel, guidance_scale=1.0), 1.0)  # no CFG: rank 0

        # a weight update reaches the follower: without the sync its unconditional branch would be stale
        _perturb(single)
        _perturb(parallel)
        stale = _run(parallel)  # the follower still holds the old weights: the unconditional branch differs
        assert (stale[0].clean_latents - _run(single)[0].clean_latents).abs().max() > 1e-3
        parallel.weights_updated()
        _assert_close(_run(single), _run(parallel))
    finally:
        parallel.close()
    assert parallel.cfg_parallel is None


def test_families_without_a_plain_cfg_split_are_refused():
    with pytest.raises(MilesUserError, match="CFG-parallel engine"):
        check_cfg_parallel_family("wan2_2")
