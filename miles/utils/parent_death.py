"""Child processes that die with their parent, so that nothing outlives a driver killed with SIGKILL.

A SIGKILL (or the OOM killer) runs no cleanup: `miles.ray.shutdown.stop_run` never gets to stop the router or
sweep the engines. Ray's own processes share the driver's fate by themselves (the local cluster that `ray.init`
starts dies with the driver, and its workers with it), so what remains are the processes miles starts outside
Ray: the router (a child of the driver) and each engine (a child of its Ray actor). Each of them asks the
kernel, first thing in its `main`, for SIGTERM when its parent dies:

    env = mark_parent(dict(os.environ))     # the parent, before Popen(..., env=env)
    die_with_parent()                       # the child, at the top of its main, before its heavy imports

`die_with_parent` is Linux's `prctl(PR_SET_PDEATHSIG, SIGTERM)`, plus a check that the parent is still the one
that started it: a parent that died between the fork and the prctl would never send the signal.

The kernel sends the signal when the *thread* that forked the child ends, not only the process, so
`mark_parent` marks children spawned from the main thread only (the driver's `train`, a Ray actor's methods);
a child started from another thread lives on as before and is left to `stop_run`'s sweep.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "MILES_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def mark_parent(env: dict[str, str]) -> dict[str, str]:
    """Ask a child started with `env` to die with this process (see the module docstring); returns `env`."""
    if threading.current_thread() is threading.main_thread():
        env[PARENT_PID_ENV] = str(os.getpid())
    else:
        env.pop(PARENT_PID_ENV, None)  # a spawning thread may end before this process: no spurious signal
    return env


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """In a child started with `mark_parent`: receive `signum` when the parent dies, or now if it already has.
    Returns whether the request is in place (False: not marked, e.g. started by hand, or not Linux)."""
    expected = os.environ.pop(PARENT_PID_ENV, None)  # popped: this process's own children have another parent
    if not expected:
        return False
    if not sys.platform.startswith("linux"):
        logger.debug("not Linux: this process does not end with its parent %s", expected)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != int(expected):  # the parent is gone already: re-parented, no signal will come
        os.kill(os.getpid(), signum)
    return True
