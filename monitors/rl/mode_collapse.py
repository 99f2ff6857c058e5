"""Completions collapsing onto one mode: GRPO groups whose rewards no longer differ (no advantage,
no learning signal), or a diversity metric falling."""

from __future__ import annotations

from collections import deque
from typing import Any, Mapping

from ..base import Finding, finite_of, median, spelled
from ..config import ModeCollapseConfig
from .common import _median_small, _SharedRL, _spellings, _St


class ModeCollapseMonitor(_SharedRL):
    """Mode collapse (``monitor="mode_collapse"``).

    Reads ``frac_reward_zero_std`` (fraction of GRPO groups whose completions
    all got the same reward: no advantage, no learning signal): every value of
    the last ``window`` steps >= ``threshold`` (critical). With ``distinct_key``
    (a diversity metric, if the engine logs one): its median of the last 5 below
    ``distinct_frac`` x its early level (warning). One episode until neither holds
    for ``clear_steps`` steps.

    Known false positives: a task too hard (all rewards 0) or too easy (all 1)
    for the model also makes every group zero-variance - not a collapse of the
    policy but the same outcome (no gradient), and reported the same way; a
    binary reward with a small ``num_generations``. Known misses: collapse to a
    few distinct answers that still get different rewards.
    """

    name = "mode_collapse"

    def __init__(self, cfg: ModeCollapseConfig | None = None) -> None:
        self.cfg = cfg or ModeCollapseConfig()
        self._own = _spellings(self.cfg.key, self.cfg.distinct_key)
        self._key = spelled(self.cfg.key)
        self._distinct = spelled(self.cfg.distinct_key) if self.cfg.distinct_key else None
        self._noop = (None, None)
        self._gate = self._rewind_keys = self._own
        super().__init__()

    def _new_state(self) -> _St:
        st = _St()
        st.z = deque(maxlen=self.cfg.window)  # (step, value)
        st.below = 0  # values in st.z under the threshold
        st.d = deque(maxlen=5)
        st.early = []
        st.base = None
        st.dlow = False
        return st

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()
        while st.z and st.z[-1][0] >= step:
            if st.z.pop()[1] < self.cfg.threshold:
                st.below -= 1
        while st.d and st.d[-1][0] >= step:
            st.d.pop()
        st.early = [(s, v) for s, v in st.early if s < step]
        if st.base is not None and len(st.early) < self.cfg.baseline_steps:
            st.base = None
        st.dlow = False

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        x = record.get(self._key[0])  # finite_of, its common case (a finite float) inlined
        if type(x) is not float or x - x != 0.0:
            x = finite_of(record, self._key)
        return (x, finite_of(record, self._distinct) if self._distinct else None)

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        out: list[Finding] = []
        if step <= cfg.warmup_steps:
            return out
        x, d = inputs
        if x is None and d is None:
            return out
        if x is not None:
            if len(st.z) == st.z.maxlen and st.z[0][1] < cfg.threshold:
                st.below -= 1
            st.z.append((step, x))
            if x < cfg.threshold:
                st.below += 1
        full = len(st.z) >= cfg.window and st.below == 0
        if d is not None:
            st.d.append((step, d))
            if st.base is None:
                st.early.append((step, d))
                if len(st.early) >= cfg.baseline_steps:
                    st.base = median([v for _, v in st.early])
            elif st.base > 0:
                st.dlow = _median_small(st.d) < cfg.distinct_frac * st.base
        level = 2 if full else 1 if st.dlow else 0
        phase = st.ep.update(level, level == 0, cfg.clear_steps)
        if phase is None:
            return out
        if full:
            value = median([v for _, v in st.z])
            detail = (
                f"{cfg.key} >= {cfg.threshold:g} for {cfg.window} steps "
                f"({int(st.z[0][0])}-{step}): "
                f"every group's completions get the same reward, no learning signal"
            )
        elif st.dlow:
            cur = _median_small(st.d)
            value = cur / st.base
            detail = f"{cfg.distinct_key} {cur:.4g} is {value:.0%} of its early level {st.base:.4g}"
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
            f"groups get different rewards again for {cfg.clear_steps} steps",
        )
        return out
