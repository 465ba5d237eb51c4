"""The configuration's boundaries, checked on the source: flags are read through the config package's objects
(no `getattr(args, "x", default)` elsewhere), `miles.utils` stays a leaf, the engine and the math core do not
depend on the config package at run time, the rollout side reads the typed configuration (`args`, the hooks'
read-only view, only where user code is called), and no modules of `miles` import each other in a circle."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "miles"


def sources(*parts: str) -> list[pathlib.Path]:
    return sorted(PACKAGE.joinpath(*parts).rglob("*.py"))


def runtime_imports(path: pathlib.Path) -> set[str]:
    """Modules imported outside `if TYPE_CHECKING:` blocks, at any depth: an import inside a function is a
    dependency all the same (deferring it only hides a circle until the function runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


# The one module of the rollout side that hands user hooks their `args` (docs/design.md §9).
HOOK_ADAPTER = PACKAGE / "rollout" / "hooks.py"


def args_reads(path: pathlib.Path) -> list[int]:
    """Lines reading an attribute of a value named `args` (`args.x`, `self.args.x`, `getattr(args, ...)`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def is_args(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "args") or (
            isinstance(node, ast.Attribute) and node.attr == "args")

    lines = {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_args(node.value)}
    lines |= {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) in ("getattr", "vars") and node.args and is_args(node.args[0])}
    return sorted(lines)


def test_the_rollout_side_reads_args_only_in_the_hook_adapter():
    checked = [path for path in sources("rollout") if path != HOOK_ADAPTER]
    checked.append(PACKAGE / "ray" / "rollout_manager.py")  # it holds one configuration, the RunConfig
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in checked for line in args_reads(path)]
    assert offenders == []


def test_the_args_finder_sees_attribute_reads_and_getattr(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("def f(args, self):\n"
                      "    a = args.lr\n"
                      "    b = self.args.rm_type\n"
                      "    c = getattr(args, 'x', None)\n"
                      "    d = kwargs.get('y')\n"
                      "    return run_config_of(args).reward\n")
    assert args_reads(source) == [2, 3, 4]


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


def module_name(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of `miles` -> the modules of `miles` it imports at run time (`runtime_imports`; names that are
    not modules, such as the classes of `from module import Class`, drop out)."""
    paths = {module_name(path): path for path in sources()}
    return {name: (runtime_imports(path) & paths.keys()) - {name} for name, path in paths.items()}


def import_circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(tuple(sorted(component)))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_import_circles_among_the_modules_of_miles():
    assert import_circles(import_graph()) == []


def test_the_circle_finder_counts_deferred_imports_and_not_type_checking_ones(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "from miles.engine import protocol\n"
                      "if TYPE_CHECKING:\n"
                      "    from miles.types import Sample\n"
                      "def late():\n"
                      "    import miles.utils.errors\n")
    assert runtime_imports(source) >= {"miles.engine.protocol", "miles.utils.errors"}
    assert not any(name.startswith("miles.types") for name in runtime_imports(source))
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert import_circles(graph) == [("a", "b", "c"), ("d", "e")]


def test_the_driver_starts_ray_without_the_trainers_checkpointing_libraries():
    """The imports of train_diffusion.py's `train`, run before Ray starts, leave out torch's distributed
    checkpointing and DTensor (with sympy, about half of the driver's import time): only the trainer's processes
    save and load checkpoints."""
    import subprocess
    import sys

    script = PACKAGE.parent / "train_diffusion.py"
    train = next(node for node in ast.parse(script.read_text(encoding="utf-8")).body
                 if isinstance(node, ast.FunctionDef) and node.name == "train")
    imports = "\n".join(ast.unparse(node) for node in train.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    assert "miles.ray.rollout_manager" in imports
    check = f"{imports}\nimport sys\nprint(sorted(m for m in ('torch.distributed.checkpoint', " \
            "'torch.distributed.tensor', 'diffusers', 'transformers', 'peft') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", check], cwd=PACKAGE.parent, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]"
