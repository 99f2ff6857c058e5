"""Goodput: productive step time / wall time, and where the rest of the wall time went.

One incremental account, fed events and metric records in file order, read by ``ptops status``,
``ptops diagnose`` and the Prometheus exporter alike (same numbers everywhere). Pure: no clock of
its own (the caller passes ``now`` for a live run), no I/O.

Where the time goes, per attempt (rank 0's records; every step is one collective-bound unit):

- **productive**: the duration (``step_s``) of each step's final execution;
- **recomputed**: earlier executions of a step that was trained again after a restart or rollback;
- **startup**: launch -> the start of the attempt's first step (imports, rendezvous, model build,
  load);
- **detection**: the end of the attempt's last step -> the event that ended it (crash, hang,
  rollback, early exit, preemption): the time a failure went unnoticed;
- **restart**: that event -> the next launch (stack collection, kill, backoff, checkpoint checks);
- **checkpoint_blocking**: training blocked by checkpoint saves (``blocking_s`` of each commit);
- **shutdown**: the end of the last step -> ``completed`` (the final save, process exit);
- **other**: the rest (time between steps: logging, eval, data stalls outside ``step_s``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# events that end an attempt: the failure was seen at this event's time
ATTEMPT_ENDS = frozenset(
    {"crash", "hang", "rollback", "early_exit", "misconfigured", "stopped", "failed"}
)
TERMINAL = frozenset({"completed", "failed", "stopped"})
CAUSES = (
    "startup",
    "detection",
    "restart",
    "recomputed",
    "checkpoint_blocking",
    "shutdown",
    "other",
)


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class Goodput:
    """Feed ``event(e)`` / ``record(r)``; ``summary(now)`` any time.

    Kept per attempt (launch time, first step start, last step end, the event that ended it), so the
    two files may be fed in any interleaving (the exporter follows them separately); only rank 0's
    records of one attempt must come in file order, which they do.
    """

    def __init__(self) -> None:
        self.end_ts: float | None = None
        self.final: dict[int, float] = {}  # step -> duration of its latest execution
        self.productive_s = 0.0
        self.recomputed_s = 0.0
        self.saves: list[tuple[int, float, float]] = []  # (attempt, ts, blocking_s) of each commit
        self.launch: dict[int, float] = {}
        self.first_start: dict[int, float] = {}
        self.last_end: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self._attempt = 0
        self._first_ts: float | None = None  # of anything, for runs without a launch event

    def event(self, e: Mapping[str, Any]) -> None:
        kind, ts = e.get("kind"), _num(e.get("ts"))
        if ts is None:
            return
        att = e.get("attempt") if isinstance(e.get("attempt"), int) else None
        if kind == "launch":
            att = att if att is not None else self._attempt + 1
            self.launch.setdefault(att, ts)
            self._attempt = max(self._attempt, att)
            if self.end_ts is not None and ts > self.end_ts:
                self.end_ts = None  # a resumed run is running again
        elif kind in ATTEMPT_ENDS:
            self.ended.setdefault(att if att is not None else self._attempt, ts)
        elif kind == "checkpoint":
            b = _num(e.get("blocking_s"))
            if b is not None and b > 0 and e.get("rank", 0) in (0, None):
                self.saves.append((att if att is not None else self._attempt, ts, b))
        if kind in TERMINAL and (self.end_ts is None or ts > self.end_ts):
            self.end_ts = ts

    def record(self, r: Mapping[str, Any]) -> None:
        if r.get("rank", 0) != 0:
            return
        step, dur, ts = r.get("step"), _num(r.get("step_s")), _num(r.get("ts"))
        if not isinstance(step, int) or dur is None or dur < 0:
            return
        if step in self.final:
            self.recomputed_s += self.final[step]
            self.productive_s -= self.final[step]
        self.final[step] = dur
        self.productive_s += dur
        if ts is None:
            return
        att = r.get("attempt") if isinstance(r.get("attempt"), int) else max(self._attempt, 1)
        self.first_start.setdefault(att, ts - dur)
        self.last_end[att] = max(ts, self.last_end.get(att, ts))
        if self._first_ts is None:
            self._first_ts = ts - dur

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """``{"ratio", "wall_s", "productive_s", "lost_s": {cause: s}}``; ratio None before anything
        ran."""
        starts = [*self.launch.values(), *([self._first_ts] if self._first_ts is not None else [])]
        start = min(starts) if starts else None
        end = self.end_ts if self.end_ts is not None else now
        if end is None:
            end = max([*self.last_end.values(), *self.ended.values()], default=start)
        wall = (end - start) if (start is not None and end is not None) else 0.0
        lost = dict.fromkeys(CAUSES, 0.0)
        lost["recomputed"] = self.recomputed_s
        # a save after the attempt's last step (the final save) is part of its shutdown, not counted
        # twice
        lost["checkpoint_blocking"] = sum(
            b for a, ts, b in self.saves if ts <= self.last_end.get(a, math.inf)
        )
        attempts = sorted(self.launch)
        for i, a in enumerate(attempts):
            launched, first, last, ended = (
                self.launch[a],
                self.first_start.get(a),
                self.last_end.get(a),
                self.ended.get(a),
            )
            if first is not None:
                lost["startup"] += max(0.0, first - launched)
            elif ended is not None:
                lost["startup"] += max(0.0, ended - launched)  # died before its first step
            if ended is not None and last is not None:
                lost["detection"] += max(0.0, ended - last)
            if i + 1 < len(attempts):
                since = ended if ended is not None else last
                if since is not None:
                    lost["restart"] += max(0.0, self.launch[attempts[i + 1]] - since)
        if self.end_ts is not None and attempts and self.ended.get(attempts[-1]) is None:
            last = self.last_end.get(attempts[-1])
            if last is not None:
                lost["shutdown"] += max(0.0, self.end_ts - last)  # final save, process exit
        lost["other"] = max(
            0.0, wall - self.productive_s - sum(v for k, v in lost.items() if k != "other")
        )
        return {
            "ratio": max(0.0, min(1.0, self.productive_s / wall)) if wall > 0 else None,
            "wall_s": wall,
            "productive_s": self.productive_s,
            "lost_s": lost,
        }


def account(
    events: list[Mapping[str, Any]], records: list[Mapping[str, Any]], now: float | None = None
) -> dict[str, Any]:
    """The whole run's goodput from its files (``now`` for a run still going; else it ends at its
    last record), rounded for people (ratio to 4 places, seconds to ms)."""
    g = Goodput()
    for e in events:
        g.event(e)
    for r in records:
        g.record(r)
    return rounded(g.summary(now))


def rounded(out: dict[str, Any]) -> dict[str, Any]:
    """A summary rounded for people (ratio to 4 places, seconds to ms)."""
    return {
        "ratio": None if out["ratio"] is None else round(out["ratio"], 4),
        "wall_s": round(out["wall_s"], 3),
        "productive_s": round(out["productive_s"], 3),
        "lost_s": {k: round(v, 3) for k, v in out["lost_s"].items()},
    }
