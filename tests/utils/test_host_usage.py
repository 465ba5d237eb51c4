import sys
import threading
import time

import pytest

from miles.utils.host_usage import HostUsage


def _spin(seconds: float) -> None:
    """Busy until this thread has used `seconds` of CPU (not of wall time: on a loaded machine a thread gets
    less than a core, and the assertions are about CPU)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_busy_thread_counts_its_cpu_and_sleeping_does_not():
    before = HostUsage.measure()
    _spin(0.3)
    time.sleep(0.3)
    step = HostUsage.measure().delta(before)
    assert 0.55 < step.wall_s < 5.0
    assert 0.2 < step.thread_cpu_s < 0.55  # the spin, not the sleep
    metrics = step.metrics("perf/train_")
    assert set(metrics) == {"perf/train_host_cpu_s", "perf/train_host_preemptions"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread tables read /proc")
def test_report_names_the_busy_thread_of_this_process():
    spun, measured = threading.Event(), threading.Event()

    def helper():  # alive until measured: a thread that has ended is no longer listed in /proc
        _spin(0.4)
        spun.set()
        measured.wait()

    before = HostUsage.measure(with_tables=True)
    worker = threading.Thread(target=helper, name="busy-helper")
    worker.start()
    spun.wait()
    step = HostUsage.measure(with_tables=True).delta(before)
    measured.set()
    worker.join()
    busiest_thread = max(step.threads.values(), key=lambda entry: entry[1])
    assert busiest_thread[1] > 0.2  # the helper's CPU time shows up although the measuring thread slept in join
    lines = step.report()
    assert lines[0].startswith("host: this thread ")
    assert any(line.startswith("busiest threads of this process") for line in lines)
    assert any(line.startswith("busiest processes of this machine") for line in lines)
