"""The one error type for user mistakes.

A user mistake (a bad flag combination, a malformed JSONL line, a missing file or model component, a reward
that returned NaN) raises `MilesUserError` with one message that names the flag, file or line. The entry point
prints that single line and exits with status 2; internal bugs keep their traceback.
"""

from __future__ import annotations

import sys

USER_ERROR_EXIT_CODE = 2


class MilesUserError(Exception):
    """A mistake the user can fix: the message says what, where, and how."""


def exit_on_user_error(fn):
    """Decorator for CLI entry points: a `MilesUserError` becomes one line on stderr and exit status 2."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MilesUserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
