"""Progress for long runs: a live line on a terminal, plain lines elsewhere, and a summary."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ptops.ops.runrecord.jsonl import JsonlTail


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return (
        f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else f"{seconds // 60}:{seconds % 60:02d}"
    )


class Progress:
    def __init__(
        self, total: int, stream=None, live: bool | None = None, plain_every_s: float = 5.0
    ):
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.plain_every_s = plain_every_s
        self.start = time.monotonic()
        self.first_step: int | None = None
        self.first_step_t = 0.0
        self.step = 0
        self.loss = None
        self.tps = None
        self._last_plain = 0.0
        self._partial = b""

    def follow(self, path: Path, offset: int) -> int:
        """Read rank-0 records appended since ``offset``; returns the new offset."""
        tail = JsonlTail(path, offset)
        for rec in tail.records():
            if rec.get("rank") == 0 and isinstance(rec.get("step"), int):
                self.update(rec)
        return tail.offset

    def update(self, rec: dict) -> None:
        now = time.monotonic()
        self.step = int(rec["step"])
        if self.first_step is None:
            self.first_step, self.first_step_t = self.step, now
        self.loss = rec.get("loss")
        self.tps = rec.get("tokens_per_s")
        self.render(now)

    def eta(self, now: float) -> str:
        done = self.step - (self.first_step or 0)
        if done <= 0:
            return "?"
        rate = (now - self.first_step_t) / done
        return _fmt_s(rate * (self.total - self.step))

    def line(self, now: float) -> str:
        loss = f"{self.loss:.4f}" if isinstance(self.loss, (int, float)) else str(self.loss)
        tps = f"{self.tps:,.0f}" if isinstance(self.tps, (int, float)) else "-"
        return (
            f"step {self.step}/{self.total}  loss {loss}  tok/s {tps}  elapsed "
            f"{_fmt_s(now - self.start)}  eta {self.eta(now)}"
        )

    def render(self, now: float) -> None:
        if self.live:
            self.stream.write("\r\033[K" + self.line(now))
            self.stream.flush()
        elif now - self._last_plain >= self.plain_every_s or self.step >= self.total:
            self._last_plain = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
