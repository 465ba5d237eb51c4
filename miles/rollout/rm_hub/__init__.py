"""Reward dispatch: which reward scores which sample, and the checks every reward's output passes.

`batched_async_rm(args, samples, evaluation)` routes each sample by
`sample.metadata.get("rm_type")`, else `--custom-rm-path` (when given), else `--rm-type`, calls each reward
once per batch (or once per prompt group with `--group-rm`), and returns one reward per sample in the input
order, a float or a dict of floats. It does not write `sample.reward`: the caller does.

Every reward is an `async def rm(args, samples) -> list[float | dict]`. A NaN or infinite value, an
exception, a non-number or a list of the wrong length is a `MilesUserError` naming the reward and the
sample (index and prompt), never a silent zero. `reward_value` picks the scalar out of a dict reward with
`--reward-key` (or `--eval-reward-key` for evaluation).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from typing import Any, Awaitable, Callable, Sequence

import torch

from miles.rollout.rm_hub.builtin import brightness_rm, jpeg_compressibility_rm
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function

RewardFn = Callable[[Any, list[Sample]], Awaitable[list[Any]]]
CUSTOM_RM_TYPE = "custom"


def _pickscore_rm(args, samples):
    from miles.rollout.rm_hub.pickscore import pickscore_rm

    return pickscore_rm(args, samples)


def _ocr_rm(args, samples):
    from miles.rollout.rm_hub.ocr import ocr_rm

    return ocr_rm(args, samples)


def _remote_rm(args, samples):
    from miles.rollout.rm_hub.remote import remote_rm

    return remote_rm(args, samples)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "pickscore": _pickscore_rm,
    "ocr": _ocr_rm,
    "remote_rm": _remote_rm,
    "jpeg_compressibility": jpeg_compressibility_rm,
    "brightness": brightness_rm,
}


def load_custom_rm(path: str) -> RewardFn:
    fn = load_function(path, "--custom-rm-path", required_params=2)
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise MilesUserError(f"--custom-rm-path {path!r}: must be an `async def rm(args, samples) -> list[float]`")
    return fn


def _reward_type(args, sample: Sample) -> str:
    rm_type = sample.metadata.get("rm_type") if isinstance(sample.metadata, dict) else None
    if rm_type:
        return str(rm_type)
    if getattr(args, "custom_rm_path", None):
        return CUSTOM_RM_TYPE
    if getattr(args, "rm_type", None):
        return args.rm_type
    raise MilesUserError(
        f"no reward for sample {sample.index} (prompt {sample.prompt[:60]!r}): set --rm-type or --custom-rm-path "
        "(or metadata.rm_type in the prompt data)"
    )


def _reward_fn(args, rm_type: str) -> RewardFn:
    if rm_type == CUSTOM_RM_TYPE:
        if not getattr(args, "custom_rm_path", None):
            raise MilesUserError("metadata rm_type 'custom' needs --custom-rm-path")
        return load_custom_rm(args.custom_rm_path)
    if rm_type not in BUILTIN_REWARDS:
        raise MilesUserError(f"unknown reward type {rm_type!r}; built-in: {sorted(BUILTIN_REWARDS)} or 'custom'")
    return BUILTIN_REWARDS[rm_type]


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


async def _score(args, rm_type: str, samples: list[Sample]) -> list[Any]:
    fn = _reward_fn(args, rm_type)
    try:
        rewards = await fn(args, samples)
    except MilesUserError:
        raise
    except Exception as err:
        where = _describe(samples[0]) if len(samples) == 1 else f"{len(samples)} samples starting at {_describe(samples[0])}"
        raise MilesUserError(f"reward {rm_type!r} raised {type(err).__name__}: {err} on {where}") from err
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise MilesUserError(
            f"reward {rm_type!r} returned {got} for {len(samples)} samples (first: {_describe(samples[0])})"
        )
    return [_checked_value(rm_type, sample, value) for sample, value in zip(samples, rewards)]


async def batched_async_rm(args, samples: Sequence[Sample], evaluation: bool = False) -> list[float | dict]:
    """One reward per sample, in order. Each reward type gets one call per batch, or one per prompt group
    with `--group-rm` (the calls run concurrently)."""
    samples = list(samples)
    if not samples:
        return []
    batches: dict[tuple, list[int]] = {}
    for position, sample in enumerate(samples):
        key: tuple = (_reward_type(args, sample),)
        if getattr(args, "group_rm", False):
            key += (sample.group_index,)
        batches.setdefault(key, []).append(position)
    keys = list(batches)
    results = await asyncio.gather(*(_score(args, key[0], [samples[i] for i in batches[key]]) for key in keys))
    rewards: list[Any] = [None] * len(samples)
    for key, batch_rewards in zip(keys, results):
        for position, reward in zip(batches[key], batch_rewards):
            rewards[position] = reward
    return rewards


def reward_value(args, reward: float | dict | None, evaluation: bool = False) -> float:
    """The scalar reward: a float as is; from a dict, the value at `--reward-key` (evaluation:
    `--eval-reward-key`, defaulting to `--reward-key`)."""
    if reward is None:
        raise MilesUserError("a sample reached advantage computation without a reward")
    if not isinstance(reward, dict):
        return float(reward)
    key = getattr(args, "reward_key", None)
    flag = "--reward-key"
    if evaluation and getattr(args, "eval_reward_key", None):
        key, flag = args.eval_reward_key, "--eval-reward-key"
    if key is None:
        raise MilesUserError(f"the reward is a dict with keys {sorted(reward)}: set --reward-key to choose one")
    if key not in reward:
        raise MilesUserError(f"{flag} {key!r} is not in the reward dict (keys: {sorted(reward)})")
    return float(reward[key])


def shutdown_reward_pools() -> None:
    """Kill the PickScore and OCR Ray actors (if any were started)."""
    import sys

    for module_name, fn_name in (
        ("miles.rollout.rm_hub.pickscore", "shutdown_pickscore_pools"),
        ("miles.rollout.rm_hub.ocr", "shutdown_ocr_pools"),
    ):
        if module_name in sys.modules:
            getattr(sys.modules[module_name], fn_name)()


__all__ = ["BUILTIN_REWARDS", "batched_async_rm", "reward_value", "shutdown_reward_pools"]
