"""The one error type for user mistakes, the death of a part of the run, and the interrupt of a run.

A user mistake (a bad flag combination, a malformed JSONL line, a missing file or model component, a reward
that returned NaN) raises `MilesUserError` with one message that names the flag, file or line. The entry point
prints that single line and exits with status 2; internal bugs keep their traceback. A `MilesUserError` raised
inside a Ray actor reaches the driver wrapped in Ray's error (whose text is the remote traceback); the entry
point prints the original one line.

`PartDiedError` is a process of the run that died under it (a trainer rank, an engine without
`--use-fault-tolerance`, a reward worker past its restarts: killed, out of memory, crashed) where the run cannot
go on without it: one line naming the part and the way on, exit status 3.

`RunInterrupted` is SIGINT or SIGTERM (`miles.ray.shutdown`): after the run's cleanup the entry point prints
one line and exits with 128 + the signal number, as a shell reports a process ended by a signal.
"""

from __future__ import annotations

import signal
import sys

USER_ERROR_EXIT_CODE = 2
PART_DIED_EXIT_CODE = 3


class MilesUserError(Exception):
    """A mistake the user can fix: the message says what, where, and how."""


class PartDiedError(RuntimeError):
    """A process the run needs died (not the user's mistake): the message names it, says how it probably died
    and how to go on."""


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver (raised by the handlers of `miles.ray.shutdown`).

    A KeyboardInterrupt, because that is the one exception Ray's blocking calls (`ray.get`) accept from a signal
    handler: they end the wait and raise a KeyboardInterrupt of their own, so `received` keeps which signal came.
    Like every KeyboardInterrupt, no `except Exception` on the way swallows it.
    """

    received: int | None = None  # the last stop signal the driver received

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def interrupt_signal(interrupt: KeyboardInterrupt) -> signal.Signals:
    """The signal behind an interrupt: its own, the last one received (Ray re-raised it), else SIGINT (Ctrl-C
    before the run's handlers were installed)."""
    return signal.Signals(getattr(interrupt, "signum", None) or RunInterrupted.received or signal.SIGINT)


def one_line_message(err: MilesUserError | PartDiedError) -> str:
    """The one-line message: the original one when Ray wrapped the error (its `cause`), raised in an actor."""
    cause = getattr(err, "cause", None)
    return str(cause) if isinstance(cause, (MilesUserError, PartDiedError)) else str(err)


def exit_on_user_error(fn):
    """Decorator for CLI entry points: a `MilesUserError` becomes one line on stderr and exit status 2, a
    `PartDiedError` one line and exit status 3, an interrupt (SIGINT, SIGTERM) one line and exit status 128 + the
    signal number."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MilesUserError as err:
            print(f"error: {one_line_message(err)}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)
        except PartDiedError as err:
            print(f"error: {one_line_message(err)}", file=sys.stderr)
            sys.exit(PART_DIED_EXIT_CODE)
        except KeyboardInterrupt as interrupt:
            signum = interrupt_signal(interrupt)
            print(f"error: stopped by {signum.name}; the run's engines, router and workers were shut down",
                  file=sys.stderr)
            sys.exit(128 + signum)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
