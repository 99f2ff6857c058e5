"""Following a run directory: its ``events.jsonl`` and ``metrics.jsonl`` fed to sinks, in time
order.

A sink is any object with ``observe_event(record)`` and ``observe_metric(record)``
(the Prometheus and MLflow exporters). Data flows one way: the sinks read the run
directory, never the ranks or the supervisor.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Iterable

from .jsonl import JsonlTail
from .metrics import MetricsTail

log = logging.getLogger("ptops.runrecord.follow")


def _ts(rec: dict[str, Any]) -> float:
    try:
        t = float(rec.get("ts"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return t if math.isfinite(t) else 0.0


def feed(sinks: Iterable[Any], events: list[dict], metrics: list[dict]) -> int:
    """Feed one batch of both files, merged by ``ts`` (events first on a tie); returns how many
    records."""
    merged = [(_ts(e), 0, i, e) for i, e in enumerate(events)]
    merged += [(_ts(m), 1, i, m) for i, m in enumerate(metrics)]
    merged.sort(key=lambda t: (t[0], t[1], t[2]))
    for _, is_metric, _, rec in merged:
        for sink in sinks:
            try:
                (sink.observe_metric if is_metric else sink.observe_event)(rec)
            except Exception:  # a broken sink must not stop the others
                log.exception("sink %r failed on a record", sink)
    return len(merged)


class Follower(threading.Thread):
    """Tails ``events.jsonl`` and the metrics (across rotations: :class:`MetricsTail`) of a run
    directory into sinks."""

    def __init__(
        self,
        run_dir: str | Path,
        sinks: Iterable[Any],
        poll_s: float = 0.5,
        from_start: bool = True,
    ):
        super().__init__(name="ptops-follow", daemon=True)
        run_dir = Path(run_dir)
        self.run_dir = run_dir
        self.sinks = list(sinks)
        self.poll_s = poll_s
        self._events = JsonlTail(run_dir / "events.jsonl", from_end=not from_start)
        self._metrics = MetricsTail(run_dir, from_end=not from_start)
        self._stop_event = threading.Event()
        self.records = 0

    def poll_once(self) -> int:
        n = feed(self.sinks, self._events.read(), self._metrics.read())
        self.records += n
        return n

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("following %s failed", self.run_dir)
            self._stop_event.wait(self.poll_s)
        self.poll_once()
        self._metrics.close()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)


def follow(
    run_dir: str | Path, *sinks: Any, poll_s: float = 0.5, from_start: bool = True
) -> Follower:
    """Start tailing a run directory into ``sinks``; the records already there are fed before it
    returns."""
    f = Follower(run_dir, sinks, poll_s=poll_s, from_start=from_start)
    f.poll_once()
    f.start()
    return f


def replay(run_dir: str | Path, *sinks: Any) -> int:
    """Feed a run directory's records once, in time order; return how many."""
    return Follower(run_dir, sinks).poll_once()
