"""Named wall-clock laps of one procedure, for start-up splits that must add up (`perf/startup/<part>/<lap>_time`)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Laps:
    """Seconds per named lap, in the order first run; a lap run twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def lap(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
