"""The run's reaper: ends the run's processes when the driver dies without its cleanup (SIGKILL, OOM killer).

`miles.ray.shutdown.begin_run` starts it as `python -m miles.ray.run_reaper <driver pid>`, in a session of its
own (a Ctrl-C meant for the driver does not reach it), with the run id in its environment and a pipe from the
driver as its stdin. It waits on that pipe:

- `stop` (sent by `stop_run`, which stops and sweeps the run itself): it exits;
- end of file without `stop`: the driver is gone, so it does the part of `stop_run` that needs no driver: SIGTERM,
  then SIGKILL, to every local process that carries the run id, and removal of the shared-memory files of the
  driver and of the processes it ended and of the run's Ray temp folder. It says so in one line on stderr (the
  driver's, inherited).

The router and the engines also end by themselves when their parent dies (`miles.utils.parent_death`), and the
local Ray cluster shares the driver's fate; what the reaper adds is the rest: Ray's agent processes, which wait
a minute on the dead cluster before they exit, and anything a part started that did not ask to die with it.
"""

from __future__ import annotations

import os
import sys

from miles.ray.shutdown import (
    REAPER_STOP_COMMAND,
    RUN_ID_ENV,
    end_processes,
    marked_processes,
    remove_ray_temp_dir,
    remove_shared_memory,
)

MAX_SWEEPS = 3  # a process may start while the first sweep runs (a Ray worker being spawned); look again


def reap(run_id: str, driver_pid: int) -> list[int]:
    """End every local process of the run (not this one); returns the pids that were still running."""
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    ended: list[int] = []
    for _ in range(MAX_SWEEPS):
        leftovers = marked_processes(marker)
        if not leftovers:
            break
        end_processes(leftovers)
        ended += leftovers
    remove_shared_memory({driver_pid, *ended})
    remove_ray_temp_dir(run_id)
    return ended


def main() -> None:
    run_id = os.environ[RUN_ID_ENV]
    driver_pid = int(sys.argv[1])  # not getppid(): the driver may be gone before this line runs
    command = sys.stdin.readline().strip()  # blocks until the driver writes or dies
    if command == REAPER_STOP_COMMAND:
        return
    ended = reap(run_id, driver_pid)
    print(f"miles: the driver (pid {driver_pid}) ended without its cleanup; the run reaper ended "
          f"{len(ended)} process(es) of run {run_id}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
