"""The run's cleanup (miles.ray.shutdown) and its one-line exit (miles.utils.errors), without Ray or engines."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from miles.ray import shutdown
from miles.utils.errors import MilesUserError, RunInterrupted, exit_on_user_error


@pytest.fixture()
def run(monkeypatch, tmp_path):
    """A run begun in this process; its cleanup always runs, and the signal handlers come back."""
    handlers = {signum: signal.getsignal(signum) for signum in shutdown.STOP_SIGNALS}
    monkeypatch.setattr(shutdown, "SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setattr(shutdown, "SWEEP_GRACE_SECONDS", 1.0)
    monkeypatch.delenv("RAY_IGNORE_UNHANDLED_ERRORS", raising=False)
    (tmp_path / "shm").mkdir()
    run_id = shutdown.begin_run()
    yield run_id
    shutdown.stop_run()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    RunInterrupted.received = None


def sleeper(ignore_sigterm: bool = False) -> subprocess.Popen:
    code = "import signal, time\n"
    if ignore_sigterm:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(120)\n"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"  # its handlers are in place
    return process


def test_stops_run_newest_first_and_one_failure_does_not_stop_the_rest(run, caplog):
    calls = []

    def broken():
        calls.append("router")
        raise RuntimeError("router wedged")

    shutdown.on_run_exit("the engines", lambda: calls.append("engines"))
    shutdown.on_run_exit("the router", broken)
    shutdown.on_run_exit("the trainer", lambda: calls.append("trainer"))
    with caplog.at_level(logging.WARNING, logger="miles.ray.shutdown"):
        shutdown.stop_run()
    assert calls == ["trainer", "router", "engines"]
    assert "stopping the router failed (RuntimeError: router wedged); the final sweep" in caplog.text
    shutdown.stop_run()  # twice is harmless
    assert calls == ["trainer", "router", "engines"]


def test_outside_a_run_nothing_is_registered():
    shutdown.on_run_exit("a part built by a test", lambda: pytest.fail("must not be called"))
    shutdown.stop_run()


def test_the_sweep_ends_the_run_processes_left_behind_and_their_shared_memory(run, tmp_path):
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                env={k: v for k, v in os.environ.items() if k != shutdown.RUN_ID_ENV})
    polite, stubborn = sleeper(), sleeper(ignore_sigterm=True)  # both inherit MILES_RUN_ID
    leaked = tmp_path / "shm" / f"torch_{stubborn.pid}_123_1"
    leaked.write_bytes(b"weight-sync buffer")
    someone_elses = tmp_path / "shm" / f"torch_{outsider.pid}_9_1"
    someone_elses.write_bytes(b"x")
    try:
        marked = shutdown.marked_processes(f"{shutdown.RUN_ID_ENV}={run}".encode())
        assert polite.pid in marked and stubborn.pid in marked and outsider.pid not in marked
        started = time.monotonic()
        shutdown.stop_run()
        # Both ended (the sweep reaped them, so Popen reads no signal); the one ignoring SIGTERM needed SIGKILL
        # after the grace period.
        assert polite.poll() is not None and stubborn.poll() is not None
        assert shutdown.SWEEP_GRACE_SECONDS <= time.monotonic() - started < 10 + shutdown.EXIT_GRACE_SECONDS
        assert not leaked.exists() and someone_elses.exists()
        assert outsider.poll() is None  # not of this run: untouched
    finally:
        for process in (outsider, polite, stubborn):
            if process.poll() is None:
                process.kill()
            process.wait()


def test_the_reaper_is_dismissed_by_stop_run_and_sweeps_for_a_driver_killed_outright(run, tmp_path):
    reaper = shutdown._reaper
    assert reaper is not None and reaper.poll() is None
    shutdown.stop_run()
    assert reaper.poll() == 0  # dismissed: it swept nothing

    # A driver that begins a run, starts a process of it (which ignores SIGTERM), and is then SIGKILLed.
    driver_code = (
        "import subprocess, sys, time; from miles.ray import shutdown; shutdown.begin_run(); "
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)']); "
        "print(child.pid, flush=True); time.sleep(120)"
    )
    driver = subprocess.Popen([sys.executable, "-c", driver_code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    child_pid = int(driver.stdout.readline())
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + shutdown.SWEEP_GRACE_SECONDS + 10  # SIGTERM is ignored: SIGKILL after the grace
    while shutdown._alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling another process's exit: there is no event to wait on
    try:
        assert not shutdown._alive(child_pid), "the run's process outlived its SIGKILLed driver"
    finally:
        if shutdown._alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
    stderr = driver.stderr.read().splitlines()
    assert len(stderr) == 1 and re.fullmatch(
        rf"miles: the driver \(pid {driver.pid}\) ended without its cleanup; the run reaper ended 1 process\(es\) "
        rf"of run {driver.pid}-[0-9a-f]+", stderr[0]), stderr
    driver.stdout.close()
    driver.stderr.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_raises_run_interrupted_even_after_another_library_took_the_handler(run, signum):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))  # what ray.init does
    shutdown.reinstall_signal_handlers()
    with pytest.raises(RunInterrupted) as info:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler runs at the next bytecode boundary
    assert info.value.signum == signum and RunInterrupted.received == signum
    assert isinstance(info.value, KeyboardInterrupt) and not isinstance(info.value, Exception)


def test_during_the_cleanup_a_second_signal_is_ignored(run):
    seen = []

    def stop_while_signalled():
        os.kill(os.getpid(), signal.SIGINT)  # an impatient second Ctrl-C
        time.sleep(0.1)
        seen.append("finished")

    shutdown.on_run_exit("a slow part", stop_while_signalled)
    shutdown.stop_run()
    assert seen == ["finished"]


def run_entry(fn, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        exit_on_user_error(fn)()
    return info.value.code, capsys.readouterr().err.strip().splitlines()


def test_the_exit_is_one_line(capsys):
    def interrupted():
        raise RunInterrupted(signal.SIGTERM)

    assert run_entry(interrupted, capsys) == (143, [
        "error: stopped by SIGTERM; the run's engines, router and workers were shut down"])

    def ray_reraised():  # ray.get turns the handler's exception into a plain KeyboardInterrupt
        RunInterrupted.received = signal.SIGTERM
        raise KeyboardInterrupt

    try:
        assert run_entry(ray_reraised, capsys)[0] == 143
    finally:
        RunInterrupted.received = None
    assert run_entry(lambda: (_ for _ in ()).throw(KeyboardInterrupt), capsys)[0] == 130  # Ctrl-C, no run yet

    class RayTaskErrorLike(MilesUserError):  # Ray's wrapper: a subclass of the cause whose text is a traceback
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  ...\n" + str(cause))
            self.cause = cause

    def remote_user_error():
        raise RayTaskErrorLike(MilesUserError("--save '/ckpt': saving failed: No space left on device"))

    assert run_entry(remote_user_error, capsys) == (2, [
        "error: --save '/ckpt': saving failed: No space left on device"])

    def engine_died():  # an EngineRequestError is a PartDiedError: a dead part, not the user's mistake
        from miles.rollout.engine_client import EngineRequestError

        raise EngineRequestError("generate request 1 failed after 1 attempt(s): [502] engine http://e failed")

    assert run_entry(engine_died, capsys) == (3, [
        "error: generate request 1 failed after 1 attempt(s): [502] engine http://e failed"])


def test_the_runs_private_ray_folder_is_made_private_and_removed_at_the_end(run, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    folder = shutdown.make_run_ray_temp_dir()
    run_folder = tmp_path / f"miles-ray-{run.rsplit('-', 1)[-1][:8]}"
    assert folder == str(run_folder / "r")
    # Ray's sockets and logs: this user's only, however Ray sets the mode of its own folder inside
    assert os.stat(run_folder).st_mode & 0o777 == 0o700
    (run_folder / "r" / "session_x").mkdir()
    shutdown.stop_run()
    assert not os.path.exists(run_folder)


def test_the_reaper_removes_the_ray_folder_of_a_killed_driver(monkeypatch, tmp_path):
    from miles.ray import run_reaper

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    folder = tmp_path / "miles-ray-abc"
    (folder / "session_x").mkdir(parents=True)
    run_reaper.reap("123-abc", driver_pid=123)
    assert not folder.exists()
