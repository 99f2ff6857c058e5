"""The run directory: the single source of truth for a run.

Every writer appends whole lines with one ``write`` on an ``O_APPEND`` file, so
concurrent writers (ranks, supervisor) never interleave within a line.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield records; a torn last line (writer killed mid-write) is skipped, not fatal."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    yield json.loads(raw)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def recipe_json(self) -> Path:
        return self.path / "recipe.json"

    @property
    def recipe_toml(self) -> Path:
        return self.path / "recipe.toml"

    def logs(self, attempt: int) -> Path:
        return self.path / "logs" / f"attempt-{attempt}"

    def rank_log(self, attempt: int, rank: int) -> Path:
        return self.logs(attempt) / f"rank-{rank}.log"

    def create(self) -> "RunDir":
        for d in (self.path, self.checkpoints, self.path / "logs"):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, PRIVATE_DIR)
        return self

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "kind": kind, **fields}
        append_jsonl(self.events, record)
        return record

    def read_events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events))

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))

    def last_attempt(self) -> int:
        attempts = [e.get("attempt", 0) for e in self.read_events() if e.get("kind") == "launch"]
        return max(attempts, default=0)


def final_metrics_by_step(records: list[dict[str, Any]], rank: int = 0) -> dict[int, dict[str, Any]]:
    """The record that counts for each step: the last one written (a resumed run redoes steps)."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("rank") == rank:
            out[int(r["step"])] = r
    return out
