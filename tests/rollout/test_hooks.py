"""Every rollout hook loaded from a user module: signatures checked at start-up, filters applied."""

from __future__ import annotations

import asyncio
import textwrap
import uuid

import pytest

from miles.config.sections import HookArgs
from miles.testing.config import hook_args
from miles.rollout.hooks import (
    HOOK_SPECS,
    apply_dynamic_sampling_filter,
    apply_rollout_sample_filter,
    load_rollout_hooks,
)
from miles.types import Sample, TrainPair
from miles.utils.errors import MilesUserError

USER_HOOKS = """
    import torch
    from miles.types import Sample, TrainPair

    def generate_rollout(args, rollout_id, data_source, evaluation=False):
        return [[Sample(prompt=f"rollout {rollout_id} eval={evaluation}")]]

    def evaluate(args, rollout_id, data_source, evaluation=True):
        return {"eval": rollout_id}

    async def generate(args, group, sampling_params):
        for sample in group:
            sample.image = torch.full((1, 2, 2, 3), sampling_params["value"], dtype=torch.uint8)
        return group

    def keep_varied_groups(args, group):
        return len({s.reward for s in group}) > 1

    def mask_low_rewards(args, samples):
        for sample in samples:
            if sample.reward < 0.5:
                sample.remove_sample = True

    def newest_first(args, rollout_id, buffer, num_groups):
        return buffer[::-1][:num_groups]

    def convert(args, samples):
        return [TrainPair(sample_index=s.index, step_index=0, latents=torch.zeros(1), next_latents=None, sigma=1.0,
                          sigma_next=0.0, sigma_1=1.0, timestep=1000.0, advantage=s.advantage) for s in samples]

    def expand(args, sample):
        return convert(args, [sample]) * 2

    LOGGED = []

    def log_rollout(rollout_id, args, samples, metrics):
        LOGGED.append((rollout_id, len(samples), dict(metrics)))
        return True

    async def rm(args, samples):
        return [1.0] * len(samples)

    def post_process(args, samples):
        return [0.0] * len(samples)

    class Source:
        def __init__(self, args): pass
        def get_samples(self, num_groups): return []
        def add_samples(self, groups): pass
        def state_dict(self): return {}
        def load_state_dict(self, state): pass

    # wrong shapes
    def one_arg(args):
        return None

    def sync_generate(args, group, sampling_params):
        return group

    def sync_rm(args, samples):
        return [1.0] * len(samples)

    def bad_filter(args, group):
        return "yes"

    def returning_filter(args, samples):
        return samples

    NOT_CALLABLE = 3
"""

FLAG_TO_FUNCTION = {
    "rollout_function_path": "generate_rollout",
    "eval_function_path": "evaluate",
    "custom_generate_function_path": "generate",
    "dynamic_sampling_filter_path": "keep_varied_groups",
    "rollout_sample_filter_path": "mask_low_rewards",
    "buffer_filter_path": "newest_first",
    "custom_convert_samples_to_train_data_path": "convert",
    "custom_expand_samples_to_train_pairs_path": "expand",
    "custom_rollout_log_function_path": "log_rollout",
    "custom_eval_rollout_log_function_path": "log_rollout",
    "custom_rm_path": "rm",
    "custom_reward_post_process_path": "post_process",
}


@pytest.fixture
def module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"user_hooks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_HOOKS))
    return name


def _args(module: str | None = None, **overrides) -> HookArgs:
    values = {spec.attribute: None for spec in HOOK_SPECS if spec.attribute != "rollout_function_path"}
    values["data_source_path"] = None
    if module:
        values.update({flag: f"{module}.{fn}" for flag, fn in FLAG_TO_FUNCTION.items()})
        values["data_source_path"] = f"{module}.Source"
    values.update(overrides)
    return hook_args(**values)


def _group(group_index: int, rewards: list[float]) -> list[Sample]:
    return [Sample(prompt=f"p{group_index}", group_index=group_index, reward=r) for r in rewards]


def test_every_hook_loads_and_runs(module):
    hooks = load_rollout_hooks(_args(module))
    user = __import__(module)
    assert hooks.rollout_function(None, 3, None)[0][0].prompt == "rollout 3 eval=False"
    assert hooks.eval_function(None, 4, None) == {"eval": 4}
    group = asyncio.run(hooks.custom_generate(None, [Sample(prompt="x")], {"value": 7}))
    assert group[0].image.flatten().tolist() == [7] * 12
    samples = [Sample(prompt="x", index=i, advantage=0.5) for i in range(2)]
    pairs = hooks.convert_samples_to_train_data(None, samples)
    assert all(isinstance(p, TrainPair) for p in pairs) and [p.sample_index for p in pairs] == [0, 1]
    assert len(hooks.expand_samples_to_train_pairs(None, samples[0])) == 2
    assert hooks.rollout_log(5, None, samples, {"rollout/reward_mean": 1.0}) is True
    assert hooks.eval_rollout_log is user.log_rollout
    assert user.LOGGED == [(5, 2, {"rollout/reward_mean": 1.0})]
    assert asyncio.run(hooks.custom_rm(None, samples)) == [1.0, 1.0]
    assert hooks.reward_post_process(None, samples) == [0.0, 0.0]
    assert hooks.buffer_filter(None, 0, [["a"], ["b"]], 1) == [["b"]]
    assert hooks.data_source_class is user.Source


def test_unset_hooks_stay_none_and_eval_defaults_to_rollout(module):
    hooks = load_rollout_hooks(_args(rollout_function_path=f"{module}.generate_rollout"))
    assert hooks.eval_function is hooks.rollout_function
    assert hooks.custom_generate is None and hooks.dynamic_sampling_filter is None and hooks.custom_rm is None
    assert hooks.data_source_class is None


def test_dynamic_sampling_filter_drops_constant_groups(module):
    hooks = load_rollout_hooks(_args(module))
    groups = [_group(0, [1.0, 1.0]), _group(1, [0.0, 1.0]), _group(2, [0.3, 0.3])]
    kept, dropped = apply_dynamic_sampling_filter(hooks, None, groups)
    assert [g[0].group_index for g in kept] == [1]
    assert [g[0].group_index for g in dropped] == [0, 2]
    no_filter = load_rollout_hooks(_args(rollout_function_path=f"{module}.generate_rollout"))
    assert apply_dynamic_sampling_filter(no_filter, None, groups) == (groups, [])


def test_rollout_sample_filter_masks_samples(module):
    hooks = load_rollout_hooks(_args(module))
    samples = _group(0, [0.1, 0.9, 0.4, 0.6])
    assert apply_rollout_sample_filter(hooks, None, samples) == 2
    assert [s.remove_sample for s in samples] == [True, False, True, False]
    assert len(samples) == 4  # masked samples stay in the batch for advantage statistics


def test_filters_returning_the_wrong_type(module):
    hooks = load_rollout_hooks(_args(module, dynamic_sampling_filter_path=f"{module}.bad_filter",
                                     rollout_sample_filter_path=f"{module}.returning_filter"))
    with pytest.raises(MilesUserError, match="--dynamic-sampling-filter-path must return a bool"):
        apply_dynamic_sampling_filter(hooks, None, [_group(0, [1.0])])
    with pytest.raises(MilesUserError, match="--rollout-sample-filter-path must return None"):
        apply_rollout_sample_filter(hooks, None, _group(0, [1.0]))


@pytest.mark.parametrize("spec", HOOK_SPECS, ids=lambda spec: spec.flag)
def test_wrong_signature_or_path_names_the_flag(module, spec):
    sync_versions = {"custom_generate": "sync_generate", "custom_rm": "sync_rm"}
    wrong = sync_versions[spec.field] if spec.is_async else ("one_arg" if spec.num_params > 1 else "NOT_CALLABLE")
    with pytest.raises(MilesUserError, match=spec.flag) as error:
        load_rollout_hooks(_args(module, **{spec.attribute: f"{module}.{wrong}"}))
    assert ("async" in str(error.value)) if spec.is_async else ("positional" in str(error.value))
    with pytest.raises(MilesUserError, match=f"{spec.flag} .*cannot import module"):
        load_rollout_hooks(_args(module, **{spec.attribute: "no_such_package.module.fn"}))


def test_async_hooks_reject_sync_functions_with_the_right_arity(module):
    for attribute, function in (("custom_generate_function_path", "sync_generate"), ("custom_rm_path", "sync_rm")):
        with pytest.raises(MilesUserError, match="must be an async function"):
            load_rollout_hooks(_args(module, **{attribute: f"{module}.{function}"}))


def test_bad_data_source_class(module):
    with pytest.raises(MilesUserError, match="--data-source-path .*missing"):
        load_rollout_hooks(_args(module, data_source_path=f"{module}.one_arg"))
