"""The `train_diffusion.py` command line: parser assembly, YAML override, parsing and the user-path check.

The command line is split along its concepts; this module is its public face and re-exports the rest:
- `miles.config.flags`: every flag, declared once (`Flag`), grouped like docs/cli-reference.md's tables, from
  three sources (`FSDPArgs`, the miles flags, the engine's `ServerArgs` as `--sglang-*` passthrough);
- `miles.config.validation`: the cross-flag rules and derived values (`validate_args`, `DERIVED_ATTRIBUTES`);
- `miles.config.batch_geometry`: prompts -> train pairs -> micro-batches of one rollout (docs/algorithms.md §3, §5);
- `miles.config.cli_docs`: docs/cli-reference.md and the `--dry-run` report, rendered from the declarations.

`parse_args` parses, applies `--custom-config-path` (the YAML wins, one warning per collision), then runs
`validate_args` on the final values, so a YAML file cannot bypass a rule. Every user mistake is one
`MilesUserError` naming the flags and values; the entry point prints it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
from typing import TYPE_CHECKING, Any

from miles.config.batch_geometry import (  # noqa: F401 - re-exported
    STEP_STRATEGY_HUB,
    BatchGeometry,
    batch_geometry,
    step_strategy,
    trained_steps_per_trajectory,
)
from miles.config.flags import (  # noqa: F401 - re-exported
    MIB,
    MILES_GROUPS,
    SGLANG_GROUP,
    F,
    Flag,
    P,
    S,
    all_flags,
    byte_size,
    comma_list,
    default_text,
    finite_float,
    flag_groups,
    int_list,
    int_pair,
    parse_reward_weights,
    reward_weights,
)
from miles.config.validation import (  # noqa: F401 - re-exported
    DERIVED_ATTRIBUTES,
    RULES,
    _torch_version,
    validate_args,
)
from miles.utils.errors import MilesUserError

if TYPE_CHECKING:
    from miles.config.preflight import ResumePoint

logger = logging.getLogger(__name__)


# ---- the parser: one argparse option per declared flag ------------------------------------------------------
class MilesArgumentParser(argparse.ArgumentParser):
    """argparse whose own errors (unknown flag, bad value) are one-line `MilesUserError`s (exit status 2)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        # Read "-1e-6" as a (negative) value, not as an unknown option; argparse only knows "-1" and "-0.5".
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):  # type: ignore[override]
        hints = []
        if message.startswith("unrecognized arguments:"):
            for token in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(token.split("=")[0], self._option_string_actions, n=1, cutoff=0.75)
                if token.startswith("--") and close:
                    hints.append(f"did you mean {close[0]} for {token}?")
        raise MilesUserError(" ".join([message, *hints, f"(see {self.prog} --help)"]))


def _add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
    names = [flag.name, *flag.aliases]
    help_text = (flag.help + (" [extension: not in the reference CLI]" if flag.extension else "")).replace("%", "%%")
    if flag.kind in ("switch", "tri", "toggle") and flag.action is None:
        if flag.kind == "switch":
            group.add_argument(*names, action="store_true", default=flag.default, help=help_text)
        else:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, default=flag.default,
                               help=f"{help_text} [default: {default_text(flag)}]")
        return
    if flag.kind == "switch":  # a custom zero-argument action
        group.add_argument(*names, action=flag.action, default=flag.default, help=help_text)
        return
    kwargs: dict[str, Any] = {"type": flag.type, "default": flag.default, "dest": flag.dest}
    if flag.choices:
        kwargs["choices"] = flag.choices
    if flag.nargs:
        kwargs["nargs"] = flag.nargs
    if flag.action:
        kwargs["action"] = flag.action
    metavar = flag.metavar or _METAVARS.get(flag.type_name or getattr(flag.type, "__name__", ""), "VALUE")
    if not flag.choices or flag.metavar:
        kwargs["metavar"] = tuple(metavar.split()) if " " in metavar else metavar
    kwargs["help"] = f"{help_text} [default: {default_text(flag)}]"
    group.add_argument(*names, **kwargs)


_METAVARS = {"int": "N", "float": "X", "finite_float": "X", "str": "STR", "str+": "STR", "path template": "TEMPLATE",
             "dir": "DIR"}


def build_parser() -> argparse.ArgumentParser:
    parser = MilesArgumentParser(
        prog="train_diffusion.py",
        usage="%(prog)s --hf-checkpoint PATH [options]   (--help lists every flag by group)",
        description="RL post-training (Flow-GRPO, DiffusionNFT, SFT) for image and video diffusion models.",
        allow_abbrev=False,
    )
    for title, flags in flag_groups():
        group = parser.add_argument_group(title)
        for flag in flags:
            _add_flag(group, flag)
    return parser


# ---- --custom-config-path ---------------------------------------------------------------------------------
ALIAS_DESTS = {"debug_train_only": "train_only"}
# An unknown YAML key this similar to a flag (difflib ratio) is taken for a typo of it.
YAML_TYPO_CUTOFF = 0.8


def coerce_flag_value(flag: Flag, value: Any) -> Any:
    """A YAML (or Python) value in the flag's parsed form (YAML reads `1e-4` as a string; "0,5" and [0, 5] both work)."""
    if value is None:
        return None
    if flag.kind in ("switch", "tri", "toggle"):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if flag.nargs:
        items = value if isinstance(value, list) else str(value).split()
        return [flag.type(str(item)) if flag.type else item for item in items]
    if flag.type in (int_pair, int_list, comma_list) and isinstance(value, list):
        value = ",".join(str(item) for item in value)
    if isinstance(value, dict) and getattr(flag.type, "__name__", "") == "json_object":
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, dict) and flag.type is reward_weights:  # a YAML mapping {ocr: 1, pickscore: 0.5}
        return parse_reward_weights(value)
    if isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a single {flag.type_name or flag.type.__name__} value, got {value!r}")
    if flag.type is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        value = int(value)
    return flag.type(str(value))


MAX_CONFIG_FILE_BYTES = 1 << 20  # a config file is a page of settings; more is a mistake (or an attack)
MAX_CONFIG_ALIASES = 100  # YAML aliases (`*name`): a few are handy, thousands build a "billion laughs" value
MAX_CONFIG_ITEMS = 100_000  # values once aliases are expanded (a log line or wandb would expand them)
_CONFIG_KEY = re.compile(r"^-{0,2}[A-Za-z][A-Za-z0-9_-]{0,99}$")


def _short(value: Any) -> str:
    """A value for a log line: its repr cut to 80 characters (a YAML value can be as large as the file)."""
    import reprlib

    shortener = reprlib.Repr()
    shortener.maxstring = shortener.maxother = 80
    return shortener.repr(value)[:120]


def _load_config_yaml(path: str, where: str) -> Any:
    """`yaml.safe_load` of a file of at most MAX_CONFIG_FILE_BYTES with at most MAX_CONFIG_ALIASES aliases."""
    import yaml

    class _BoundedLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_CONFIG_ALIASES:
                    raise MilesUserError(f"{where}: more than {MAX_CONFIG_ALIASES} YAML aliases (*name)")
            return super().compose_node(parent, index)

    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as err:
        raise MilesUserError(f"{where}: cannot read the file: {err.strerror}") from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise MilesUserError(f"{where}: larger than {MAX_CONFIG_FILE_BYTES} bytes; a config file holds flag values")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise MilesUserError(f"{where}: not UTF-8 text") from None
    except yaml.YAMLError as err:
        raise MilesUserError(f"{where}: not valid YAML: {' '.join(str(err).split())[:300]}") from None
    except RecursionError:
        raise MilesUserError(f"{where}: nested too deeply") from None
    pending, items = [data], 0
    while pending:  # shared (aliased) values count every time they appear, as they would when printed
        value = pending.pop()
        items += 1
        if items > MAX_CONFIG_ITEMS:
            raise MilesUserError(f"{where}: more than {MAX_CONFIG_ITEMS} values once its aliases are expanded")
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return data


def apply_config_file(args: argparse.Namespace) -> None:
    """Apply --custom-config-path: the YAML wins over the command line, with one warning per overridden flag.

    An unknown key close to a flag name is an error with a "did you mean"; other unknown keys land on args (with
    a warning) for custom hooks, as the reference does. Keys must be names (letters, digits, `_`, `-`; not
    `__class__`), and the file is bounded in size and YAML aliases (`_load_config_yaml`).
    """
    path = args.custom_config_path
    where = f"--custom-config-path {path!r}"
    data = _load_config_yaml(path, where)
    if data is None:
        return
    if not isinstance(data, dict):
        raise MilesUserError(f"{where}: expected a mapping of flag names to values, got a {type(data).__name__}")
    flags = all_flags()
    for raw_key, value in data.items():
        if not isinstance(raw_key, str) or not _CONFIG_KEY.match(raw_key):
            raise MilesUserError(f"{where}: key {_short(raw_key)} is not a flag name (letters, digits, '_' and '-', "
                                 "starting with a letter)")
        key = raw_key.lstrip("-").replace("-", "_")
        key = ALIAS_DESTS.get(key, key)
        flag = flags.get(key)
        if flag is None:
            # Close to a flag: a typo that would silently leave the flag at its default. Far from every flag: a
            # setting for the user's own hooks, which read it from args (the reference loads every YAML key).
            close = difflib.get_close_matches(key, flags, n=1, cutoff=YAML_TYPO_CUTOFF)
            if close:
                raise MilesUserError(f"{where}: unknown key {raw_key!r}: did you mean {close[0]!r} "
                                     f"({flags[close[0]].name})?")
            logger.warning("%s: key %r is not a miles flag; setting args.%s = %s for your hooks", where, raw_key, key,
                           _short(value))
            setattr(args, key, value)
            continue
        try:
            new_value = coerce_flag_value(flag, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            raise MilesUserError(f"{where}: key {raw_key!r} ({flag.name}): {err}") from None
        logger.warning("%s: key %r overrides %s (%s -> %s)", where, raw_key, flag.name, _short(getattr(args, key)),
                       _short(new_value))
        setattr(args, key, new_value)
        if key == "offload" and new_value:
            args.offload_train = args.offload_rollout = True


# ---- parsing ------------------------------------------------------------------------------------------------
def check_user_paths(args: argparse.Namespace) -> "ResumePoint":
    """Import every user-given dotted path (defaults are the project's own), then check the files and folders the
    run will use (`miles.config.preflight`: prompt files, --save/--output-dir writable, the --load checkpoint).

    Separate from `validate_args` because it imports user code and reads files; the entry point calls it right
    after parsing, before Ray starts, and `--dry-run` runs it too.
    """
    from miles.utils.imports import load_object
    from miles.config.preflight import check_run_inputs

    for dest, flag in all_flags().items():
        value = getattr(args, dest, None)
        if flag.dotted and value and value != flag.default:
            load_object(value, flag.name)
    return check_run_inputs(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, apply --custom-config-path, validate and derive. Raises MilesUserError on any user mistake."""
    args = build_parser().parse_args(argv)
    for dest, flag in all_flags().items():
        if isinstance(flag.default, (dict, list)) and getattr(args, dest) is flag.default:
            setattr(args, dest, type(flag.default)(flag.default))  # never share a mutable default between runs
    if args.custom_config_path:
        apply_config_file(args)
    validate_args(args)
    return args


def format_dry_run(args: argparse.Namespace, length_rule: str = "--num-rollout", start_rollout_id: int = 0) -> str:
    """The resolved configuration, the batch geometry and the run's schedule, as `--dry-run` prints them."""
    from miles.config.cli_docs import render_dry_run

    return render_dry_run(args, length_rule, start_rollout_id)
