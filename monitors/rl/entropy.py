"""Policy entropy collapsing, forecast before it happens."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

from ..base import Finding, finite_of, median, spelled
from ..config import EntropyCollapseConfig
from .common import _NO_VALUE, _median_small, _SharedRL, _spellings, _St
from .trend import _Fit


class EntropyCollapseMonitor(_SharedRL):
    """Policy entropy collapsing (``monitor="entropy_collapse"``), forecast before it happens.

    Reads ``entropy``. Early level: median of the first ``baseline_steps`` values
    after ``warmup_steps`` (fixed once known; forgotten if the run rewinds before it).
    Current level: median of the last ``smooth`` values.

    - **Forecast (warning)**: entropy decays roughly exponentially as a policy
      collapses (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
      who also report reward R = -a*e^H + b, so spent entropy caps the reward), so
      a line through log entropy over the last ``window`` values is extrapolated;
      it warns when the line reaches ``floor_frac`` x early level within
      ``horizon`` steps, the current level is below ``project_gate_frac`` x early
      level, and the last ``short_window`` values still fall fast enough to get
      there within the horizon too, for ``confirm_steps`` steps in a row. The
      finding's value is the steps left; the detail names the forecast step and,
      with a reward key, the fitted R = -a*e^H + b and the reward it predicts once
      entropy is spent.
    - **Collapse (critical)**: the current level below ``collapse_frac`` x early level.
    - **All clear (info)**: level back above ``recover_frac`` x early level and no
      forecast, for ``clear_steps`` steps.

    A transient dip (say 30 % for a few steps, then back) does not warn: the
    momentum fit stops forecasting as soon as the dip stops falling, and the
    confirmation needs the decline to go on. Known false positives: a policy that
    sharpens legitimately and fast from a high-entropy start (tune ``horizon`` /
    ``floor_frac``); temperature or sampling changes mid-run shift entropy by design.
    Known misses: collapse within the first ``baseline_steps`` (no early level yet).
    """

    name = "entropy_collapse"

    def __init__(self, cfg: EntropyCollapseConfig | None = None) -> None:
        self.cfg = cfg or EntropyCollapseConfig()
        self._own = _spellings(self.cfg.key)
        self._key, self._reward = spelled(self.cfg.key), spelled(self.cfg.reward_key)
        self._gate = self._rewind_keys = self._own
        super().__init__()

    def _new_state(self) -> _St:
        st = _St()
        c = self.cfg
        st.early = []
        st.base = None
        st.smooth = deque(maxlen=c.smooth)
        st.long = _Fit(c.window)
        st.short = _Fit(c.window)  # values under the gate, since the level went under it
        st.confirm = 0
        st.below = 0  # consecutive values under project_gate_frac x early level
        st.cui = [0, 0.0, 0.0, 0.0, 0.0]  # n, sum u, sum r, sum uu, sum ur (u = e^H)
        return st

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()
        st.early = [(s, v) for s, v in st.early if s < step]
        if st.base is not None and len(st.early) < self.cfg.baseline_steps:
            st.base = None
        while st.smooth and st.smooth[-1][0] >= step:
            st.smooth.pop()
        st.long.rewind(step)
        st.short.clear()
        st.confirm = 0
        st.below = 0
        st.cui = [0, 0.0, 0.0, 0.0, 0.0]

    def _cui(self, st: _St) -> str:
        n, su, sr, suu, sur = st.cui
        d = n * suu - su * su
        if n < 10 or d <= 0:
            return ""
        slope = (n * sur - su * sr) / d  # R = slope * e^H + b, slope = -a
        b = (sr - slope * su) / n
        if slope >= 0:
            return ""
        return (
            f"; R = -a*e^H + b fitted on {n} steps (a={-slope:.3g}, b={b:.3g}): "
            f"reward tops out near {b + slope:.3g} once entropy is spent"
        )

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        x = record.get(self._key[0])  # finite_of, its common case (a finite float) inlined
        if type(x) is not float or x - x != 0.0:
            x = finite_of(record, self._key)
            if x is None:
                return _NO_VALUE
        r = record.get(self._reward[0])
        if type(r) is not float or r - r != 0.0:
            r = finite_of(record, self._reward)
        return (x, r)

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        x = inputs[0]
        if x is None or step <= cfg.warmup_steps:
            return []
        st.smooth.append((step, x))
        lx = math.log(max(x, 1e-12))
        st.long.add(step, lx)
        r = inputs[1]
        if r is not None and x < 50:
            u = math.exp(x)
            c = st.cui
            c[0] += 1
            c[1] += u
            c[2] += r
            c[3] += u * u
            c[4] += u * r
        if st.base is None:
            st.early.append((step, x))
            if len(st.early) >= cfg.baseline_steps:
                st.base = median([v for _, v in st.early])
            return []
        base = st.base
        if base <= 0:
            return []
        out: list[Finding] = []
        cur = _median_small(st.smooth)
        rel = cur / base
        collapsed = rel < cfg.collapse_frac
        # momentum is judged only on values already under the gate (the first two there are the drop
        # itself): a dip that dropped and stopped has a flat bottom there, a collapse keeps falling
        # - significantly (t of the slope), so that noise on a flat bottom does not look like a
        # decline
        if x < cfg.project_gate_frac * base:
            st.below += 1
            if st.below > 2:
                st.short.add(step, lx)
        else:
            st.below = 0
            st.short.clear()
        eta = None
        if (
            not collapsed
            and rel < cfg.project_gate_frac
            and len(st.long.q) >= cfg.window
            and len(st.short.q) >= cfg.short_window
            and st.short.tstat() <= -cfg.momentum_t
        ):
            bl, bs = st.long.slope(), st.short.slope()
            if bl < 0 and bs < 0:
                target = math.log(cfg.floor_frac * base)
                eta_l = (target - st.long.at(step)) / bl
                eta_s = (target - st.short.at(step)) / bs
                if eta_l <= cfg.horizon and eta_s <= cfg.horizon:
                    eta = max(eta_l, 0.0)
        st.confirm = st.confirm + 1 if eta is not None else 0
        level = 2 if collapsed else 1 if st.confirm >= cfg.confirm_steps else 0
        quiet = eta is None and rel >= cfg.recover_frac
        phase = st.ep.update(level, quiet, cfg.clear_steps)
        if phase is None:
            return out
        if level == 2:
            value = rel
            detail = (
                f"{cfg.key} {cur:.4g} is {rel:.0%} of its early level {base:.4g} "
                f"(< {cfg.collapse_frac:.0%}): collapsed"
            )
        elif level == 1:
            value = eta
            rate = 1 - math.exp(st.long.slope())
            detail = (
                f"{cfg.key} {cur:.4g} ({rel:.0%} of early level {base:.4g}) falls "
                f"{rate:.1%}/step: forecast "
                f"to reach {cfg.floor_frac * base:.4g} ({cfg.floor_frac:.0%}) at step "
                f"{step + math.ceil(eta)} "
                f"(in ~{eta:.0f} steps, horizon {cfg.horizon})" + self._cui(st)
            )
        else:
            value, detail = rel, ""
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
            f"{cfg.key} {cur:.4g} back to {rel:.0%} of its early level {base:.4g}, no collapse "
            "forecast "
            f"for {cfg.clear_steps} steps",
        )
        return out
