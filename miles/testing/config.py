"""Run configurations for tests and benchmarks, built from the flag declarations (no default is listed here).

- `parsed_config(argv)`: the full path of `train_diffusion.py` (parse, YAML, every rule), as a `RunConfig`.
- `trainer_config(**values)`: a configuration without a rollout plan: the declared defaults, the given values
  (by flag dest, parsed the way the YAML merge parses them), then every rule except those about the rollout
  batch geometry and the prompt data (`TRAINER_RULES`): tests hand the trainer, the rewards or the rollout
  function samples and prompts of their own.
- `hook_args(**values)`: the same configuration as the read-only `args` hooks receive (`router_url` sets
  `args.miles_router_url`).
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from miles.config.arguments import build_parser, coerce_flag_value, parse_args
from miles.config.flags import all_flags
from miles.config.sections import HookArgs, RunConfig
from miles.config.validation import validation_rules

# Engine-free trainer tests run one rollout, one optimizer step and no numeric-parity patch group unless told.
TRAINER_TEST_VALUES: dict[str, Any] = dict(num_rollout=1, num_steps_per_rollout=1, rollout_patch_group=["none"])
# The rules `trainer_config` runs, by name (miles.config.validation.RULES).
TRAINER_RULES = ("values", "topology", "placement", "modes", "loss", "reference", "optimizer", "reward", "eval",
                 "outputs", "parity")


def parsed_config(argv: Sequence[str]) -> RunConfig:
    """`parse_args(argv)` as a `RunConfig`."""
    return RunConfig.from_args(parse_args(list(argv)))


def trainer_namespace(hf_checkpoint: str = "unused", **values: Any) -> argparse.Namespace:
    """The validated namespace `trainer_config` builds its sections from."""
    flags = all_flags()
    unknown = sorted(set(values) - set(flags))
    if unknown:  # derived values (DERIVED_ATTRIBUTES) come from the rules, never from a caller
        raise KeyError(f"not flags: {unknown}")
    args = build_parser().parse_args(["--hf-checkpoint", hf_checkpoint])
    for dest, value in {**TRAINER_TEST_VALUES, **values}.items():
        setattr(args, dest, coerce_flag_value(flags[dest], value))
    if "actor_num_gpus_per_node" not in values:  # a world the SP x replicate grid fits in
        args.actor_num_gpus_per_node = args.sequence_parallel_size * args.dp_replicate_size
        args.num_gpus_per_node = max(args.num_gpus_per_node, args.actor_num_gpus_per_node)
    args.diffusion_model_family_resolved = args.diffusion_model_family
    for rule in validation_rules(TRAINER_RULES):
        rule(args)
    args.debug_train_only = args.train_only
    return args


def trainer_config(hf_checkpoint: str = "unused", **values: Any) -> RunConfig:
    """A trainer's `RunConfig`: declared defaults, `values` (by flag dest), the trainer rules."""
    return RunConfig.from_args(trainer_namespace(hf_checkpoint, **values))


def hook_args(hf_checkpoint: str = "unused", *, router_url: str | None = None, **values: Any) -> HookArgs:
    """The read-only `args` hooks and the rollout side receive, for `trainer_config(hf_checkpoint, **values)`."""
    config = trainer_config(hf_checkpoint, **values)
    return (config.with_router_url(router_url) if router_url else config).hook_args
