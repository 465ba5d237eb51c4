"""assign_advantages: the math core's GRPO, the reward post-process hook, metrics and errors."""

from __future__ import annotations

import textwrap
import uuid

import pytest
import torch

from miles.config.sections import RunConfig
from miles.diffusion.advantages import compute_grpo_advantages
from miles.rollout.advantages import assign_advantages
from miles.testing.config import trainer_config
from miles.types import Sample
from miles.utils.errors import MilesUserError

METRIC_NAMES = {
    "rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max",
    "rollout/zero_std_ratio", "rollout/advantage_abs_mean", "rollout/num_masked_samples",
}


def _args(**overrides) -> RunConfig:
    values = dict(n_samples_per_prompt=3, globalize_reward_mean=False, globalize_reward_std=False,
                  disable_grpo_std_normalization=False, custom_reward_post_process_path=None, reward_key=None)
    values.update(overrides)
    return trainer_config(**values)


def _samples(rewards: list, group_size: int = 3) -> list[Sample]:
    return [Sample(prompt=f"p{i // group_size}", index=i, group_index=i // group_size, reward=r) for i, r in enumerate(rewards)]


@pytest.mark.parametrize("globalize_std", [False, True])
def test_grpo_advantages_come_from_the_math_core(globalize_std):
    rewards = [1.0, 2.0, 4.0, 0.5, 0.5, 0.5]
    samples = _samples(rewards)
    metrics = assign_advantages(_args(globalize_reward_std=globalize_std), samples)
    expected, _ = compute_grpo_advantages(torch.tensor(rewards, dtype=torch.float64), 3, False, globalize_std, False)
    assert [s.advantage for s in samples] == pytest.approx(expected.tolist())
    assert samples[3].advantage == samples[4].advantage == samples[5].advantage == 0.0
    assert set(metrics) == METRIC_NAMES
    assert metrics["rollout/zero_std_ratio"] == 0.5
    assert metrics["rollout/reward_mean"] == pytest.approx(sum(rewards) / 6)
    assert metrics["rollout/reward_min"] == 0.5 and metrics["rollout/reward_max"] == 4.0
    assert metrics["rollout/advantage_abs_mean"] == pytest.approx(expected.abs().mean().item())


def test_dict_rewards_use_the_reward_key_and_masked_samples_still_count():
    samples = _samples([{"ocr": 1.0, "aesthetic": 9.0}, {"ocr": 0.0, "aesthetic": 9.0}], group_size=2)
    samples[1].remove_sample = True
    metrics = assign_advantages(_args(n_samples_per_prompt=2, reward_key="ocr"), samples)
    assert samples[0].advantage > 0 > samples[1].advantage  # the masked sample is in the statistics
    assert metrics["rollout/num_masked_samples"] == 1.0


POST_PROCESS = """
    def rank(args, samples):
        return [float(s.index) for s in samples]

    def short(args, samples):
        return [0.0]

    def nan(args, samples):
        return [float("nan")] * len(samples)

    def one_arg(samples):
        return []
"""


@pytest.fixture
def post_process_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"user_post_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(POST_PROCESS))
    return name


def test_custom_reward_post_process_replaces_grpo(post_process_module):
    samples = _samples([1.0, 1.0, 1.0])
    metrics = assign_advantages(_args(custom_reward_post_process_path=f"{post_process_module}.rank"), samples)
    assert [s.advantage for s in samples] == [0.0, 1.0, 2.0]
    assert metrics["rollout/zero_std_ratio"] == 1.0
    assert metrics["rollout/advantage_abs_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "function, message",
    [("short", "returned 1 values for 3 samples"), ("nan", "returned nan for sample 0"),
     ("one_arg", "must accept 2 positional"), ("missing", "has no attribute 'missing'")],
)
def test_custom_reward_post_process_errors(post_process_module, function, message):
    args = _args(custom_reward_post_process_path=f"{post_process_module}.{function}")
    with pytest.raises(MilesUserError, match=message) as error:
        assign_advantages(args, _samples([1.0, 2.0, 3.0]))
    assert "--custom-reward-post-process-path" in str(error.value)


def test_batch_shape_errors():
    with pytest.raises(MilesUserError, match="whole groups"):
        assign_advantages(_args(), _samples([1.0, 2.0]))
    shuffled = _samples([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    shuffled[2], shuffled[3] = shuffled[3], shuffled[2]
    with pytest.raises(MilesUserError, match="group-contiguous"):
        assign_advantages(_args(), shuffled)
    with pytest.raises(MilesUserError, match="without a reward"):
        assign_advantages(_args(n_samples_per_prompt=1), _samples([None], group_size=1))
    with pytest.raises(MilesUserError, match="no samples"):
        assign_advantages(_args(), [])
