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
    """The launch's progress: rank 0's latest step, loss and tokens/s.

    ``total``: the run's step count when one is known (a recipe's ``train.steps``), else None (a
    script's own loop: its steps are its own), which shows no total and no ETA; a step past the
    total drops both too (the total was wrong). On a terminal one live line, redrawn at most every
    ``live_every_s``; elsewhere (a log file) a plain line at most every ``plain_every_s`` whatever
    the step rate, the step that reaches the total, and at :meth:`close` the latest step if no line
    showed it yet."""

    def __init__(
        self,
        total: int | None,
        stream=None,
        live: bool | None = None,
        plain_every_s: float = 5.0,
        live_every_s: float = 0.1,
    ):
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.plain_every_s = plain_every_s
        self.live_every_s = live_every_s
        self.start = time.monotonic()
        self.first_step: int | None = None
        self.first_step_t = 0.0
        self.step = 0
        self.loss = None
        self.tps = None
        self._last_line: float | None = None  # when the last line was written (monotonic)
        self._shown_step: int | None = None  # the step the last line showed

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

    def _total(self) -> int | None:
        """The total to show: none unless known, and none once a step passed it."""
        return self.total if self.total and self.step <= self.total else None

    def eta(self, now: float) -> str:
        done = self.step - (self.first_step or 0)
        total = self._total()
        if done <= 0 or total is None:
            return "?"
        rate = (now - self.first_step_t) / done
        return _fmt_s(rate * (total - self.step))

    def line(self, now: float) -> str:
        loss = f"{self.loss:.4f}" if isinstance(self.loss, (int, float)) else str(self.loss)
        tps = f"{self.tps:,.0f}" if isinstance(self.tps, (int, float)) else "-"
        total = self._total()
        return (
            f"step {self.step}" + (f"/{total}" if total else "") + f"  loss {loss}  tok/s {tps}  "
            f"elapsed {_fmt_s(now - self.start)}" + (f"  eta {self.eta(now)}" if total else "")
        )

    def render(self, now: float) -> None:
        every = self.live_every_s if self.live else self.plain_every_s
        last = self.total is not None and self.step == self.total != self._shown_step
        if not (last or self._last_line is None or now - self._last_line >= every):
            return
        self._last_line, self._shown_step = now, self.step
        self.stream.write(("\r\033[K" + self.line(now)) if self.live else self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.first_step is not None and self._shown_step != self.step:
            now = time.monotonic()
            self._shown_step = self.step  # the latest step, once
            self.stream.write(("\r\033[K" + self.line(now)) if self.live else self.line(now) + "\n")
        if self.live:
            self.stream.write("\n")
        self.stream.flush()
