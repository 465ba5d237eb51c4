"""The rollout side's adapter to user code: every dotted-path hook is loaded and checked here, and every call of
one goes through here, which is where the typed configuration becomes the read-only `args` a hook receives
(docs/customization.md, docs/design.md §9).

`load_rollout_hooks(config)` imports each `--*-path` flag that is set and checks the object's arity (and that
async hooks are coroutine functions), so a typo or a wrong signature fails before any GPU work with a
`MilesUserError` naming the flag. Unset flags stay None (the default behaviour applies), except the
rollout and eval functions, which always resolve.

The built-in code holds a `RunConfig` and calls a hook through the helpers below (`call_rollout_function`,
`call_generate`, the filters, `call_rollout_log`, `with_hook_args` for the hooks other modules load: the reward,
the reward post-process, the step strategy, the buffer filter, the data source class); each passes
`hook_args_of(config)`, so no other module of the rollout side reads `args`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from miles.config.sections import HookArgs, RunConfig
from miles.types import Sample
from miles.utils.errors import MilesUserError
from miles.utils.imports import load_function, load_object


@dataclass(frozen=True)
class HookSpec:
    flag: str
    attribute: str  # the args attribute (flag name with underscores)
    field: str  # the RolloutHooks field
    num_params: int  # positional arguments the hook must accept
    is_async: bool = False
    signature: str = ""


HOOK_SPECS: tuple[HookSpec, ...] = (
    HookSpec("--rollout-function-path", "rollout_function_path", "rollout_function", 3, False,
             "fn(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]"),
    HookSpec("--eval-function-path", "eval_function_path", "eval_function", 3, False,
             "fn(args, rollout_id, data_source, evaluation=True) -> results"),
    HookSpec("--custom-generate-function-path", "custom_generate_function_path", "custom_generate", 3, True,
             "async fn(args, group: list[Sample], sampling_params: dict) -> list[Sample]"),
    HookSpec("--dynamic-sampling-filter-path", "dynamic_sampling_filter_path", "dynamic_sampling_filter", 2, False,
             "fn(args, group: list[Sample]) -> bool"),
    HookSpec("--rollout-sample-filter-path", "rollout_sample_filter_path", "rollout_sample_filter", 2, False,
             "fn(args, samples: list[Sample]) -> None"),
    HookSpec("--buffer-filter-path", "buffer_filter_path", "buffer_filter", 4, False,
             "fn(args, rollout_id, buffer: list[list[Sample]], num_groups) -> list[list[Sample]]"),
    HookSpec("--custom-convert-samples-to-train-data-path", "custom_convert_samples_to_train_data_path",
             "convert_samples_to_train_data", 2, False, "fn(args, samples: list[Sample]) -> list[TrainPair]"),
    HookSpec("--custom-expand-samples-to-train-pairs-path", "custom_expand_samples_to_train_pairs_path",
             "expand_samples_to_train_pairs", 2, False, "fn(args, sample: Sample) -> list[TrainPair]"),
    HookSpec("--custom-rollout-log-function-path", "custom_rollout_log_function_path", "rollout_log", 4, False,
             "fn(rollout_id, args, samples, metrics: dict) -> bool"),
    HookSpec("--custom-eval-rollout-log-function-path", "custom_eval_rollout_log_function_path", "eval_rollout_log",
             4, False, "fn(rollout_id, args, samples, metrics: dict) -> bool"),
    HookSpec("--custom-rm-path", "custom_rm_path", "custom_rm", 2, True, "async fn(args, samples) -> list[float]"),
    HookSpec("--custom-reward-post-process-path", "custom_reward_post_process_path", "reward_post_process", 2, False,
             "fn(args, samples) -> list[float]"),
)


# What a `--data-source-path` class must have (docs/customization.md).
REQUIRED_METHODS = ("get_samples", "add_samples", "state_dict", "load_state_dict")


@dataclass
class RolloutHooks:
    rollout_function: Callable
    eval_function: Callable
    custom_generate: Callable | None = None
    dynamic_sampling_filter: Callable | None = None
    rollout_sample_filter: Callable | None = None
    buffer_filter: Callable | None = None
    convert_samples_to_train_data: Callable | None = None
    expand_samples_to_train_pairs: Callable | None = None
    rollout_log: Callable | None = None
    eval_rollout_log: Callable | None = None
    custom_rm: Callable | None = None
    reward_post_process: Callable | None = None
    data_source_class: Any | None = None


def _is_coroutine_function(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _load(spec: HookSpec, path: str) -> Callable:
    fn = load_function(path, spec.flag, required_params=spec.num_params)
    if spec.is_async and not _is_coroutine_function(fn):
        raise MilesUserError(f"{spec.flag} {path!r}: must be an async function: {spec.signature}")
    return fn


def hook_args_of(config: RunConfig | HookArgs | None) -> HookArgs | None:
    """The `args` a user hook receives: the run's read-only view (`RunConfig.hook_args`). Already `args` (a
    hook's own call of a built-in, a test's stand-in) passes through."""
    return config.hook_args if isinstance(config, RunConfig) else config


def with_hook_args(fn: Callable, config: RunConfig | HookArgs | None) -> Callable:
    """`fn(args, ...)` as a function of the other arguments: how a module that loaded a hook calls it."""
    return functools.partial(fn, hook_args_of(config))


def load_rollout_hooks(config: RunConfig | HookArgs) -> RolloutHooks:
    """Import and check every hook flag that is set (MilesUserError naming the flag otherwise)."""
    loaded: dict[str, Any] = {}
    values = vars(hook_args_of(config))  # every flag is there: the run's read-only args
    for spec in HOOK_SPECS:
        path = values[spec.attribute]  # --rollout-function-path always has one (its declared default)
        if spec.field == "eval_function" and not path:
            continue  # defaults to the rollout function below
        if path:
            loaded[spec.field] = _load(spec, path)
    loaded.setdefault("eval_function", loaded["rollout_function"])
    data_source_path = values["data_source_path"]
    if data_source_path:
        cls = load_object(data_source_path, "--data-source-path")
        missing = [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
        if not callable(cls) or missing:
            raise MilesUserError(
                f"--data-source-path {data_source_path!r}: expected a class taking (args) with methods "
                f"{list(REQUIRED_METHODS)}" + (f"; missing {missing}" if missing else "")
            )
        loaded["data_source_class"] = cls
    return RolloutHooks(**loaded)


def call_rollout_function(hooks: RolloutHooks, config: RunConfig, rollout_id: int, data_source,
                          evaluation: bool = False, after_weight_version: int | None = None):
    """`--rollout-function-path` (or, with `evaluation`, `--eval-function-path`) on `data_source`.
    `after_weight_version` reaches only the built-in rollout (`--rollout-prefetch` is on only with it): a user's
    function keeps the reference's signature."""
    function = hooks.eval_function if evaluation else hooks.rollout_function
    if after_weight_version is not None:
        return function(hook_args_of(config), rollout_id, data_source, evaluation=evaluation,
                        after_weight_version=after_weight_version)
    return function(hook_args_of(config), rollout_id, data_source, evaluation=evaluation)


async def call_generate(hooks: RolloutHooks, config: RunConfig, group: list[Sample], sampling_params: dict):
    """`--custom-generate-function-path` on one microgroup."""
    return await hooks.custom_generate(hook_args_of(config), group, sampling_params)


def call_rollout_log(hooks: RolloutHooks, config: RunConfig, rollout_id: int, samples: list[Sample],
                     metrics: dict[str, float], evaluation: bool = False) -> bool:
    """`--custom-(eval-)rollout-log-function-path`: True when it asks to skip the default logging (False unset)."""
    log = hooks.eval_rollout_log if evaluation else hooks.rollout_log
    return log is not None and bool(log(rollout_id, hook_args_of(config), samples, metrics))


def build_user_data_source(cls: Any, config: RunConfig) -> Any:
    """A `--data-source-path` class, built once as `Cls(args)`."""
    return cls(hook_args_of(config))


def apply_dynamic_sampling_filter(
    hooks: RolloutHooks, config: RunConfig | HookArgs | None, groups: Sequence[list[Sample]]
) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """Split groups into (kept, dropped) by `--dynamic-sampling-filter-path`; all kept when unset."""
    if hooks.dynamic_sampling_filter is None:
        return list(groups), []
    args = hook_args_of(config)
    kept, dropped = [], []
    for group in groups:
        keep = hooks.dynamic_sampling_filter(args, group)
        if not isinstance(keep, bool):
            raise MilesUserError(
                f"--dynamic-sampling-filter-path must return a bool (keep the group?), got {type(keep).__name__}"
            )
        (kept if keep else dropped).append(group)
    return kept, dropped


def apply_rollout_sample_filter(hooks: RolloutHooks, config: RunConfig | HookArgs | None,
                                samples: list[Sample]) -> int:
    """Run `--rollout-sample-filter-path` (it sets `sample.remove_sample = True`); returns the masked count.

    Masked samples keep their place in the batch: they count for advantage statistics (docs/algorithms.md §4)
    and the trainer gives their pairs `loss_mask = 0`.
    """
    if hooks.rollout_sample_filter is not None:
        result = hooks.rollout_sample_filter(hook_args_of(config), samples)
        if result is not None:
            raise MilesUserError(
                "--rollout-sample-filter-path must return None and mark samples with sample.remove_sample = True "
                f"(it returned {type(result).__name__})"
            )
    return sum(1 for sample in samples if sample.remove_sample)
