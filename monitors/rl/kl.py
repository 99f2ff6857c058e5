"""KL to the reference policy drifting past its budget."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

from ..base import Finding, finite_of, spelled
from ..config import KLDriftConfig
from .common import _median_small, _SharedRL, _spellings, _St
from .trend import _Fit


class KLDriftMonitor(_SharedRL):
    """KL to the reference policy drifting (``monitor="kl_drift"``).

    Reads ``kl``. Rules: (1) budget - the median of the last ``smooth`` values
    above ``budget`` (critical); (2) steady growth - after ``warmup_steps``, over
    the last ``window`` values: a positive least-squares slope, at least
    ``min_up_frac`` of the step-to-step changes positive, the fitted value grew
    by ``min_growth`` (1.0 = doubled) across the window, and the current value is
    at least ``min_kl`` (warning). One episode: the trend opens it (or the budget,
    critical at once), the budget escalates it, ``clear_steps`` steps with neither
    close it (all-clear, info).

    Known false positives: KL rises from 0 at the start of every run (that is
    what warm-up and ``min_kl`` are for; recorded tiny GRPO runs climb from 0 to
    ~0.013 in 30 steps); a deliberately small ``beta``. Known misses: a KL that
    jumps once and stays (no trend, under budget); runs with ``beta = 0`` where
    TRL does not log ``kl``.
    """

    name = "kl_drift"

    def __init__(self, cfg: KLDriftConfig | None = None) -> None:
        self.cfg = cfg or KLDriftConfig()
        self._own = _spellings(self.cfg.key)
        self._key = spelled(self.cfg.key)
        self._gate = self._rewind_keys = self._own
        super().__init__()

    def _new_state(self) -> _St:
        st = _St()
        st.smooth = deque(maxlen=self.cfg.smooth)
        st.fit = _Fit(self.cfg.window)
        st.ups = deque(maxlen=self.cfg.window - 1)  # (step, went up)
        st.nups = 0
        st.prev = None
        return st

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()
        while st.smooth and st.smooth[-1][0] >= step:
            st.smooth.pop()
        st.fit.rewind(step)
        while st.ups and st.ups[-1][0] >= step:
            st.nups -= st.ups.pop()[1]
        st.prev = st.fit.q[-1][1] if st.fit.q else None

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        return (finite_of(record, self._key),)

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        x = inputs[0]
        if x is None:
            return []
        st.smooth.append((step, x))
        st.fit.add(step, x)
        if st.prev is not None:
            if len(st.ups) == st.ups.maxlen:
                st.nups -= st.ups[0][1]
            up = 1 if x > st.prev else 0
            st.ups.append((step, up))
            st.nups += up
        st.prev = x
        out: list[Finding] = []
        over = False
        cur = 0.0
        if cfg.budget:
            cur = _median_small(st.smooth)
            over = len(st.smooth) >= cfg.smooth and cur > cfg.budget
        trending = False
        start = end = b = 0.0
        if step > cfg.warmup_steps and len(st.fit.q) >= cfg.window and x >= cfg.min_kl:
            b = st.fit.slope()
            start, end = st.fit.at(st.fit.q[0][0]), st.fit.at(step)
            ups = st.nups / max(1, len(st.ups))
            growth = (end / start - 1) if start > 0 else math.inf
            trending = b > 0 and ups >= cfg.min_up_frac and growth >= cfg.min_growth
        level = 2 if over else 1 if trending else 0
        phase = st.ep.update(level, level == 0, cfg.clear_steps)
        if phase is None:
            return out
        if over:
            value, detail = cur, f"{cfg.key} {cur:.4g} over the budget {cfg.budget:g}"
        elif trending:
            value = b
            detail = (
                f"{cfg.key} growing steadily: {start:.3g} -> {end:.3g} over steps "
                f"{int(st.fit.q[0][0])}-{step} "
                f"(+{b:.3g}/step, {st.nups / max(1, len(st.ups)):.0%} of steps up)"
            )
        else:
            value, detail = x, ""
        self._report(
            out,
            st,
            record,
            step,
            rank,
            phase,
            level,
            value,
            detail,
            f"{cfg.key} {x:.4g} under budget and not growing for {cfg.clear_steps} steps",
        )
        return out
