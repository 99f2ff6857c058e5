"""Memory seen coming: a rank whose memory trend reaches its limit within N steps.

Why: an OOM kill ends the attempt with no stack and loses every step since the last save; a
leak or a slowly growing cache is a straight line long before that. Each rank's records carry its
memory (``ops/rank/memory.py``: ``mem_rss_mb`` against ``mem_limit_mb`` on the host,
``cuda_reserved_mb`` against ``cuda_total_mb`` on a GPU); this monitor fits a least-squares line
to the last ``window`` steps of each series per rank and, when that line reaches the limit within
``horizon_steps`` steps, reports the step it forecasts: once per episode (``phase="open"``), and
``resolved`` (severity info) once the forecast is beyond twice the horizon again (the leak
stopped, or memory was given back). A rewind (resume, rollback) or a new attempt (new
processes) starts the series over.

``Finding.value`` is the forecast step (the first step at which the line reaches the limit);
``rank`` names the rank; ``detail`` says now, the slope, the limit and where the limit came from.
``[monitors.memory] limit_mb`` / ``device_limit_mb`` override the limits the ranks report (a
site's own margin below the cgroup limit, or a small box standing in for a big one).

Known misses: a sudden jump (one huge allocation, the first checkpoint's staging buffers) is not a
trend: a rise whose largest single step is more than ``max_jump_share`` of it waits until the
window shows steady growth; the first ``warmup_steps`` of each attempt are skipped (allocators and
optimizer state grow there on every healthy run).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

from .base import Finding, RankedMonitor, number, record_attempt, record_ts
from .config import MemoryConfig

# (series, used key, reported limit key, config field that overrides the limit)
SERIES = (
    ("host", "mem_rss_mb", "mem_limit_mb", "limit_mb"),
    ("device", "cuda_reserved_mb", "cuda_total_mb", "device_limit_mb"),
)


class _Series:
    """The last ``window`` (step, MB) points with running sums: the fit is O(1) per record (steps
    are taken from ``origin``, the first step after a rewind, so the sums stay small and exact)."""

    __slots__ = ("points", "episode_open", "origin", "sx", "sy", "sxx", "sxy")

    def __init__(self, window: int) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=window)
        self.episode_open = False
        self.clear()

    def clear(self) -> None:
        self.points.clear()
        self.origin: int | None = None
        self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, step: int, value: float) -> None:
        if self.origin is None:
            self.origin = step
        if len(self.points) == self.points.maxlen:
            x0, y0 = self.points[0]
            x0 -= self.origin
            self.sx -= x0
            self.sy -= y0
            self.sxx -= x0 * x0
            self.sxy -= x0 * y0
        self.points.append((step, value))
        x = step - self.origin
        self.sx += x
        self.sy += value
        self.sxx += x * x
        self.sxy += x * value

    def fit(self) -> tuple[float, float] | None:
        """(slope, intercept) in steps, as :func:`fit` of the points gives."""
        n = len(self.points)
        if n < 2:
            return None
        var = self.sxx - self.sx * self.sx / n
        if var <= 0:
            return None
        slope = (self.sxy - self.sx * self.sy / n) / var
        icept_rel = (self.sy - slope * self.sx) / n
        return slope, icept_rel - slope * self.origin


class _RankState:
    __slots__ = ("attempt", "seen", "series")

    def __init__(self, window: int) -> None:
        self.attempt: Any = None
        self.seen = 0  # records of this attempt so far (warm-up)
        self.series = {name: _Series(window) for name, *_ in SERIES}


def fit(points: Any) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of (step, value) points; None when the steps do not vary."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


def _jump(points: Any) -> float:
    """The share of the window's rise that its largest single step makes (1.0: all of it)."""
    rise = points[-1][1] - points[0][1]
    if rise <= 0:
        return 1.0
    prev, top = points[0][1], 0.0
    for _, v in points:
        top, prev = max(top, v - prev), v
    return top / rise


class MemoryMonitor(RankedMonitor):
    """The memory trend of each rank against its limit (``monitor="memory"``)."""

    name = "memory"
    _gate = frozenset(used for _, used, _, _ in SERIES)  # a record without memory keys: nothing
    _episodes = 0

    def __init__(self, cfg: MemoryConfig | None = None) -> None:
        self.cfg = cfg or MemoryConfig()
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._episodes = 0

    def _new_state(self) -> _RankState:
        return _RankState(self.cfg.window)

    def _rewind(self, state: _RankState, step: int) -> None:
        for s in state.series.values():
            s.clear()
            s.episode_open = False
        state.seen = 0

    def _check(
        self, state: _RankState, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        attempt = record_attempt(record)
        # a new attempt (new processes): its own warm-up, series, episode
        if attempt != state.attempt:
            state.attempt = attempt
            self._rewind(state, step)
        state.seen += 1
        if state.seen <= cfg.warmup_steps:
            return []
        out: list[Finding] = []
        for name, used_key, limit_key, override in SERIES:
            used = number(record.get(used_key))
            if used is None or not math.isfinite(used):
                continue
            limit = getattr(cfg, override)
            source = f"monitors.memory.{override}"
            if limit is None:
                limit = number(record.get(limit_key))
                source = limit_key
            if limit is None or not math.isfinite(limit) or limit <= 0:
                continue
            s = state.series[name]
            s.add(step, used)
            f = self._judge(s, name, used, limit, source, step, rank, record)
            if f is not None:
                out.append(f)
        return out

    def _judge(
        self,
        s: _Series,
        name: str,
        used: float,
        limit: float,
        source: str,
        step: int,
        rank: int,
        record: Mapping[str, Any],
    ) -> Finding | None:
        cfg = self.cfg
        if len(s.points) < cfg.min_points:
            return None
        line = s.fit()
        if line is None:
            return None
        slope, icept = line
        rising = slope >= cfg.min_slope_mb
        # the first step at which the fitted line reaches the limit (now, when it is already there)
        at = step if used >= limit else (math.ceil((limit - icept) / slope) if rising else None)
        soon = at is not None and at - step <= cfg.horizon_steps
        if soon and not s.episode_open and _jump(s.points) > cfg.max_jump_share:
            return None  # a rise that came mostly from one step is an allocation, not a trend (yet)
        if soon and not s.episode_open:
            s.episode_open = True
            self._episodes += 1
            what = "RSS" if name == "host" else "CUDA reserved"
            detail = (
                f"rank {rank} {name} memory ({what}) {used:.0f} MB of {limit:.0f} MB ({source}), "
                f"+{slope:.1f} MB/step over {len(s.points)} steps: forecast to reach the limit at "
                f"step {at} ({max(0, at - step)} steps from now)"
            )
            return Finding(
                self.name,
                step,
                float(at),
                detail,
                "warning",
                rank,
                record_attempt(record),
                record_ts(record),
                episode=self._episodes,
                phase="open",
            )
        if s.episode_open and (at is None or at - step > 2 * cfg.horizon_steps):
            s.episode_open = False
            detail = (
                f"rank {rank} {name} memory {used:.0f} MB of {limit:.0f} MB: no longer forecast to "
                f"reach the limit within {2 * cfg.horizon_steps} steps"
            )
            return Finding(
                self.name,
                step,
                None if at is None else float(at),
                detail,
                "info",
                rank,
                record_attempt(record),
                record_ts(record),
                episode=self._episodes,
                phase="resolved",
            )
        return None
