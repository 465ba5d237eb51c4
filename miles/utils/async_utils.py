"""Running a coroutine from synchronous code (the loop and Ray actor methods are synchronous)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


def run_sync(coroutine: Coroutine) -> Any:
    """`asyncio.run(coroutine)`, or, when the calling thread already runs an event loop, the same on a helper
    thread (a loop cannot be nested); exceptions are re-raised in the caller's thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name="miles-run-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
