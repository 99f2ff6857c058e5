"""The rank probe: the one object an engine adapter talks to inside a training process.

Adapters call ``probe.startup()``, then ``probe.step(step, metrics)`` after every
optimizer step and ``probe.phase("checkpoint", step)`` around saves. Where the
records go is the probe's business: straight into ``metrics.jsonl`` when the run
is unsupervised, or over the supervisor's channel when one is given (no shared
filesystem assumed there).
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from ptops.ops.rundir import RunDir, append_jsonl

REQUIRED_KEYS = ("loss", "grad_norm", "lr", "step_s", "tokens_per_s")


def _clean(value: Any) -> Any:
    """JSON-safe scalars; NaN/Inf stay visible as strings so monitors can see them."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    return value


class Probe:
    def __init__(self, run_dir: Path, rank: int, attempt: int, world_size: int = 1):
        self.run = RunDir(Path(run_dir))
        self.rank = rank
        self.attempt = attempt
        self.world_size = world_size
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._last_step_end = time.monotonic()

    @classmethod
    def from_env(cls) -> "Probe":
        return cls(
            run_dir=Path(os.environ["PTOPS_RUN_DIR"]),
            rank=int(os.environ.get("RANK", "0")),
            attempt=int(os.environ.get("PTOPS_ATTEMPT", "1")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )

    def startup(self) -> None:
        self.phase("startup", 0)

    def phase(self, phase: str, step: int) -> None:
        """Heartbeat with a phase (startup / step / checkpoint). Used by the supervisor."""

    def step(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record one finished optimizer step. Missing required keys are filled with None."""
        now = time.monotonic()
        record: dict[str, Any] = {"step": int(step), "rank": self.rank, "attempt": self.attempt}
        for key in REQUIRED_KEYS:
            record[key] = None
        if metrics.get("step_s") is None:
            record["step_s"] = now - self._last_step_end
        for key, value in metrics.items():
            record[key] = _clean(value)
        record["ts"] = time.time()
        self._last_step_end = now
        append_jsonl(self.run.metrics, record)
        self.phase("step", step)
        return record

    def before_step(self, step: int) -> None:
        """Called by the adapter at the start of each optimizer step (fault hooks fire here)."""

    def should_poison(self, step: int) -> bool:
        """True when a ``nan`` fault wants this step's loss poisoned (adapter multiplies by NaN)."""
        return False
