"""Ending a run, however it ends: nothing it started outlives it.

A run starts processes at three depths: the router is the driver's child, engines are children of Ray actors,
and the trainer ranks, reward workers and HTTP-post actors are Ray workers. A normal end stops them in order;
an exception or a signal must too, or the router keeps its port, an engine keeps its GPU memory, and a weight-
sync buffer stays in /dev/shm (all three happened before this module).

The entry point brackets the run:

    begin_run()            # marks the run's processes, SIGINT/SIGTERM raise RunInterrupted
    try:
        train(args)
    finally:
        stop_run()         # every registered stop, ray.shutdown(), then a sweep of what is left

- Parts register how to stop themselves with `on_run_exit` (`RolloutManager`: engines, router, watcher;
  `TrainActorGroup`: its actors). `stop_run` calls them newest first, each bounded in time, and logs (never
  raises) what failed, so one broken part cannot keep the others alive.
- Every process of the run carries `MILES_RUN_ID=<id>` in its environment: the driver's children inherit it,
  Ray workers get it through the runtime environment (`miles.ray.placement.init_ray`), and engines inherit it
  from their actor. After `ray.shutdown()`, `stop_run` sends SIGTERM, then SIGKILL, to any local process that
  still carries the id (an engine orphaned by a killed actor, a router that did not exit), and removes the
  torch shared-memory files (`/dev/shm/torch_<pid>_*`) those processes and the Ray workers left behind.
- `RunInterrupted` (SIGINT or SIGTERM) is a KeyboardInterrupt, so no `except Exception` on the way swallows it
  and Ray's blocking calls end on it; `miles.utils.errors.exit_on_user_error` prints it as one line and exits
  128 + the signal number.

A driver killed outright (SIGKILL, the OOM killer) runs none of this. For that case `begin_run` also starts the
run's reaper (`miles.ray.run_reaper`), a small process that outlives the driver, notices its death through a
pipe, and then does the sweep itself; the router and the engines end with their parent anyway
(`miles.utils.parent_death`). `stop_run` dismisses the reaper before its own sweep.

A run that starts its own Ray instance gives it a private temp folder (`make_run_ray_temp_dir`: Ray's sessions,
sockets and logs, named after the run id, mode 0700); `stop_run` and the reaper remove it once the run's
processes are gone, so runs do not pile their Ray sessions up in the temp folder (`MILES_KEEP_RAY_TEMP=1` keeps
it, to read Ray's logs afterwards).

Only processes on this machine are swept; on other nodes of a cluster the Ray actors' own stops and Ray's
job cleanup apply.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable

from miles.utils.errors import RunInterrupted

logger = logging.getLogger(__name__)

RUN_ID_ENV = "MILES_RUN_ID"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SWEEP_GRACE_SECONDS = 5.0  # between SIGTERM and SIGKILL for a leftover process
# Ray workers killed by the stops (ray.kill returns at once) may take a moment to exit after ray.shutdown():
# that is their normal end, not a leftover to warn about.
EXIT_GRACE_SECONDS = 3.0
SHM_DIR = "/dev/shm"
REAPER_STOP_TIMEOUT_SECONDS = 5.0
REAPER_STOP_COMMAND = "stop"  # the line that dismisses the reaper (miles.ray.run_reaper)
RAY_TEMP_PREFIX = "miles-ray-"

_stops: list[tuple[str, Callable[[], None]]] = []
_run_id: str | None = None
_reaper: subprocess.Popen | None = None
_lock = threading.Lock()


def begin_run() -> str:
    """Start a run: a fresh run id in the environment every process of the run inherits, and SIGINT/SIGTERM
    handlers that raise `RunInterrupted` in the main thread. Returns the run id."""
    global _run_id
    with _lock:
        _stops.clear()
        _run_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        os.environ[RUN_ID_ENV] = _run_id
    _start_reaper()
    reinstall_signal_handlers()
    return _run_id


def _start_reaper() -> None:
    """The run's reaper (see the module docstring), in its own session so that a Ctrl-C does not reach it."""
    global _reaper
    _stop_reaper()  # a run begun twice keeps one reaper
    try:
        _reaper = subprocess.Popen([sys.executable, "-m", "miles.ray.run_reaper", str(os.getpid())],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, text=True)
    except OSError as err:  # the run still works; only a driver killed outright would leave processes behind
        logger.warning("could not start the run reaper (%s); a driver killed with SIGKILL may leave processes "
                       "of the run behind", err)


def _stop_reaper() -> None:
    """Dismiss the reaper: the driver is cleaning up by itself."""
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is None:
        return
    try:
        reaper.stdin.write(REAPER_STOP_COMMAND + "\n")
        reaper.stdin.close()
    except OSError as err:  # it died already (someone killed it): nothing left to dismiss
        logger.debug("the run reaper is gone already (%s)", err)
    try:
        reaper.wait(timeout=REAPER_STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        logger.warning("the run reaper (pid %d) did not exit when dismissed; killing it", reaper.pid)
        reaper.kill()
        reaper.wait()


def reinstall_signal_handlers() -> None:
    """(Re)install the run's SIGINT/SIGTERM handlers; `ray.init` replaces SIGTERM's with its own `sys.exit`, so
    `init_ray` calls this right after it. A no-op outside a run (tests that use Ray directly)."""
    if _run_id is None or threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_run_interrupted)


def _raise_run_interrupted(signum: int, frame) -> None:
    RunInterrupted.received = signum
    raise RunInterrupted(signum)


def run_ray_temp_dir(run_id: str) -> str:
    """The folder of the run's own Ray instance. Short and directly under the system's temp folder (or
    $RAY_TMPDIR): Ray puts unix sockets in it, whose paths may not exceed 107 bytes, so it is named by the run
    id's random part alone (8 hex digits; the pid adds nothing to tell runs apart)."""
    return os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(),
                        RAY_TEMP_PREFIX + run_id.rsplit("-", 1)[-1][:8])


RAY_TEMP_SUBFOLDER = "r"  # Ray's own temp folder, inside the run's 0700 one


def make_run_ray_temp_dir() -> str:
    """Create the run's Ray folder (only its user may enter it) and return the temp folder to give Ray inside it:
    Ray makes its temp folder world-writable (0777) when it starts, so what keeps others out is the 0700 folder
    around it. Outside a run (a test starting Ray through the run's code) a fresh folder that nothing removes."""
    parent = tempfile.mkdtemp(prefix=RAY_TEMP_PREFIX) if _run_id is None else run_ray_temp_dir(_run_id)
    if _run_id is not None:
        os.mkdir(parent, 0o700)  # fails on anything already there: the run id is fresh, so nothing should be
    path = os.path.join(parent, RAY_TEMP_SUBFOLDER)
    os.mkdir(path, 0o700)
    return path


KEEP_RAY_TEMP_ENV = "MILES_KEEP_RAY_TEMP"  # "1": keep the run's Ray folder (its logs) for inspection


def remove_ray_temp_dir(run_id: str) -> None:
    """Remove the run's Ray temp folder, once no process of the run is left to write in it (unless
    $MILES_KEEP_RAY_TEMP is 1: Ray's logs of a run to read afterwards; the folder stays 0700)."""
    if os.environ.get(KEEP_RAY_TEMP_ENV) == "1":
        return
    shutil.rmtree(run_ray_temp_dir(run_id), ignore_errors=True)


def on_run_exit(what: str, stop: Callable[[], None]) -> None:
    """Register `stop` (idempotent, bounded in time) for `stop_run`; `what` names it in a failure warning.

    Outside a run (no `begin_run`, e.g. a test building a part directly) nothing is registered.
    """
    with _lock:
        if _run_id is not None:
            _stops.append((what, stop))


def stop_run() -> None:
    """Stop everything the run started (see the module docstring). Safe to call on any path, and twice."""
    global _run_id
    if _run_id is None:
        return
    marker = f"{RUN_ID_ENV}={_run_id}".encode()
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:  # a second Ctrl-C must not abandon the cleanup halfway
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    # Killed actors turn their pending results into errors that Ray would print as "Unhandled error" lines.
    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
    try:
        seen = set(marked_processes(marker))  # before the stops: the Ray workers they end own shm files too
        with _lock:
            stops = list(reversed(_stops))
            _stops.clear()
        for what, stop in stops:
            try:
                stop()
            except Exception as err:  # noqa: BLE001 - log and go on: the remaining parts must still stop
                logger.warning("stopping %s failed (%s: %s); the final sweep ends what is left", what,
                               type(err).__name__, err)
        _shutdown_ray()
        _stop_reaper()  # before the sweep, which would otherwise end it as a leftover of the run
        leftovers = still_running(marked_processes(marker), EXIT_GRACE_SECONDS)
        if leftovers:
            logger.warning("processes of the run still alive after the stops, ending them: %s",
                           ", ".join(f"{pid} ({_command(pid)})" for pid in leftovers))
            end_processes(leftovers)
        remove_shared_memory(seen | set(leftovers))
        remove_ray_temp_dir(_run_id)
    finally:
        _stop_reaper()  # no-op after the one above; here for a cleanup that raised before it
        _run_id = None
        os.environ.pop(RUN_ID_ENV, None)
        if in_main_thread:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        try:
            ray.shutdown(wait_for_processes=True)  # so the sweep below finds only real leftovers
        except Exception as err:  # noqa: BLE001 - the sweep still ends the local Ray processes
            logger.warning("ray.shutdown() failed (%s: %s)", type(err).__name__, err)


# ---- the sweep ---------------------------------------------------------------------------------------------
def marked_processes(marker: bytes) -> list[int]:
    """Live local processes (not this one) whose environment holds `marker` (b"MILES_RUN_ID=<id>")."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:  # gone meanwhile, or another user's process: not ours either way
            continue
        if marker in environ and _alive(int(entry)):
            pids.append(int(entry))
    return pids


def still_running(pids: list[int], grace: float) -> list[int]:
    """Those of `pids` still running after up to `grace` seconds of waiting for them to exit by themselves."""
    deadline = time.monotonic() + grace
    while True:
        _reap(pids)
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)  # polling other processes' exit: there is no portable event to wait on


def _alive(pid: int) -> bool:
    """Running (a zombie has exited already: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def end_processes(pids: list[int], grace: float = SWEEP_GRACE_SECONDS) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds for those still running; reap the ones that are our children."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            _reap(pids)
            if not any(_alive(pid) for pid in pids):
                return
            time.sleep(0.05)  # polling other processes' exit: there is no portable event to wait on
    still = [pid for pid in pids if _alive(pid)]
    if still:
        logger.warning("processes %s did not exit even after SIGKILL", still)


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: its own parent (or init) reaps it
            continue


def remove_shared_memory(pids: set[int]) -> list[str]:
    """Remove the torch shared-memory files (`file_system` sharing: /dev/shm/torch_<pid>_...) that processes of
    the run created and that outlived them; returns the removed paths."""
    removed = []
    for pid in sorted(pids):
        if _alive(pid):
            continue  # still running (it did not stop): its buffers may be in use
        for path in glob.glob(os.path.join(SHM_DIR, f"torch_{pid}_*")):
            try:
                os.remove(path)
                removed.append(path)
            except FileNotFoundError:
                continue
    if removed:
        logger.debug("removed %d shared-memory file(s) the run left in %s", len(removed), SHM_DIR)
    return removed
