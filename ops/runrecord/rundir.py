"""The run directory: the single source of truth for a run.

Its JSONL files are written and read only through :mod:`.jsonl` (re-exported here); the
metrics, which may be rotated into ``metrics/`` segments, only through :mod:`.metrics`; event
kinds and the reducer live in :mod:`.events`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .events import reduce
from .jsonl import PRIVATE_FILE, JsonlTail, append_jsonl, read_jsonl
from .metrics import has_metrics, iter_metrics

__all__ = [
    "PRIVATE_DIR",
    "PRIVATE_FILE",
    "JsonlTail",
    "RunDir",
    "STACK_SECTION",
    "append_jsonl",
    "final_metrics_by_step",
    "read_jsonl",
]

PRIVATE_DIR = 0o700
# a rank's part of ``stacks/attempt-K/node-NAME.txt`` starts with this line (the node agent gathers
# its ranks' stacks into one file; older run directories have a ``rank-R.txt`` a rank)
STACK_SECTION = "#### rank %d ####"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def metrics(self) -> Path:
        """The live metrics file; older records are in the ``metrics/`` segments (read them all with
        :meth:`iter_metrics`)."""
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
        """Every record, segments first (a list: for small runs; large ones stream
        :meth:`iter_metrics`)."""
        return list(iter_metrics(self.path))

    def iter_metrics(self) -> Iterator[dict[str, Any]]:
        return iter_metrics(self.path)

    def has_metrics(self) -> bool:
        """A live metrics file or a rotated segment."""
        return has_metrics(self.path)

    def last_attempt(self) -> int:
        return reduce(read_jsonl(self.events)).attempt


def final_metrics_by_step(
    records: list[dict[str, Any]], rank: int = 0
) -> dict[int, dict[str, Any]]:
    """The record that counts for each step: the last one written (a resumed run redoes steps)."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("rank") == rank:
            out[int(r["step"])] = r
    return out
