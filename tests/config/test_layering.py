"""The configuration's boundaries, checked on the source: flags are read through the config package's objects
(no `getattr(args, "x", default)` elsewhere), `miles.utils` stays a leaf, and the engine and the math core do not
depend on the config package at run time."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "miles"


def sources(*parts: str) -> list[pathlib.Path]:
    return sorted(PACKAGE.joinpath(*parts).rglob("*.py"))


def runtime_imports(path: pathlib.Path) -> set[str]:
    """Modules imported outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_getattr_defaults_on_args_outside_the_config_package():
    pattern = re.compile(r"getattr\(\s*(self\.)?args\b")
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{number}"
                 for path in sources() if "config" not in path.relative_to(PACKAGE).parts[:1]
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if pattern.search(line)]
    assert offenders == []


@pytest.mark.parametrize("area, allowed", [
    ("utils", ("miles.utils",)),
    ("engine", ("miles.engine", "miles.router", "miles.utils", "miles.models", "miles.diffusion", "miles.types")),
    ("diffusion", ("miles.diffusion", "miles.utils", "miles.types")),
])
def test_lower_layers_do_not_import_higher_ones(area, allowed):
    offenders = {}
    for path in sources(area):
        upward = sorted(name for name in runtime_imports(path)
                        if name.startswith("miles") and name != "miles" and not name.startswith(allowed))
        if upward:
            offenders[str(path.relative_to(PACKAGE.parent))] = upward
    assert offenders == {}
