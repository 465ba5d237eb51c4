"""Profile chosen train steps of a real run: `MILES_PROFILE_TRAIN_DIR=<dir>` (and `MILES_PROFILE_TRAIN_ROLLOUTS`).

Set in the trainer's environment (e.g. `--train-env-vars '{"MILES_PROFILE_TRAIN_DIR": "/tmp/prof"}'`), each rank
writes `<dir>/train_rollout<id>_rank<r>.txt` for the rollouts listed in `MILES_PROFILE_TRAIN_ROLLOUTS` (a comma
list of rollout ids, default `2`: past the first iteration's compiles and colocation decisions). The file holds
the step's wall time next to the time the device spent in kernels, the process's scheduling (niceness, CPU
affinity, intra-op threads), the trainer thread's CPU time and preemptions with the busiest threads and processes
over the step (miles/utils/host_usage.py), and torch.profiler's tables sorted by device time and by host time. A step whose
wall time is far above its kernel time is host-bound; one whose kernels themselves take longer than in
`bench/bench_train.py --profile` shares the device.

On a GPU only device kernels are recorded unless `MILES_PROFILE_TRAIN_HOST=1` adds the host operators: a
real-size step dispatches hundreds of thousands of them (SD3.5-Medium LoRA, 320 pairs: over 300k copies alone),
and recording and summarising those took minutes on an H200. On the CPU host operators are all there is.
Profiling slows the profiled step; the other steps run as usual.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import torch

from miles.utils.host_usage import HostUsage

PROFILE_DIR_ENV = "MILES_PROFILE_TRAIN_DIR"
PROFILE_ROLLOUTS_ENV = "MILES_PROFILE_TRAIN_ROLLOUTS"
PROFILE_HOST_ENV = "MILES_PROFILE_TRAIN_HOST"
DEFAULT_PROFILED_ROLLOUTS = "2"


def profiled_rollouts() -> set[int]:
    """The rollout ids whose train step is profiled (empty when `MILES_PROFILE_TRAIN_DIR` is unset)."""
    if not os.environ.get(PROFILE_DIR_ENV):
        return set()
    raw = os.environ.get(PROFILE_ROLLOUTS_ENV, DEFAULT_PROFILED_ROLLOUTS)
    try:
        return {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"{PROFILE_ROLLOUTS_ENV}={raw!r}: expected a comma list of rollout ids") from None


def profile_report_path(directory: str, rollout_id: int, rank: int) -> str:
    return os.path.join(directory, f"train_rollout{rollout_id}_rank{rank}.txt")


def scheduling_summary() -> str:
    """Niceness, CPU affinity and intra-op threads of this process: what decides how fast it launches work."""
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (f"pid {os.getpid()}, niceness {os.nice(0)}, {len(affinity)} CPUs allowed, "
            f"torch intra-op threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


def fsdp_scopes(averages) -> list[str]:
    """FSDP2's own scopes (its hooks' gathers, reshards, reductions: `FSDP::...` events), by host time: what the
    sharding costs a step apart from the model's operators. Empty where FSDP ran no hook."""
    scopes = sorted((event for event in averages if event.key.startswith("FSDP::")),
                    key=lambda event: -event.cpu_time_total)
    if not scopes:
        return []
    rows = [f"{event.key[:60]:<60} {event.count:>8} {event.cpu_time_total / 1e3:>12.1f}" for event in scopes[:20]]
    return ["", "## FSDP2's scopes (calls, host ms including what they ran)", *rows]


@contextlib.contextmanager
def profile_train_step(rollout_id: int, rank: int, device: torch.device) -> Iterator[None]:
    """Profile the body when `rollout_id` is one of `profiled_rollouts()`; otherwise do nothing."""
    if rollout_id not in profiled_rollouts():
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    host = not cuda or os.environ.get(PROFILE_HOST_ENV) == "1"
    activities = ([ProfilerActivity.CPU] if host else []) + ([ProfilerActivity.CUDA] if cuda else [])
    began = time.perf_counter()
    host_before = HostUsage.measure(with_tables=True)
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    host_usage = HostUsage.measure(with_tables=True).delta(host_before)
    wall = time.perf_counter() - began
    averages = prof.key_averages()
    kernel_s = sum(event.self_device_time_total for event in averages) / 1e6
    host_ops = sum(event.count for event in averages if event.self_device_time_total == 0)
    lines = [
        f"rollout {rollout_id}, rank {rank}: wall {wall:.3f} s (profiled), device kernels {kernel_s:.3f} s"
        + (f", {host_ops} host-side operator calls" if host else ""),
        scheduling_summary(),
        *host_usage.report(),
        "",
        "## by device time" if cuda else "## by host time",
        averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=30,
                       max_name_column_width=60),
    ]
    if cuda and host:
        lines += ["## by host time", averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                    max_name_column_width=60)]
    if host:
        lines += fsdp_scopes(averages)
    directory = os.environ[PROFILE_DIR_ENV]
    os.makedirs(directory, exist_ok=True)
    with open(profile_report_path(directory, rollout_id, rank), "w") as handle:
        handle.write("\n".join(lines) + "\n")
