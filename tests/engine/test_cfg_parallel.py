"""A CFG-parallel engine (tp_size 2: rank 0 + one follower process, gloo on CPU) gives the velocities, latents,
log-probs and images of a one-process engine, for every family that declares its CFG branches
(`TrainPipelineConfig.cfg_branch_keys`), with CFG on; sd3 also before and after a weight update. A family without
a CFG of two forwards (FLUX.2) is refused at start-up with one line."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from miles.engine.cfg_parallel import check_cfg_parallel_family, split_conditioning
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import ConditionImage, GenerateRequest
from miles.models import get_family_class
from miles.testing.make_tiny import build_tiny_pipeline
from miles.testing.tiny_rollout import max_result_difference
from miles.types import GuidanceConfig
from miles.utils.errors import MilesUserError

pytestmark = pytest.mark.timeout(240)

GUIDANCE = 4.5


@dataclass(frozen=True)
class Case:
    """One family's CFG-on requests: its tiny checkpoint (`variant`), output size, guidance, input image."""

    family: str
    variant: str | None = None
    builder: str | None = None  # the tiny builder of `variant`, when not the family's own
    size: dict = field(default_factory=lambda: dict(height=32, width=32))
    guidance: GuidanceConfig = field(default_factory=lambda: GuidanceConfig(guidance_scale=GUIDANCE))
    image: bool = False
    num_steps: int = 3


CASES = {
    "sd3": Case("sd3"),
    # FLUX.1's CFG is true CFG; the distilled guidance embedding (3.5) must reach both branches unchanged
    "flux": Case("flux", guidance=GuidanceConfig(guidance_scale=3.5, true_cfg_scale=GUIDANCE)),
    "flux_kontext": Case("flux_kontext", "kontext", "flux", image=True,
                         guidance=GuidanceConfig(guidance_scale=3.5, true_cfg_scale=GUIDANCE)),
    # true CFG with per-token renormalisation
    "qwen_image": Case("qwen_image", guidance=GuidanceConfig(guidance_scale=1.0, true_cfg_scale=GUIDANCE)),
    # the edit model's image reaches its text encoder and its transformer: both branches see it
    "qwen_image_edit": Case("qwen_image_edit", "edit", "qwen_image", image=True,
                            guidance=GuidanceConfig(guidance_scale=1.0, true_cfg_scale=GUIDANCE)),
    # A14B: both experts run (4 steps), the low-noise one with its own scale
    "wan2_2": Case("wan2_2", size=dict(height=32, width=32, num_frames=5),
                   guidance=GuidanceConfig(guidance_scale=GUIDANCE, guidance_scale_2=3.0), num_steps=4),
    # TI2V 5B image-to-video: the image latents go to both branches, the first frame stays pinned
    "wan2_2_ti2v": Case("wan2_2", "ti2v_5b", size=dict(height=32, width=32, num_frames=5), image=True),
    "ltx": Case("ltx", size=dict(height=32, width=32, num_frames=5)),
    "cosmos3": Case("cosmos3", size=dict(height=64, width=64, num_frames=1)),
    "hunyuan_video": Case("hunyuan_video", size=dict(height=32, width=32, num_frames=5)),
}


def _image(height: int = 32, width: int = 32) -> ConditionImage:
    ys, xs = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    channels = [torch.sin(5 * (xs - ys) + phase) * 0.5 + 0.5 for phase in (0.0, 2.0, 4.0)]
    return ConditionImage.from_tensor((torch.stack(channels, dim=-1) * 255).round().to(torch.uint8))


def _requests(case: Case, guidance: GuidanceConfig | None = None):
    """Two requests (different prompts, 2 + 1 samples) sharing each step's forward."""
    steps = case.num_steps
    return [
        GenerateRequest(prompt=prompt, num_samples=m, seed=seed, num_steps=steps, guidance=guidance or case.guidance,
                        noise_level=0.7, debug=True, sde_step_indices=list(range(1, steps)),
                        return_latent_indices=list(range(steps)), request_id=prompt,
                        image=_image(case.size["height"], case.size["width"]) if case.image else None, **case.size)
        for prompt, m, seed in (("a red cube", 2, 0), ("two cats under a tree", 1, 7))
    ]


def _run(runner: ModelRunner, case: Case, guidance: GuidanceConfig | None = None):
    trajectories = [runner.start(request) for request in _requests(case, guidance)]
    while not trajectories[0].done:
        runner.step(trajectories)
    return [sample for t in trajectories for sample in runner.finish(t).samples]


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint, tmp_path_factory):
    """`tiny_path(case)`: the case's tiny checkpoint (a variant built once per module)."""
    variants: dict[str, str] = {}

    def get(case: Case) -> str:
        if case.variant is None:
            return tiny_checkpoint(case.family)
        if case.variant not in variants:
            out = tmp_path_factory.mktemp(f"tiny-{case.family}-{case.variant}")
            variants[case.variant] = build_tiny_pipeline(case.builder or case.family, str(out), variant=case.variant)
        return variants[case.variant]

    return get


# Each branch agrees to ~1 fp32 ulp (a batch of M samples per forward instead of the doubled 2M changes the GEMMs'
# blocking); `combine_cfg` amplifies a branch difference e to at most (2·scale − 1)·e in the guided velocity.
BRANCH_ATOL = 1e-6


def _tolerance(case: Case) -> float:
    """Not bitwise even with the batch_invariant group: its fixed tiles make a CFG forward a doubled batch of
    2·tile samples, a CFG-parallel branch a batch of tile samples (other GEMM shapes)."""
    scale = max(case.guidance.scale, case.guidance.guidance_scale_2 or 1.0)
    return BRANCH_ATOL * max(1.0, 2 * scale - 1)


# Every family in the default numerics (`batch_invariant`); without the group, one family per form of CFG (plain,
# true CFG, two experts): the group changes the tiles, not how a family splits its conditioning.
MODES = [(name, "batch_invariant") for name in sorted(CASES)] + [(name, None) for name in ("sd3", "flux", "wan2_2")]


@pytest.mark.parametrize(("name", "patch_group"), MODES)
def test_cfg_parallel_engine_matches_one_process(name, patch_group, tiny_path, make_server_args):
    case = CASES[name]
    numerics = dict(model_family=case.family, rollout_patch_group=patch_group, forward_tile=2 if patch_group else 0)
    path = tiny_path(case)
    single = ModelRunner(make_server_args(path, **numerics))
    parallel = ModelRunner(make_server_args(path, tp_size=2, ulysses_degree=1, **numerics))
    try:
        assert parallel.cfg_parallel is not None and parallel.cfg_parallel.process.is_alive()
        assert parallel.parallel_info() == {"processes": 2, "mode": "cfg"}
        difference, pixels = max_result_difference(_run(single, case), _run(parallel, case))
        print(f"{name} ({patch_group}) CFG-parallel vs one process, max |difference|: {difference:.3g}, "
              f"pixels: {pixels}")
        assert difference <= _tolerance(case), difference
        assert pixels <= 1  # uint8: at most one rounding step of a 1e-6 difference
    finally:
        parallel.close()
    assert parallel.cfg_parallel is None


def _perturb(runner: ModelRunner) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in runner.modules["transformer"].parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)


def test_cfg_parallel_engine_follows_weight_updates(sd3_path, make_server_args):
    case = CASES["sd3"]
    single = ModelRunner(make_server_args(sd3_path))
    parallel = ModelRunner(make_server_args(sd3_path, tp_size=2))  # auto: sd3's CFG splits into two forwards
    try:
        assert parallel.cfg_parallel is not None
        no_cfg = GuidanceConfig(guidance_scale=1.0)  # rank 0 alone
        assert max_result_difference(_run(single, case, no_cfg), _run(parallel, case, no_cfg)) == (0.0, 0)

        # a weight update reaches the follower: without the sync its unconditional branch would be stale
        _perturb(single)
        _perturb(parallel)
        stale = _run(parallel, case)  # the follower still holds the old weights: the unconditional branch differs
        assert (stale[0].clean_latents - _run(single, case)[0].clean_latents).abs().max() > 1e-3
        parallel.weights_updated()
        difference, pixels = max_result_difference(_run(single, case), _run(parallel, case))
        assert difference <= _tolerance(case) and pixels <= 1
    finally:
        parallel.close()


def test_families_without_a_cfg_split_are_refused(tiny_checkpoint, make_server_args):
    with pytest.raises(MilesUserError, match="family 'flux2' has no CFG of two forwards to split") as error:
        check_cfg_parallel_family(get_family_class("flux2"))
    assert "--sglang-ulysses-degree 2" in str(error.value) and "\n" not in str(error.value)
    # at start-up, before any follower process starts
    with pytest.raises(MilesUserError, match="family 'flux2' has no CFG of two forwards to split"):
        ModelRunner(make_server_args(tiny_checkpoint("flux2"), model_family="flux2", tp_size=2, ulysses_degree=1))


def test_split_conditioning_shares_the_keys_without_a_negative_twin():
    conditioning = {"prompt_embeds": torch.ones(1), "negative_prompt_embeds": torch.zeros(1),
                    "image_latents": torch.full((1,), 2.0)}
    positive, negative = split_conditioning(conditioning, ("prompt_embeds",))
    assert positive == {"prompt_embeds": conditioning["prompt_embeds"], "image_latents": conditioning["image_latents"]}
    assert negative == {"prompt_embeds": conditioning["negative_prompt_embeds"],
                        "image_latents": conditioning["image_latents"]}
    with pytest.raises(ValueError, match="negative_prompt_embeds"):  # an undeclared negative would be dropped
        split_conditioning(conditioning, ("pooled_prompt_embeds",))
