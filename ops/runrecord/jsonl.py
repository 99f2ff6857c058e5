"""The one JSONL writer and the one JSONL reader of the run directory.

Writers append whole lines with one ``write`` on an ``O_APPEND`` file, so concurrent
writers (ranks, supervisor) never interleave within a line. Readers follow a file
by byte offset: only whole lines are read, a torn last line (a writer mid-write, or
killed mid-write) is left for the next read, and a line that is not a JSON object
is skipped, never fatal. ``ptops status``, ``diagnose``, both exporters, the launch
progress line and chaos all read through :class:`JsonlTail`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

PRIVATE_FILE = 0o600


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One line as a record; None for garbage (bad JSON, or JSON that is not an object)."""
    try:
        rec = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return rec if isinstance(rec, dict) else None


class JsonlTail:
    """Follows one JSONL file: each read yields the whole records appended since the last.

    ``offset`` is the byte position after the last whole line read; a file that
    shrank (truncated or replaced) is read again from the start. A missing file
    reads as empty (it may appear later).
    """

    def __init__(self, path: str | Path, offset: int = 0, *, from_end: bool = False) -> None:
        self.path = Path(path)
        self.offset = offset
        if from_end:
            try:
                self.offset = self.path.stat().st_size
            except OSError:
                pass

    def records(self) -> Iterator[dict[str, Any]]:
        """Stream the new whole records (the offset advances as they are consumed)."""
        try:
            f = open(self.path, "rb")
        except OSError:
            return
        with f:
            try:
                size = os.fstat(f.fileno()).st_size
            except OSError:
                return
            if size < self.offset:
                self.offset = 0
            f.seek(self.offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # torn: its writer has not finished it; read it next time
                self.offset += len(raw)
                rec = parse_line(raw)
                if rec is not None:
                    yield rec

    def read(self) -> list[dict[str, Any]]:
        return list(self.records())


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every whole record of a file, from its start (a torn last line is skipped, not fatal)."""
    return JsonlTail(path).records()
