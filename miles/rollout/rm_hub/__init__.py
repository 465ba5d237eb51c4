"""Reward dispatch: which rewards score which sample, how their components combine, and the checks every
reward's output passes.

`batched_async_rm(config, samples, evaluation)` routes each sample by its reward spec:
`sample.metadata.get("rm_type")`, else `--custom-rm-path` (when given), else `--rm-type`. A spec names one reward
or several, comma-separated (`ocr,pickscore`). Each reward is called once per batch of samples sharing the spec
(or once per prompt group with `--group-rm`), and the result is one reward per sample in the input order:
- a float, when the spec names one reward that returns a float and `--reward-weights` is unset (as before);
- else a dict of components: a reward returning a float contributes `{its name: value}`, a reward returning a
  dict contributes its keys; the same key from two rewards is an error.
It does not write `sample.reward`: the caller does.

`reward_value` turns a sample's reward into the scalar the advantages use: a float as is; from a dict the value at
`--reward-key` (evaluation: `--eval-reward-key`, defaulting to `--reward-key`), or with `--reward-weights` the
weighted sum of the components the sample has. `reward_component_metrics` gives each component's mean and std
(`<prefix>reward/<name>_mean`, `_std`), so a component that climbs while another falls (reward hacking) shows.

Every reward is an `async def rm(reward_config, samples) -> list[float | dict]`: a built-in reads the run's
`RewardConfig` (`config.reward`, whose fields are named after the flags' dests, so a user's code may pass its
own `args` instead); `--custom-rm-path` is `async def rm(args, samples)`, handed the read-only `args` by
miles/rollout/hooks.py. A NaN or infinite value, an exception, a non-number or a list of the wrong length is a
`MilesUserError` naming the reward and the sample (index and prompt), never a silent zero.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import numbers
from typing import Any, Awaitable, Callable, Sequence

import torch

from miles.config.rollout_sections import RewardSelection
from miles.config.sections import HookArgs, RewardConfig, RunConfig, run_config_of
from miles.rollout.hooks import with_hook_args
from miles.rollout.rm_hub.builtin import brightness_rm, jpeg_compressibility_rm
from miles.types import Sample
from miles.utils.errors import MilesUserError, PartDiedError
from miles.utils.imports import load_function

logger = logging.getLogger(__name__)

RewardFn = Callable[[Any, list[Sample]], Awaitable[list[Any]]]
CUSTOM_RM_TYPE = "custom"


def _lazy_reward(module: str, name: str) -> RewardFn:
    """A built-in reward imported on its first call: model rewards pull in transformers, OCR pulls in rapidocr,
    and a run that uses neither should not pay for them."""

    def reward(reward_config, samples):
        return getattr(importlib.import_module(f"miles.rollout.rm_hub.{module}"), name)(reward_config, samples)

    reward.__name__ = name
    return reward


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "pickscore": _lazy_reward("pickscore", "pickscore_rm"),
    "ocr": _lazy_reward("ocr", "ocr_rm"),
    "remote_rm": _lazy_reward("remote", "remote_rm"),
    "jpeg_compressibility": jpeg_compressibility_rm,
    "brightness": brightness_rm,
    "clipscore": _lazy_reward("clipscore", "clipscore_rm"),
    "aesthetic": _lazy_reward("aesthetic", "aesthetic_rm"),
    "vlm_judge": _lazy_reward("vlm_judge", "vlm_judge_rm"),
    "geneval": _lazy_reward("geneval", "geneval_rm"),
    "shapes": _lazy_reward("shapes", "shapes_rm"),
}


def _shapes_row_check(metadata: Any) -> None:
    from miles.rollout.rm_hub.shapes import scene_of

    scene_of(metadata)


# The built-in rewards that read each prompt row's metadata, with what they need of it (a ValueError saying what
# is missing): the preflight runs these on the first rows of every prompt file, so a row the reward cannot score
# fails before Ray starts, naming the file and line, not in the first rollout.
ROW_METADATA_CHECKS: dict[str, Callable[[Any], None]] = {"shapes": _shapes_row_check}


def _model_pool_getter(rm_type: str) -> Callable[[Any], Any] | None:
    """The pool getter of a reward that loads a model into workers, or None for the others."""
    if rm_type == "pickscore":
        from miles.rollout.rm_hub.pickscore import get_pickscore_pool

        return get_pickscore_pool
    if rm_type == "clipscore":
        from miles.rollout.rm_hub.clipscore import get_clipscore_pool

        return get_clipscore_pool
    if rm_type == "aesthetic":
        from miles.rollout.rm_hub.aesthetic import get_aesthetic_pool

        return get_aesthetic_pool
    return None


MODEL_REWARDS = ("pickscore", "clipscore", "aesthetic")


def split_reward_spec(spec: str) -> list[str]:
    """ "ocr, pickscore" -> ["ocr", "pickscore"]."""
    return [part.strip() for part in str(spec).split(",") if part.strip()]


def configured_reward_types(reward_config: RewardConfig, eval_specs: Sequence[str | None] = ()) -> list[str]:
    """The built-in rewards the flags name: `--rm-type` (unless `--custom-rm-path` takes its place) and the eval
    sets' `rm_type`s. Rewards named only in prompt metadata are found at their first use."""
    specs = [] if reward_config.custom_rm_path else [reward_config.rm_type]
    specs += list(eval_specs)
    return list(dict.fromkeys(rm_type for spec in specs if spec for rm_type in split_reward_spec(spec)))


def model_reward_workers(reward_config: RewardConfig, reward_types: Sequence[str]) -> int:
    """How many Ray workers the model rewards among `reward_types` start (for --colocate-reward)."""
    from miles.rollout.rm_hub.clipscore import clip_reward_workers

    counts = {"pickscore": reward_config.pickscore_num_workers}
    counts["clipscore"] = counts["aesthetic"] = clip_reward_workers(reward_config)[0]
    return sum(counts[rm_type] for rm_type in set(reward_types) if rm_type in counts)


def load_reward_models(reward_config: RewardConfig, reward_types: Sequence[str]) -> None:
    """Start the workers of the model rewards among `reward_types` and wait until their models are loaded
    (behind a progress bar), so a wrong model path fails at start-up instead of in the first rollout."""
    for rm_type in dict.fromkeys(reward_types):
        getter = _model_pool_getter(rm_type)
        if getter is not None:
            getter(reward_config)


def load_custom_rm(path: str) -> RewardFn:
    fn = load_function(path, "--custom-rm-path", required_params=2)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise MilesUserError(f"--custom-rm-path {path!r}: must be an `async def rm(args, samples) -> list[float]`")
    return fn


def reward_spec(metadata: Any, rm_type: str | None, custom_rm_path: str | None) -> str | None:
    """The reward a sample (or its prompt row) goes to: its `metadata.rm_type`, else the custom reward under
    --custom-rm-path, else --rm-type; None when none is named. The preflight reads prompt rows by this rule too."""
    own = metadata.get("rm_type") if isinstance(metadata, dict) else None
    if own:
        return str(own)
    return CUSTOM_RM_TYPE if custom_rm_path else (rm_type or None)


def _reward_type(reward_config: RewardConfig, sample: Sample) -> str:
    spec = reward_spec(sample.metadata, reward_config.rm_type, reward_config.custom_rm_path)
    if spec:
        return spec
    raise MilesUserError(
        f"no reward for sample {sample.index} (prompt {sample.prompt[:60]!r}): set --rm-type or --custom-rm-path "
        "(or metadata.rm_type in the prompt data)"
    )


def _reward_fn(config: RunConfig, rm_type: str) -> Callable[[list[Sample]], Awaitable[list[Any]]]:
    """The reward as a function of the samples: a built-in bound to `config.reward`, the custom one to `args`."""
    if rm_type == CUSTOM_RM_TYPE:
        if not config.reward.custom_rm_path:
            raise MilesUserError("metadata rm_type 'custom' needs --custom-rm-path")
        return with_hook_args(load_custom_rm(config.reward.custom_rm_path), config)
    if rm_type not in BUILTIN_REWARDS:
        raise MilesUserError(f"unknown reward type {rm_type!r}; built-in: {sorted(BUILTIN_REWARDS)} or 'custom'")
    return functools.partial(BUILTIN_REWARDS[rm_type], config.reward)


def _describe(sample: Sample) -> str:
    return f"sample {sample.index} (group {sample.group_index}, prompt {sample.prompt[:80]!r})"


def _checked_value(rm_type: str, sample: Sample, value: Any) -> float | dict[str, float]:
    """A finite float, or a dict of finite floats; anything else names the reward and the sample."""

    def as_float(number: Any, where: str) -> float:
        if isinstance(number, torch.Tensor) and number.numel() == 1:
            number = number.item()
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise MilesUserError(f"reward {rm_type!r} returned {type(number).__name__} {number!r}{where} for {_describe(sample)}")
        number = float(number)
        if not math.isfinite(number):
            raise MilesUserError(f"reward {rm_type!r} returned {number}{where} for {_describe(sample)}")
        return number

    if isinstance(value, dict):
        if not value:
            raise MilesUserError(f"reward {rm_type!r} returned an empty dict for {_describe(sample)}")
        return {str(key): as_float(item, f" at key {key!r}") for key, item in value.items()}
    return as_float(value, "")


async def _score_one(config: RunConfig, rm_type: str, samples: list[Sample]) -> list[Any]:
    fn = _reward_fn(config, rm_type)
    try:
        rewards = await fn(samples)
    except (MilesUserError, PartDiedError):
        raise
    except Exception as err:
        where = _describe(samples[0]) if len(samples) == 1 else f"{len(samples)} samples starting at {_describe(samples[0])}"
        # the run ends in the one line below; the traceback says where in the reward's code it went wrong
        logger.error("reward %r raised %s on %s", rm_type, type(err).__name__, where, exc_info=err)
        raise MilesUserError(f"reward {rm_type!r} raised {type(err).__name__}: {err} on {where}") from err
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise MilesUserError(
            f"reward {rm_type!r} returned {got} for {len(samples)} samples (first: {_describe(samples[0])})"
        )
    return [_checked_value(rm_type, sample, value) for sample, value in zip(samples, rewards)]


async def _score(config: RunConfig, spec: str, samples: list[Sample]) -> list[Any]:
    """Every reward of the spec on the samples, combined into one reward per sample (see the module docstring)."""
    rm_types = split_reward_spec(spec)
    if not rm_types:
        raise MilesUserError(f"reward spec {spec!r} names no reward (for {_describe(samples[0])})")
    named = bool(config.reward.reward_weights)  # weights need every component under its name
    if len(rm_types) == 1 and not named:
        return await _score_one(config, rm_types[0], samples)
    results = await asyncio.gather(*(_score_one(config, rm_type, samples) for rm_type in rm_types))
    combined: list[dict[str, float]] = []
    for position, sample in enumerate(samples):
        components: dict[str, float] = {}
        for rm_type, values in zip(rm_types, results):
            value = values[position]
            for key, number in (value.items() if isinstance(value, dict) else [(rm_type, value)]):
                if key in components:
                    raise MilesUserError(
                        f"reward component {key!r} comes from two of the rewards {rm_types} for {_describe(sample)}"
                    )
                components[key] = number
        combined.append(components)
    return combined


async def batched_async_rm(config: RunConfig | HookArgs, samples: Sequence[Sample],
                           evaluation: bool = False) -> list[float | dict]:
    """One reward per sample, in order. Each reward type gets one call per batch, or one per prompt group
    with `--group-rm` (the calls run concurrently). `config`: the run's; a hook that scores samples itself passes
    its `args`."""
    config = run_config_of(config)
    samples = list(samples)
    if not samples:
        return []
    batches: dict[tuple, list[int]] = {}
    for position, sample in enumerate(samples):
        key: tuple = (_reward_type(config.reward, sample),)
        if config.reward.group_rm:
            key += (sample.group_index,)
        batches.setdefault(key, []).append(position)
    keys = list(batches)
    results = await asyncio.gather(*(_score(config, key[0], [samples[i] for i in batches[key]]) for key in keys))
    rewards: list[Any] = [None] * len(samples)
    for key, batch_rewards in zip(keys, results):
        for position, reward in zip(batches[key], batch_rewards):
            rewards[position] = reward
    return rewards


def weighted_reward(weights: dict[str, float], reward: float | dict, flag: str = "--reward-weights") -> float:
    """Σ weight·component over the weighted components the reward has (a sample routed to one reward of a mixed
    dataset has only that one); a reward with none of them, or a plain float, is an error."""
    if not isinstance(reward, dict):
        raise MilesUserError(
            f"{flag} needs named reward components, but a sample has the plain reward {reward!r} (set by "
            "--custom-generate-function-path?)"
        )
    present = [key for key in weights if key in reward]
    if not present:
        raise MilesUserError(f"{flag} {weights} names none of the sample's reward components {sorted(reward)}")
    return float(sum(weights[key] * float(reward[key]) for key in present))


def reward_value(selection: RewardSelection, reward: float | dict | None, evaluation: bool = False) -> float:
    """The scalar reward: a float as is; from a dict, the value at `--reward-key` (evaluation:
    `--eval-reward-key`, defaulting to `--reward-key`), or with `--reward-weights` the weighted sum.
    `selection`: the run's `config.reward_selection`; a hook passes its `args` (the same names)."""
    if reward is None:
        raise MilesUserError("a sample reached advantage computation without a reward")
    key, flag = selection.reward_key, "--reward-key"
    if evaluation and selection.eval_reward_key:
        key, flag = selection.eval_reward_key, "--eval-reward-key"  # an eval key wins over the training weights
    elif selection.reward_weights:
        return weighted_reward(selection.reward_weights, reward)
    if not isinstance(reward, dict):
        return float(reward)
    if key is None:
        raise MilesUserError(
            f"the reward is a dict with keys {sorted(reward)}: set --reward-key to choose one or --reward-weights "
            "to sum them"
        )
    if key not in reward:
        raise MilesUserError(f"{flag} {key!r} is not in the reward dict (keys: {sorted(reward)})")
    return float(reward[key])


def reward_component_metrics(rewards: Sequence[float | dict | None], prefix: str) -> dict[str, float]:
    """`<prefix>reward/<name>_mean` and `_std` of every component of the dict rewards (each over the samples that
    have it; std with Bessel's correction, 0 for one sample)."""
    values: dict[str, list[float]] = {}
    for reward in rewards:
        if isinstance(reward, dict):
            for key, value in reward.items():
                values.setdefault(key, []).append(float(value))
    metrics: dict[str, float] = {}
    for key, items in sorted(values.items()):
        tensor = torch.tensor(items, dtype=torch.float64)
        metrics[f"{prefix}reward/{key}_mean"] = tensor.mean().item()
        metrics[f"{prefix}reward/{key}_std"] = tensor.std().item() if len(items) > 1 else 0.0
    return metrics


def shutdown_reward_pools() -> None:
    """Kill the reward Ray actors (model rewards and OCR), if any were started."""
    import sys

    for module_name, fn_name in (
        ("miles.rollout.rm_hub.workers", "shutdown_scorer_pools"),
        ("miles.rollout.rm_hub.ocr", "shutdown_ocr_pools"),
    ):
        if module_name in sys.modules:
            getattr(sys.modules[module_name], fn_name)()


__all__ = [
    "BUILTIN_REWARDS",
    "MODEL_REWARDS",
    "batched_async_rm",
    "configured_reward_types",
    "load_reward_models",
    "model_reward_workers",
    "reward_component_metrics",
    "reward_value",
    "shutdown_reward_pools",
    "split_reward_spec",
    "weighted_reward",
]
