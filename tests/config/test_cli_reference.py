"""Every flag of the shared CLI reference (`<repo>/../shared/spec/cli-reference.md`) parses, has its documented
default, and shows up in `--help`. The flag list is read from the reference's tables, never copied here."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles.config.arguments import build_parser

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO.parent / "shared" / "spec" / "cli-reference.md"

pytestmark = pytest.mark.skipif(
    not SPEC.exists(), reason=f"the shared CLI reference is expected at {SPEC} (beside the clone, as in CI)"
)

FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*[a-z0-9](?![\w-])")
PLACEHOLDERS = {"--field-name"}  # the prose's pattern for FSDPArgs fields, not a flag
UNSET = {"–", "-", "unset", "derived", "from dataset", ""}


@dataclass
class SpecRow:
    flags: list[str]
    columns: dict[str, str]  # header -> cell
    line: int


def spec_rows() -> list[SpecRow]:
    """Rows of every `| Flag | ... |` table: the first cell may name several flags ("--a / --b", "--a × --b")."""
    rows, header = [], None
    for number, line in enumerate(SPEC.read_text(encoding="utf-8").splitlines(), 1):
        if "| Flag |" in line:
            header = [cell.strip() for cell in line[line.index("| Flag |"):].strip().strip("|").split("|")]
            continue
        if header and line.startswith("--") and "|" in line:
            cells = [cell.strip() for cell in line.strip().rstrip("|").split("|")]
            rows.append(SpecRow(FLAG.findall(cells[0]), dict(zip(header[1:], cells[1:])), number))
        elif header and not line.startswith(("--", "|")):
            header = None  # prose ends the table
    return rows


def parser_and_options() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    parser = build_parser()
    return parser, parser._option_string_actions


def documented_defaults(row: SpecRow) -> list[str | None]:
    """One documented default per flag of the row ("0.9 / 0.999" splits; "0.0" applies to every flag)."""
    text = row.columns.get("Default")
    if text is None:
        return [None] * len(row.flags)
    parts = [part.strip() for part in text.split(" / ")]
    return parts if len(parts) == len(row.flags) else [text] * len(row.flags)


def expected_value(text: str, action: argparse.Action):
    if text in UNSET:
        return None
    if text == "off":
        return False
    if text == "on":
        return True
    size = re.fullmatch(r"(\d+) MiB", text)
    if size:
        return int(size.group(1)) * 1024 * 1024
    if text.startswith("{"):
        return json.loads(text)
    try:
        return float(text)
    except ValueError:
        return text


def test_reference_has_tables():
    flags = {flag for row in spec_rows() for flag in row.flags}
    assert len(flags) > 150, f"only {len(flags)} flags read from {SPEC}; did the table format change?"


def test_every_flag_mentioned_in_the_reference_exists():
    _, options = parser_and_options()
    mentioned = set(FLAG.findall(SPEC.read_text(encoding="utf-8"))) - PLACEHOLDERS
    missing = sorted(flag for flag in mentioned if flag not in options)
    assert not missing, f"flags named in {SPEC} but unknown to the parser: {missing}"


def test_every_documented_default_matches():
    _, options = parser_and_options()
    wrong = []
    for row in spec_rows():
        for flag, text in zip(row.flags, documented_defaults(row)):
            if text is None:
                continue
            action = options[flag]
            expected, actual = expected_value(text, action), action.default
            if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
                same = math.isclose(expected, actual, rel_tol=1e-12)
            else:
                same = expected == actual
            if not same:
                wrong.append(f"line {row.line}: {flag} documented {text!r}, parser default {actual!r}")
    assert not wrong, "\n".join(wrong)


def sample_argv(flag: str, action: argparse.Action, type_text: str) -> list[str]:
    """A valid value for the flag, chosen from the reference's Type column and the parser's choices."""
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[-1])]
    by_type = {"int": ["3"], "float": ["0.5"], "JSON": ['{"A": "1"}'], '"lo,hi"': ["1,3"], '"1,2,3"': ["1,2,3"],
               "str+": ["a", "b"], "path template": ["dump/{rollout_id}.pt"], "dir": ["dump"]}
    if type_text in by_type:
        return [flag, *by_type[type_text]]
    for candidate in ("3", "0.5", "x"):  # summary tables have no Type column: the first value the parser takes
        try:
            action.type(candidate)
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            continue
        return [flag, candidate]
    return [flag, "x"]


def test_every_flag_parses():
    parser, options = parser_and_options()
    failures = []
    for row in spec_rows():
        for flag in row.flags:
            action = options[flag]
            argv = sample_argv(flag, action, row.columns.get("Type", ""))
            try:
                parsed = parser.parse_args(argv)
            except Exception as err:  # noqa: BLE001 - collect every failure, report them together
                failures.append(f"line {row.line}: {' '.join(argv)} -> {err}")
                continue
            if action.nargs == 0:
                # a switch sets True; the --no- form of a --x/--no-x pair sets False
                expected = not (flag.startswith("--no-") and not action.dest.startswith("no_"))
                if getattr(parsed, action.dest) is not expected:
                    failures.append(f"line {row.line}: {flag} gave args.{action.dest} = {getattr(parsed, action.dest)}")
            elif getattr(parsed, action.dest) is None:
                failures.append(f"line {row.line}: {' '.join(argv)} left args.{action.dest} unset")
    assert not failures, "\n".join(failures)


def test_help_lists_every_reference_flag(capsys):
    parser, _ = parser_and_options()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    flags = {flag for row in spec_rows() for flag in row.flags}
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", help_text))
    assert not missing, f"--help does not list: {missing}"
