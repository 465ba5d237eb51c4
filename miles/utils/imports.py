"""Loading user objects from dotted paths (`--*-path` flags)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from miles.utils.errors import MilesUserError


def load_object(dotted_path: str, flag: str) -> Any:
    """Import `package.module.attr` (also `package.module:attr`), naming `flag` in the error if it fails."""
    path = dotted_path.replace(":", ".")
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise MilesUserError(f"{flag} {dotted_path!r}: expected a dotted path like 'my_pkg.my_module.my_function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail in any way; say which flag pointed at it
        raise MilesUserError(f"{flag} {dotted_path!r}: cannot import module {module_name!r}: {err}") from err
    if not hasattr(module, attr):
        raise MilesUserError(f"{flag} {dotted_path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def load_function(dotted_path: str, flag: str, required_params: int | None = None) -> Callable:
    """Load a callable; with `required_params`, check it accepts that many positional arguments."""
    fn = load_object(dotted_path, flag)
    if not callable(fn):
        raise MilesUserError(f"{flag} {dotted_path!r}: {type(fn).__name__} object is not callable")
    if required_params is not None:
        try:
            inspect.signature(fn).bind(*([None] * required_params))
        except TypeError as err:
            raise MilesUserError(
                f"{flag} {dotted_path!r}: must accept {required_params} positional argument(s): {err}"
            ) from err
        except ValueError:
            return fn  # builtins without an inspectable signature: trust the user
    return fn
