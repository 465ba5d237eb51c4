"""The live processes of a run, for tests that kill parts of it or check that nothing outlived it.

Every process of a run carries `MILES_RUN_ID=<driver pid>-<hex>` in its environment (miles.ray.shutdown), so a
test that started the driver finds them from the driver's pid alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def run_processes(driver_pid: int) -> dict[int, str]:
    """pid -> command line of the live processes carrying the run id of this driver (`<driver pid>-...`)."""
    prefix = f"MILES_RUN_ID={driver_pid}-".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if state not in ("Z", "X") and any(item.startswith(prefix) for item in environ):
            found[int(entry)] = command.strip()
    return found
