"""Reading a user's JSONL file line by line, each error naming the file and the line (prompt and SFT data)."""

from __future__ import annotations

import json
from typing import Any, Iterator

from miles.utils.errors import MilesUserError


def decoded_lines(path: str, label: str) -> Iterator[tuple[int, str, str]]:
    """(1-based line number, "label file:line", text) of each non-blank line. Decoded line by line so that a
    file that is not UTF-8 fails naming the line instead of somewhere in a buffer. `label`: what the file is to
    the user, e.g. the flag that named it."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{label} {path}:{line_number}".lstrip()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise MilesUserError(f"{where}: not UTF-8 text (byte {err.start + 1} of the line)") from None
            if text.strip():
                yield line_number, where, text


def json_object(where: str, text: str) -> dict[str, Any]:
    """One line's JSON object; the column of a syntax error is counted in that line (a line cut short reads
    as such, not as an error at the start of the next line)."""
    try:
        record = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        raise MilesUserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise MilesUserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record
