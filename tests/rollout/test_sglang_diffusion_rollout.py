"""generate_rollout end to end against a real engine and router (in-process, on a background loop):
microgroups, seeds and step indices per docs/algorithms.md §3, rewards per microgroup, the dynamic sampling filter,
the custom generate hook, group rewards, evaluation (list of groups and EvalDataset), and error paths."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from miles.config.sections import HookArgs
from miles.engine.launcher import BackgroundLoop
from miles.engine.server import EngineServer
from miles.engine.server_args import ServerArgs
from miles.rollout.data_source import RolloutDataSourceWithBuffer
from miles.rollout.eval_config import EvalDataset
from miles.rollout.sglang_diffusion_rollout import (
    add_engine_timings,
    empty_engine_seconds,
    generate_rollout,
    generate_rollout_async,
    run_sync,
)
from miles.rollout.step_strategy_hub import request_seed
from miles.router.router import Router, RouterConfig
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["a red apple", "a blue car", "a green tree", "a yellow sun", "a white cloud", "a black cat"]
CALLS: list[dict] = []  # what the custom generate hook saw


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    """One engine and one router serving on a background event loop of this process."""
    loop = BackgroundLoop()
    server_args = ServerArgs(model_path=tiny_checkpoint("sd3"), model_family="sd3", device="cpu", dtype="fp32",
                             generator_device="cpu", batch_wait_ms=5.0)
    engine = EngineServer(server_args)
    engine_url = loop.run(engine.start())
    router = Router(RouterConfig(health_check_interval=3600, health_check_first_wait=3600), [engine_url])
    router_url = loop.run(router.start())
    yield Namespace(engine=engine, engine_url=engine_url, router=router, router_url=router_url)
    loop.run(router.stop())
    loop.run(engine.stop())
    loop.close()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": p}) + "\n" for p in PROMPTS))
    return str(path)


def _args(stack, prompt_file, **overrides) -> HookArgs:
    fields = dict(
        router_url=stack.router_url, prompt_data=prompt_file, no_rollout_shuffle=True, rollout_seed=42,
        rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=2, rm_type="brightness",
        diffusion_num_steps=3, diffusion_num_sde_steps=1, diffusion_sde_window_range=None,
        diffusion_step_strategy_path=None, diffusion_height=32, diffusion_width=32, diffusion_output_num_frames=1,
        diffusion_guidance_scale=4.0, diffusion_noise_level=0.7, diffusion_sde_type="sde",
        diffusion_log_prob_no_const=False, sglang_server_concurrency=4, rollout_parser_num_workers=2,
        use_fault_tolerance=False, use_distributed_post=False, group_rm=False, loss_type="policy_loss",
    )
    fields.update(overrides)
    return hook_args(**fields)


def test_rollout_returns_scored_group_contiguous_samples(stack, prompt_file):
    args = _args(stack, prompt_file)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [len(g) for g in groups] == [4, 4]
    assert groups.metrics["rollout/num_requests"] == 4 and groups.metrics["rollout/num_retries"] == 0
    assert [s.index for g in groups for s in g] == list(range(8))
    for group in groups:
        assert len({s.prompt for s in group}) == 1 and len({s.group_index for s in group}) == 1
        base = request_seed(42, group[0].group_index, 4, 0)
        assert [s.seed for s in group] == [base, base + 1, base + 2, base + 3]
        for first, second in (group[0:2], group[2:4]):  # one microgroup shares its SDE window
            assert first.sde_step_indices == second.sde_step_indices and len(first.sde_step_indices) == 1
        for sample in group:
            k = sample.sde_step_indices[0]
            assert sorted(sample.latents) == [k, k + 1]
            assert isinstance(sample.reward, float) and 0.0 <= sample.reward <= 1.0
            assert sample.image.shape == (1, 32, 32, 3) and sample.engine_url == stack.engine_url
            assert sample.rollout_log_probs.shape == (1,) and sample.conditioning


def test_the_engines_denoising_time_is_its_step_clock_over_the_rollout(stack, prompt_file):
    clock_before = stack.engine.scheduler.counters.step_seconds
    groups = generate_rollout(_args(stack, prompt_file), 0, RolloutDataSourceWithBuffer(_args(stack, prompt_file)))
    denoise = groups.metrics["rollout/engine_denoise_seconds"]
    # its one engine ran only this rollout's steps, whichever requests shared them
    assert denoise == pytest.approx(stack.engine.scheduler.counters.step_seconds - clock_before, abs=1e-9)
    assert 0 < denoise < groups.metrics["rollout/engine_request_seconds"]
    # the worker's parts of the requests, one after another, within the longest request's span (all came at once)
    parts = {part: groups.metrics[f"rollout/engine_{part}_seconds"] for part in ("start", "denoise", "decode", "pack")}
    assert all(seconds > 0 for seconds in parts.values()), parts
    assert sum(parts.values()) <= groups.metrics["rollout/engine_request_seconds"] + 0.05, parts


def test_engine_timings_count_shared_steps_once_and_waves_one_after_another():
    seconds, clocks = empty_engine_seconds(), {}
    for url, start, end in [("a", 10.0, 12.0), ("a", 10.0, 12.0),  # engine a: two requests sharing their steps
                            ("a", 12.0, 14.5), ("b", 3.0, 4.0)]:  # then a second wave; engine b: one request
        add_engine_timings(seconds, clocks, {"step_clock_start": start, "step_clock_end": end, "start": 0.125,
                                             "decode": 0.25, "pack": 0.5, "total": end - start + 0.25,
                                             "queue": start - 10.0}, url)
    assert seconds == {"start": 0.5, "denoise": 4.5, "decode": 1.0, "pack": 2.0, "request": 4.75, "compile": 0.0,
                       "weights_wait": 0.0}
    # a request sent ahead (--rollout-prefetch) that waited 7 s for its weights: its time leaves the wait out
    add_engine_timings(seconds, clocks, {"step_clock_start": 14.5, "step_clock_end": 15.0, "total": 7.5,
                                         "queue": 0.5, "weights_wait": 7.0}, "b")
    assert seconds["weights_wait"] == 7.0 and seconds["request"] == 4.75


def test_microgroup_size_does_not_change_samples(stack, prompt_file):
    # with every step an SDE step (K = 0) the windows agree, and each sample's noise depends only on its seed
    common = dict(diffusion_num_sde_steps=0, rollout_batch_size=1)
    one = generate_rollout(_args(stack, prompt_file, rollout_microgroup_size=1, **common), 0,
                           RolloutDataSourceWithBuffer(_args(stack, prompt_file, **common)))
    four = generate_rollout(_args(stack, prompt_file, rollout_microgroup_size=4, **common), 0,
                            RolloutDataSourceWithBuffer(_args(stack, prompt_file, **common)))
    for a, b in zip(one[0], four[0]):
        assert a.seed == b.seed and a.sde_step_indices == b.sde_step_indices == [0, 1, 2]
        torch.testing.assert_close(a.clean_latents, b.clean_latents, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5, rtol=1e-5)


def keep_odd_groups(args, group: list[Sample]) -> bool:
    return group[0].group_index % 2 == 1


def test_dynamic_sampling_filter_keeps_generating_until_enough_groups(stack, prompt_file):
    args = _args(stack, prompt_file, dynamic_sampling_filter_path="test_sglang_diffusion_rollout.keep_odd_groups")
    groups, metrics = run_sync(generate_rollout_async(args, 0, RolloutDataSourceWithBuffer(args)))
    assert [g[0].group_index for g in groups] == [1, 3]
    assert metrics["rollout/num_groups_dropped"] >= 2 and metrics["rollout/num_groups_generated"] >= 4
    assert [s.index for g in groups for s in g] == list(range(8))


def drop_every_group(args, group: list[Sample]) -> bool:
    return False


def test_a_filter_that_keeps_nothing_ends_with_a_clear_error(stack, prompt_file):
    args = _args(stack, prompt_file, rollout_batch_size=1, n_samples_per_prompt=1, rollout_microgroup_size=1,
                 dynamic_sampling_filter_path="test_sglang_diffusion_rollout.drop_every_group")
    with pytest.raises(MilesUserError, match="dynamic-sampling-filter-path kept 0 of 10 groups"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


async def fake_generate(args, group: list[Sample], sampling_params: dict) -> list[Sample]:
    CALLS.append(dict(sampling_params, size=len(group)))
    # new Sample objects on purpose: the rollout must keep what the hook returns
    return [
        Sample(prompt=s.prompt, group_index=s.group_index, seed=sampling_params["seed"] + b,
               image=torch.full((1, 8, 8, 3), 255, dtype=torch.uint8))
        for b, s in enumerate(group)
    ]


def test_custom_generate_hook_replaces_the_http_call(stack, prompt_file):
    CALLS.clear()
    args = _args(stack, prompt_file, custom_generate_function_path="test_sglang_diffusion_rollout.fake_generate")
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(CALLS) == 4 and all(call["size"] == 2 for call in CALLS)  # 2 groups x 2 microgroups
    assert all(call["router_url"] == stack.router_url and call["num_steps"] == 3 for call in CALLS)
    assert {call["seed"] for call in CALLS} == {request_seed(42, g, 4, o) for g in (0, 1) for o in (0, 2)}
    assert all(s.reward == 1.0 for g in groups for s in g)  # brightness of an all-white image
    assert [s.seed for s in groups[0]] == [request_seed(42, 0, 4, 0) + b for b in range(4)]


async def count_group_rm(args, samples: list[Sample]) -> list[float]:
    return [float(len(samples))] * len(samples)


def test_group_rm_scores_whole_groups(stack, prompt_file):
    args = _args(stack, prompt_file, group_rm=True, rm_type=None,
                 custom_rm_path="test_sglang_diffusion_rollout.count_group_rm")
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert all(s.reward == 4.0 for g in groups for s in g)


def test_evaluation_is_plain_generation_from_groups_or_an_eval_dataset(stack, prompt_file):
    args = _args(stack, prompt_file, diffusion_eval_num_steps=2)
    groups = [[Sample(prompt="an orange", group_index=0) for _ in range(2)]]
    result = generate_rollout(args, 0, groups, evaluation=True)
    for sample in result[0]:
        assert sample.image is not None and sample.latents == {} and sample.conditioning == {}
        assert sample.sde_step_indices == [] and sample.num_steps == 2 and isinstance(sample.reward, float)
    again = generate_rollout(args, 1, [[Sample(prompt="an orange", group_index=0) for _ in range(2)]], evaluation=True)
    assert torch.equal(again[0][0].image, result[0][0].image)  # eval noise is fixed across evaluations

    dataset = EvalDataset(name="colors", path=prompt_file, n_samples_per_eval_prompt=1, num_steps=1,
                          rm_type="jpeg_compressibility")
    by_dataset = generate_rollout(args, 0, dataset, evaluation=True)
    assert len(by_dataset) == len(PROMPTS) and all(g[0].num_steps == 1 for g in by_dataset)
    assert all(g[0].metadata["rm_type"] == "jpeg_compressibility" and g[0].reward < 0 for g in by_dataset)
    with pytest.raises(MilesUserError, match="EvalDataset or a list of groups"):
        generate_rollout(args, 0, ["not a group"], evaluation=True)


def test_engine_rejections_and_missing_router_are_clear_errors(stack, prompt_file):
    args = _args(stack, prompt_file, diffusion_height=4096 + 16)  # valid for miles, above the engine's limit
    with pytest.raises(MilesUserError, match="engine rejected.*height"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    with pytest.raises(MilesUserError, match="miles_router_url"):
        generate_rollout(_args(stack, prompt_file, router_url=None), 0, RolloutDataSourceWithBuffer(args))


def test_over_sampling_starts_the_extra_groups_at_once(stack, prompt_file):
    requested: list[int] = []

    class CountingSource(RolloutDataSourceWithBuffer):
        def get_samples(self, num_groups, rollout_id=None):
            requested.append(num_groups)
            return super().get_samples(num_groups, rollout_id)

    hooks = dict(custom_generate_function_path="test_sglang_diffusion_rollout.fake_generate",
                 over_sampling_batch_size=4)
    args = _args(stack, prompt_file, dynamic_sampling_filter_path="test_sglang_diffusion_rollout.keep_odd_groups",
                 **hooks)
    groups, metrics = run_sync(generate_rollout_async(args, 0, CountingSource(args)))
    assert requested == [4]  # one wave covers the two groups the filter drops: no replacement round
    assert [g[0].group_index for g in groups] == [1, 3]
    assert (metrics["rollout/num_groups_generated"], metrics["rollout/num_groups_dropped"],
            metrics["rollout/num_groups_unused"]) == (4, 2, 0)

    requested.clear()
    args = _args(stack, prompt_file, **hooks)
    groups, metrics = run_sync(generate_rollout_async(args, 0, CountingSource(args)))
    assert requested == [4] and len(groups) == 2  # --rollout-batch-size groups are trained, the rest unused
    assert metrics["rollout/num_groups_unused"] == 2 and [s.index for g in groups for s in g] == list(range(8))


def test_a_groups_input_image_is_read_once_at_the_output_size_and_sent_with_each_request(stack, tmp_path, monkeypatch):
    from PIL import Image

    import miles.rollout.sglang_diffusion_rollout as rollout_module

    Image.new("RGB", (20, 10), (250, 0, 0)).save(tmp_path / "red.png")
    edits = tmp_path / "edits.jsonl"
    edits.write_text('{"input": "make it blue", "image": "red.png"}\n{"input": "add a hat", "image": "red.png"}\n')
    reads: list[str] = []
    real_load = rollout_module.load_condition_image
    monkeypatch.setattr(rollout_module, "load_condition_image", lambda path, *a: reads.append(path) or real_load(path, *a))
    CALLS.clear()
    args = _args(stack, str(edits), custom_generate_function_path="test_sglang_diffusion_rollout.fake_generate")
    generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(reads) == 2 and len(CALLS) == 4  # one read per group, shared by its two microgroups
    images = [call["image"] for call in CALLS]
    assert all((image.height, image.width) == (32, 32) for image in images)
    assert torch.all(images[0].to_tensor()[..., 0] >= 240) and torch.all(images[0].to_tensor()[..., 2] <= 10)
    # the sd3 engine takes no input image: a one-line rejection naming the family
    args = _args(stack, str(edits))
    with pytest.raises(MilesUserError, match="engine rejected request .*: family 'sd3' takes no input image"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
