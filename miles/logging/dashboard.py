"""`--use-miles-dashboard`: a phase timeline written as JSON lines to `--miles-dashboard-workspace`.

Each line is one finished phase: `{"phase": "rollout", "start": t0, "end": t1, "pid": ...}` (wall-clock
seconds). Writes are buffered and appended on `flush`, off the hot path.
"""

from __future__ import annotations

import json
import os
import time


class PhaseTimeline:
    def __init__(self, workspace: str) -> None:
        os.makedirs(workspace, exist_ok=True)
        self.path = os.path.join(workspace, "timeline.jsonl")
        self._open: dict[str, float] = {}
        self._done: list[dict] = []

    def begin(self, phase: str) -> None:
        self._open[phase] = time.time()

    def end(self, phase: str) -> None:
        start = self._open.pop(phase, None)
        if start is not None:
            self._done.append({"phase": phase, "start": start, "end": time.time(), "pid": os.getpid()})

    def flush(self) -> None:
        if not self._done:
            return
        with open(self.path, "a") as f:
            for event in self._done:
                f.write(json.dumps(event) + "\n")
        self._done = []
