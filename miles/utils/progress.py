"""Progress bars for the waits a user sits through: engines starting, rollouts, eval rollouts, reward models
loading, SFT encoding, checkpoint saves.

A bar appears only once a wait has lasted `PROGRESS_DELAY_S` seconds, so quick steps (tests, warm caches) print
nothing; it goes to stderr like the logs. `MILES_PROGRESS=0` turns every bar off (e.g. for log files).
"""

from __future__ import annotations

import os

from tqdm import tqdm

PROGRESS_DELAY_S = 3.0


def progress_bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A tqdm bar for `total` steps, shown after `PROGRESS_DELAY_S` seconds; use as a context manager."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        delay=PROGRESS_DELAY_S,
        mininterval=1.0,
        dynamic_ncols=True,
        leave=False,
        disable=os.environ.get("MILES_PROGRESS", "1") == "0",
    )
