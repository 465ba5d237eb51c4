"""Several reward components per sample: --rm-type lists, dict rewards, --reward-weights, --reward-key, the
per-component metrics of a rollout and of an eval set, and the command-line rules around them."""

from __future__ import annotations

import asyncio
import textwrap
import uuid

import pytest
import torch

from miles.config.arguments import parse_args
from miles.config.sections import HookArgs, run_config_of
from miles.rollout.advantages import assign_advantages
from miles.rollout.eval_config import EvalDataset, build_eval_datasets
from miles.rollout.rm_hub import batched_async_rm, reward_component_metrics, reward_value
from miles.testing.config import hook_args
from miles.types import Sample
from miles.utils.errors import MilesUserError


def _args(**overrides) -> HookArgs:
    values = dict(rm_type=None, custom_rm_path=None, group_rm=False, reward_key=None, eval_reward_key=None,
                  reward_weights=None, n_samples_per_prompt=2, custom_reward_post_process_path=None,
                  globalize_reward_mean=False, globalize_reward_std=False, disable_grpo_std_normalization=False)
    values.update(overrides)
    return hook_args(**values)


def _samples(values: list[int], group_size: int = 2) -> list[Sample]:
    return [Sample(prompt=f"p{i // group_size}", index=i, group_index=i // group_size,
                   image=torch.full((1, 8, 8, 3), value, dtype=torch.uint8)) for i, value in enumerate(values)]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"user_rm_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_a_list_of_rewards_gives_each_sample_every_component():
    samples = _samples([0, 255])
    rewards = asyncio.run(batched_async_rm(_args(rm_type="brightness,jpeg_compressibility", reward_key="brightness"), samples))
    assert set(rewards[0]) == {"brightness", "jpeg_compressibility"}
    assert rewards[0]["brightness"] == 0.0 and rewards[1]["brightness"] == 1.0
    alone = asyncio.run(batched_async_rm(_args(rm_type="jpeg_compressibility"), samples))
    assert [r["jpeg_compressibility"] for r in rewards] == pytest.approx(alone)


def test_weights_sum_the_components_and_a_single_reward_is_named_when_weighted():
    args = _args(rm_type="brightness,jpeg_compressibility", reward_weights={"brightness": 2.0,
                                                                             "jpeg_compressibility": 0.5})
    reward = asyncio.run(batched_async_rm(args, _samples([255, 0])))[0]
    assert reward_value(args, reward) == pytest.approx(2.0 * reward["brightness"] + 0.5 * reward["jpeg_compressibility"])
    single = _args(rm_type="brightness", reward_weights={"brightness": 3.0})
    named = asyncio.run(batched_async_rm(single, _samples([255, 0])))
    assert named == [{"brightness": 1.0}, {"brightness": 0.0}]
    assert reward_value(single, named[0]) == 3.0
    assert asyncio.run(batched_async_rm(_args(rm_type="brightness"), _samples([255, 0]))) == [1.0, 0.0]  # as before


def test_a_dict_reward_keeps_reward_key_and_takes_weights(user_module):
    module = user_module("""
        async def rm(args, samples):
            return [{"ocr": 0.5, "aesthetic": 6.0 + s.index} for s in samples]
    """)
    keyed = _args(custom_rm_path=f"{module}.rm", reward_key="ocr")
    rewards = asyncio.run(batched_async_rm(keyed, _samples([0, 0])))
    assert rewards[1] == {"ocr": 0.5, "aesthetic": 7.0}  # untouched: today's behaviour
    assert reward_value(keyed, rewards[1]) == 0.5
    weighted = _args(custom_rm_path=f"{module}.rm", reward_weights={"ocr": 1.0, "aesthetic": 0.1})
    assert reward_value(weighted, rewards[1]) == pytest.approx(0.5 + 0.7)
    assert reward_value(_args(reward_weights={"ocr": 1.0}, eval_reward_key="aesthetic"), rewards[1],
                        evaluation=True) == 7.0  # an eval key wins over the weights


def test_a_sample_with_only_some_weighted_components_sums_those_it_has():
    args = _args(reward_weights={"ocr": 1.0, "pickscore": 2.0})
    assert reward_value(args, {"ocr": 0.25}) == 0.25  # a mixed dataset routes each prompt to one reward
    with pytest.raises(MilesUserError, match="names none of the sample's reward components"):
        reward_value(args, {"aesthetic": 5.0})
    with pytest.raises(MilesUserError, match="needs named reward components"):
        reward_value(args, 0.5)


def test_the_same_component_from_two_rewards_is_an_error(user_module):
    module = user_module("""
        async def rm(args, samples):
            return [{"brightness": 0.0} for s in samples]
    """)
    samples = _samples([0, 0])
    for sample in samples:
        sample.metadata["rm_type"] = "custom,brightness"
    with pytest.raises(MilesUserError, match="reward component 'brightness' comes from two of the rewards"):
        asyncio.run(batched_async_rm(_args(custom_rm_path=f"{module}.rm"), samples))


def test_rollout_metrics_log_every_component():
    args = _args(rm_type="brightness,jpeg_compressibility", reward_weights={"brightness": 1.0})
    samples = _samples([0, 255, 51, 102])
    for sample, reward in zip(samples, asyncio.run(batched_async_rm(args, samples))):
        sample.reward = reward
    metrics = assign_advantages(run_config_of(args), samples)
    assert metrics["rollout/reward/brightness_mean"] == pytest.approx((0 + 1 + 0.2 + 0.4) / 4)
    assert metrics["rollout/reward_mean"] == pytest.approx(metrics["rollout/reward/brightness_mean"])
    assert "rollout/reward/jpeg_compressibility_std" in metrics  # weight 0, logged all the same
    brightness = torch.tensor([0.0, 1.0, 0.2, 0.4], dtype=torch.float64)
    assert metrics["rollout/reward/brightness_std"] == pytest.approx(brightness.std().item())
    assert [s.advantage for s in samples][:2] == pytest.approx([-0.7071, 0.7071], abs=1e-3)  # GRPO on the weighted sum
    assert reward_component_metrics([1.0, 2.0], "rollout/") == {}  # plain floats: the scalar is the only component


def test_eval_sets_take_the_weights_or_their_own(tmp_path):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"input": "a"}\n')
    config = tmp_path / "eval.yaml"
    config.write_text(f"datasets:\n  - name: own\n    path: {prompts}\n    reward_weights: {{ocr: 2}}\n"
                      f"  - name: default\n    path: {prompts}\n")
    args = _args(eval_config=str(config), reward_weights={"ocr": 1.0, "pickscore": 1.0})
    own, default = build_eval_datasets(run_config_of(args).eval_sets)
    assert own.reward_weights == {"ocr": 2.0} and default.reward_weights == {"ocr": 1.0, "pickscore": 1.0}
    assert own.scalar_reward({"ocr": 0.5, "pickscore": 0.25}) == 1.0
    assert default.scalar_reward({"ocr": 0.5, "pickscore": 0.25}) == 0.75
    assert EvalDataset(name="k", path="x", reward_key="pickscore", reward_weights={"ocr": 1.0}).scalar_reward(
        {"ocr": 0.5, "pickscore": 0.25}) == 0.25
    config.write_text(f"datasets:\n  - name: bad\n    path: {prompts}\n    reward_weights: {{ocr: x}}\n")
    with pytest.raises(MilesUserError, match=r"datasets\[0\]: reward_weights: the weight of 'ocr' is not a number"):
        build_eval_datasets(run_config_of(args).eval_sets)


BASE = ["--hf-checkpoint", "org/sd3-tiny", "--prompt-data", "prompts.jsonl", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1"]


def _error(*extra: str) -> str:
    with pytest.raises(MilesUserError) as info:
        parse_args([*BASE, *extra])
    assert "\n" not in str(info.value)
    return str(info.value)


def test_command_line_rules():
    args = parse_args([*BASE, "--rm-type", "ocr, brightness", "--reward-weights", "ocr=1,brightness=0.5"])
    assert args.rm_type == "ocr,brightness" and args.reward_weights == {"ocr": 1.0, "brightness": 0.5}
    assert parse_args([*BASE, "--rm-type", "ocr,brightness", "--reward-key", "ocr"]).reward_key == "ocr"
    assert "set --reward-weights (e.g. ocr=1,brightness=1) or --reward-key" in _error("--rm-type", "ocr,brightness")
    assert "--reward-key 'x' is none of the components of --rm-type ocr,brightness" in _error(
        "--rm-type", "ocr,brightness", "--reward-key", "x")
    assert "--reward-weights names ['x'], which no reward produces" in _error("--reward-weights", "x=1")
    assert "exclude each other" in _error("--reward-weights", "ocr=1", "--reward-key", "ocr")
    assert "--reward-weights: expected name=weight pairs" in _error("--reward-weights", "ocr")
    assert "every weight is 0" in _error("--reward-weights", "ocr=0")
    assert "invalid choice: 'ocr,nope'" in _error("--rm-type", "ocr,nope")
    assert "invalid choice: 'ocr,ocr'" in _error("--rm-type", "ocr,ocr")
    for rm_type, needs in [("clipscore", "--clipscore-model-path"),
                           ("aesthetic", "--aesthetic-model-path and --aesthetic-head-path"),
                           ("vlm_judge", "--vlm-judge-url and --vlm-judge-model"), ("geneval", "--geneval-url")]:
        assert f"--rm-type {rm_type} needs {needs}" in _error("--rm-type", rm_type)
    # a custom reward or a remote service may name its own components
    assert parse_args([*BASE, "--custom-rm-path", "pkg.rm", "--reward-weights", "mine=1"]).reward_weights == {"mine": 1.0}
