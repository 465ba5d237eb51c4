"""The rule that a reward of several components has its scalar named, in one place: validation applies it to
--rm-type, the preflight to a prompt row's own `metadata.rm_type`; miles/rollout/rm_hub combines the components
this way and `reward_value` takes the scalar so."""

from __future__ import annotations

import argparse

from miles.config.flags import BUILTIN_REWARD_OUTPUTS, RUNTIME_KEYS
from miles.utils.errors import MilesUserError


def reward_components(spec: str) -> tuple[str, ...] | None:
    """The components a reward spec ("ocr,shapes") gives each sample, as miles/rollout/rm_hub combines them (a
    float reward is one component named after it, a dict reward its keys); None when one of its rewards is not
    built in or its service decides."""
    names = [part.strip() for part in str(spec).split(",") if part.strip()]
    outputs = [BUILTIN_REWARD_OUTPUTS.get(name, RUNTIME_KEYS) for name in names]
    if not names or RUNTIME_KEYS in outputs:
        return None
    return tuple(key for name, output in zip(names, outputs) for key in (output or (name,)))


def check_reward_selection(args: argparse.Namespace, spec: str, evaluation: bool, where: str) -> None:
    """The scalar of a reward of several components is named, as `rm_hub.reward_value` takes it: by the key
    (evaluation: --eval-reward-key, else --reward-key) or, unless an eval key is set, by --reward-weights. `where`
    says whose reward `spec` is (`--rm-type`, or the prompt row that routes to it)."""
    components = reward_components(spec)
    if components is None or (components == (spec,) and BUILTIN_REWARD_OUTPUTS[spec] is None):
        return  # its service decides, or one float
    if evaluation and args.eval_reward_key:
        flag, key = "--eval-reward-key", args.eval_reward_key
    elif args.reward_weights:
        return
    else:
        flag, key = "--reward-key", args.reward_key
    if key is None:
        raise MilesUserError(f"{where} {spec} gives {len(components)} reward components per sample "
                             f"({', '.join(components)}): set --reward-weights (e.g. {'=1,'.join(components)}=1) or "
                             "--reward-key (one of them)")
    if key not in components:
        raise MilesUserError(f"{flag} {key!r} is none of the components of {where} {spec}: {list(components)}")
