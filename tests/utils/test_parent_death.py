"""A marked child ends when its parent is SIGKILLed, and at once when its parent is gone before it asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.parent_death import PARENT_PID_ENV, die_with_parent, mark_parent

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

# The child: ask to die with the parent, say so, then wait far longer than the test.
CHILD = (
    "import sys, time; from miles.utils.parent_death import die_with_parent; "
    "print('armed' if die_with_parent() else 'unarmed', flush=True); time.sleep(120)"
)
# The parent: start the marked child, report its pid, then wait to be killed.
PARENT = (
    "import os, subprocess, sys, time; from miles.utils.parent_death import mark_parent; "
    f"child = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=mark_parent(dict(os.environ))); "
    "print(child.pid, flush=True); time.sleep(120)"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_marked_child_ends_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=_env())
    lines = {parent.stdout.readline().strip() for _ in range(2)}  # the child's pid (parent) and 'armed' (child)
    assert "armed" in lines, lines
    child_pid = int((lines - {"armed"}).pop())
    try:
        assert _alive(child_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling another process's exit: there is no event to wait on
        assert not _alive(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
        parent.stdout.close()


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    # A marker naming another process than the real parent is what a parent that died before the prctl looks like.
    env = {**_env(), PARENT_PID_ENV: "1"}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGTERM and child.stdout == ""


def test_only_the_main_thread_marks_and_an_unmarked_process_is_left_alone(monkeypatch):
    import threading

    assert mark_parent({})[PARENT_PID_ENV] == str(os.getpid())
    from_thread: list[dict] = []
    thread = threading.Thread(target=lambda: from_thread.append(mark_parent({PARENT_PID_ENV: "7"})))
    thread.start()
    thread.join()
    assert from_thread == [{}]  # the kernel would signal the child when that thread ends, not the process
    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    assert die_with_parent() is False
