"""RL health for TRL GRPO / DPO style runs: one small monitor per failure mode.

The keys are TRL's (``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``,
``completions/mean_length``, ``clip_ratio/region_mean``); the ptops TRL adapter
writes them sanitised (``completions_mean_length``) and both spellings match.
TRL gathers these across ranks before logging, so every rank carries the same
value; each monitor still follows each rank and reports a step once.
A monitor whose key never appears stays silent (SFT, pre-training).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .base import Finding, RankedMonitor, StepSeries, correlation, first_number, get_number, linfit, median
from .config import (
    EntropyCollapseConfig,
    KLDriftConfig,
    ModeCollapseConfig,
    RewardHackingConfig,
    StaleRolloutConfig,
)


def _finite(record: Mapping[str, Any], key: str) -> float | None:
    v = get_number(record, key)
    return v if v is not None and math.isfinite(v) else None


class _St:
    """Per-rank state: series by name, an early-level baseline, latches."""

    __slots__ = ("series", "baseline", "early", "latched")

    def __init__(self) -> None:
        self.series: dict[str, StepSeries] = {}
        self.baseline: float | None = None
        self.early: list[tuple[int, float]] = []
        self.latched: set[str] = set()

    def s(self, name: str, maxlen: int) -> StepSeries:
        ser = self.series.get(name)
        if ser is None:
            ser = self.series[name] = StepSeries(maxlen)
        return ser

    def rewind(self, step: int) -> None:
        for ser in self.series.values():
            ser.rewind(step)
        self.early = [(s, v) for s, v in self.early if s < step]
        if self.baseline is not None and len(self.early) == 0:
            self.baseline = None
        self.latched.clear()


class _RL(RankedMonitor):
    def _new_state(self) -> _St:
        return _St()

    def _rewind(self, st: _St, step: int) -> None:
        st.rewind(step)

    @staticmethod
    def _latch(st: _St, tag: str, on: bool) -> bool:
        """True on the rising edge of ``on``."""
        if not on:
            st.latched.discard(tag)
            return False
        if tag in st.latched:
            return False
        st.latched.add(tag)
        return True


class EntropyCollapseMonitor(_RL):
    """Policy entropy collapsing (``monitor="entropy_collapse"``).

    Reads ``entropy``. Early level: median of the first ``baseline_steps``
    values after ``warmup_steps`` (fixed once known; forgotten if the run
    rewinds before it). Rules: (1) the median of the last ``smooth`` values
    falls below ``collapse_frac`` x early level (critical); (2) a line fitted to
    the last ``window`` values slopes down and reaches ``floor_frac`` x early
    level within ``horizon`` steps while the current level is already below
    ``project_gate_frac`` x early level (warning: collapse is coming).

    Known false positives: entropy falls as any policy learns - a run that
    starts from a high-entropy base model and sharpens legitimately can cross
    the projection rule (tune ``horizon``/``floor_frac``); temperature or
    sampling changes mid-run shift entropy by design. Known misses: collapse
    within the first ``baseline_steps`` (no early level yet).
    """

    name = "entropy_collapse"

    def __init__(self, cfg: EntropyCollapseConfig | None = None) -> None:
        self.cfg = cfg or EntropyCollapseConfig()
        super().__init__()

    def _check(self, st: _St, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        cfg = self.cfg
        x = _finite(record, cfg.key)
        if x is None or step <= cfg.warmup_steps:
            return []
        ser = st.s("e", max(cfg.window, cfg.smooth))
        ser.append(step, x)
        if st.baseline is None:
            st.early.append((step, x))
            if len(st.early) >= cfg.baseline_steps:
                st.baseline = median([v for _, v in st.early])
            return []
        base = st.baseline
        if base <= 0:
            return []
        out: list[Finding] = []
        cur = median(ser.values[-cfg.smooth:])
        collapsed = cur < cfg.collapse_frac * base
        if self._latch(st, "level", collapsed):
            self._emit(out, record, step, rank, "level", cur / base,
                       f"{cfg.key} {cur:.4g} is {cur / base:.0%} of its early level {base:.4g} "
                       f"(< {cfg.collapse_frac:.0%})", "critical")
        projecting = False
        if not collapsed and len(ser) >= cfg.window and cur < cfg.project_gate_frac * base:
            xs = [float(s) for s in ser.steps[-cfg.window:]]
            a, b = linfit(xs, ser.values[-cfg.window:])
            if b < 0:
                floor = cfg.floor_frac * base
                steps_to_floor = (floor - (a + b * step)) / b
                projecting = steps_to_floor <= cfg.horizon
                if projecting and self._latch(st, "projection", True):
                    self._emit(out, record, step, rank, "projection", max(steps_to_floor, 0.0),
                               f"{cfg.key} {cur:.4g} ({cur / base:.0%} of early level {base:.4g}) falls "
                               f"{-b:.3g}/step: projected to reach {floor:.4g} ({cfg.floor_frac:.0%}) in "
                               f"~{max(steps_to_floor, 0):.0f} steps (<= {cfg.horizon})", "warning")
        if not projecting:
            st.latched.discard("projection")
        return out


class KLDriftMonitor(_RL):
    """KL to the reference policy drifting (``monitor="kl_drift"``).

    Reads ``kl``. Rules: (1) budget - the median of the last ``smooth`` values
    above ``budget`` (critical); (2) steady growth - after ``warmup_steps``, over
    the last ``window`` values: a positive least-squares slope, at least
    ``min_up_frac`` of the step-to-step changes positive, the fitted value grew
    by ``min_growth`` (1.0 = doubled) across the window, and the current value is
    at least ``min_kl`` (warning).

    Known false positives: KL rises from 0 at the start of every run (that is
    what warm-up and ``min_kl`` are for; recorded tiny GRPO runs climb from 0 to
    ~0.013 in 30 steps); a deliberately small ``beta``. Known misses: a KL that
    jumps once and stays (no trend, under budget); runs with ``beta = 0`` where
    TRL does not log ``kl``.
    """

    name = "kl_drift"

    def __init__(self, cfg: KLDriftConfig | None = None) -> None:
        self.cfg = cfg or KLDriftConfig()
        super().__init__()

    def _check(self, st: _St, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        cfg = self.cfg
        x = _finite(record, cfg.key)
        if x is None:
            return []
        ser = st.s("kl", max(cfg.window, cfg.smooth))
        ser.append(step, x)
        out: list[Finding] = []
        if cfg.budget:
            cur = median(ser.values[-cfg.smooth:])
            over = len(ser) >= cfg.smooth and cur > cfg.budget
            if self._latch(st, "budget", over):
                self._emit(out, record, step, rank, "budget", cur,
                           f"{cfg.key} {cur:.4g} over the budget {cfg.budget:g}", "critical")
        trending = False
        if step > cfg.warmup_steps and len(ser) >= cfg.window and x >= cfg.min_kl:
            ys = ser.values[-cfg.window:]
            xs = [float(s) for s in ser.steps[-cfg.window:]]
            a, b = linfit(xs, ys)
            start, end = a + b * xs[0], a + b * xs[-1]
            ups = sum(1 for p, q in zip(ys, ys[1:]) if q > p) / (len(ys) - 1)
            growth = (end / start - 1) if start > 0 else math.inf
            trending = b > 0 and ups >= cfg.min_up_frac and growth >= cfg.min_growth
            if self._latch(st, "trend", trending):
                self._emit(out, record, step, rank, "trend", b,
                           f"{cfg.key} growing steadily: {start:.3g} -> {end:.3g} over steps {int(xs[0])}-{step} "
                           f"(+{b:.3g}/step, {ups:.0%} of steps up)", "warning")
        if not trending:
            st.latched.discard("trend")
        return out


class RewardHackingMonitor(_RL):
    """Reward hacking (``monitor="reward_hacking"``).

    Reads ``reward``, the held-out verifier key (``verifier_key``, e.g.
    ``rewards/verifier/mean``; rule off when absent) and ``coupled_keys``
    (``completions/mean_length``, ``clip_ratio/region_mean``). Over the last
    ``window`` steps after ``warmup_steps``: (1) the reward trends up
    (Pearson r against the step >= ``trend_corr``) while the verifier trends
    down (r <= -``trend_corr``) - critical; (2) the reward trends up and a
    coupled key trends up with it (r(reward, key) >= ``coupling_corr``, fitted
    rise >= ``min_growth``) - warning.

    Known false positives: rule 2 fires on healthy reasoning RL where longer
    answers are the point (lengths grow with reward by design) - keep it an
    alert, or drop ``completions/mean_length`` from ``coupled_keys``; a verifier
    on a tiny held-out set is noisy (widen ``window``). Known misses: hacking
    without a verifier key and without length/clip coupling.
    """

    name = "reward_hacking"

    def __init__(self, cfg: RewardHackingConfig | None = None) -> None:
        self.cfg = cfg or RewardHackingConfig()
        super().__init__()

    def _check(self, st: _St, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        cfg = self.cfg
        r = _finite(record, cfg.reward_key)
        if r is None:
            return []
        w = cfg.window
        rs = st.s("reward", w)
        rs.append(step, r)
        extra: dict[str, float] = {}
        if cfg.verifier_key:
            v = _finite(record, cfg.verifier_key)
            if v is not None:
                extra["verifier"] = v
        for k in cfg.coupled_keys:
            v = _finite(record, k)
            if v is not None:
                extra[k] = v
        for k, v in extra.items():
            st.s(k, w).append(step, v)
        out: list[Finding] = []
        if step <= cfg.warmup_steps or len(rs) < w:
            return out
        xs = [float(s) for s in rs.steps]
        r_trend = correlation(xs, rs.values)
        rising = r_trend >= cfg.trend_corr

        def aligned(name: str) -> list[float] | None:
            ser = st.series.get(name)
            if ser is None or len(ser) < w or ser.steps != rs.steps:
                return None
            return ser.values

        # (1) reward up, held-out verifier down
        hv = aligned("verifier") if "verifier" in extra else None
        hacked = False
        if hv is not None:
            v_trend = correlation(xs, hv)
            hacked = rising and v_trend <= -cfg.trend_corr
            if self._latch(st, "verifier", hacked):
                self._emit(out, record, step, rank, "verifier", v_trend,
                           f"{cfg.reward_key} rising ({rs.values[0]:.3g} -> {r:.3g}, r={r_trend:.2f}) while "
                           f"{cfg.verifier_key} falls ({hv[0]:.3g} -> {hv[-1]:.3g}, r={v_trend:.2f}) over steps "
                           f"{rs.steps[0]}-{step}", "critical")
        # (2) reward up together with length / clipping
        for k in cfg.coupled_keys:
            ys = aligned(k) if k in extra else None
            coupled = False
            if ys is not None and rising:
                a, b = linfit(xs, ys)
                start, end = a + b * xs[0], a + b * xs[-1]
                growth = (end - start) / abs(start) if abs(start) > 1e-9 else (math.inf if end > start else 0.0)
                rk = correlation(rs.values, ys)
                coupled = correlation(xs, ys) >= cfg.trend_corr and rk >= cfg.coupling_corr and growth >= cfg.min_growth
                if self._latch(st, "coupled:" + k, coupled):
                    self._emit(out, record, step, rank, "coupled:" + k, rk,
                               f"{cfg.reward_key} rising ({rs.values[0]:.3g} -> {r:.3g}) together with {k} "
                               f"({start:.3g} -> {end:.3g} fitted, r={rk:.2f}) over steps {rs.steps[0]}-{step}",
                               "warning")
            if not coupled:
                st.latched.discard("coupled:" + k)
        return out


class ModeCollapseMonitor(_RL):
    """Mode collapse (``monitor="mode_collapse"``).

    Reads ``frac_reward_zero_std`` (fraction of GRPO groups whose completions
    all got the same reward: no advantage, no learning signal): every value of
    the last ``window`` steps >= ``threshold`` (critical). With ``distinct_key``
    (a diversity metric, if the engine logs one): its median of the last 5 below
    ``distinct_frac`` x its early level (warning).

    Known false positives: a task too hard (all rewards 0) or too easy (all 1)
    for the model also makes every group zero-variance - not a collapse of the
    policy but the same outcome (no gradient), and reported the same way; a
    binary reward with a small ``num_generations``. Known misses: collapse to a
    few distinct answers that still get different rewards.
    """

    name = "mode_collapse"

    def __init__(self, cfg: ModeCollapseConfig | None = None) -> None:
        self.cfg = cfg or ModeCollapseConfig()
        super().__init__()

    def _check(self, st: _St, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        cfg = self.cfg
        out: list[Finding] = []
        if step <= cfg.warmup_steps:
            return out
        x = _finite(record, cfg.key)
        if x is not None:
            ser = st.s("z", cfg.window)
            ser.append(step, x)
            full = len(ser) >= cfg.window and min(ser.values) >= cfg.threshold
            if self._latch(st, "zero_std", full):
                self._emit(out, record, step, rank, "zero_std", median(ser.values),
                           f"{cfg.key} >= {cfg.threshold:g} for {cfg.window} steps ({ser.steps[0]}-{step}): "
                           f"every group's completions get the same reward, no learning signal", "critical")
        if cfg.distinct_key:
            d = _finite(record, cfg.distinct_key)
            if d is not None:
                dser = st.s("d", 5)
                dser.append(step, d)
                if st.baseline is None:
                    st.early.append((step, d))
                    if len(st.early) >= cfg.baseline_steps:
                        st.baseline = median([v for _, v in st.early])
                elif st.baseline > 0:
                    cur = median(dser.values)
                    low = cur < cfg.distinct_frac * st.baseline
                    if self._latch(st, "distinct", low):
                        self._emit(out, record, step, rank, "distinct", cur / st.baseline,
                                   f"{cfg.distinct_key} {cur:.4g} is {cur / st.baseline:.0%} of its early level "
                                   f"{st.baseline:.4g}", "warning")
        return out


class StaleRolloutMonitor(_RL):
    """Stale rollouts (``monitor="stale_rollout"``): policy-version lag past a bound.

    Reads the first present of ``keys`` (``policy_lag``, ``policy_version_lag``,
    ``staleness``): how many optimizer steps old the policy that generated the
    step's rollouts was (async/off-policy generation, e.g. a vLLM server that
    syncs weights late). Lag > ``max_lag`` is reported (warning), once per episode.

    Known false positives: an intended off-policy setup with a large buffer
    (raise ``max_lag``). Known misses: engines that log no lag key (TRL's
    synchronous GRPO has none: it generates with the current policy).
    """

    name = "stale_rollout"

    def __init__(self, cfg: StaleRolloutConfig | None = None) -> None:
        self.cfg = cfg or StaleRolloutConfig()
        super().__init__()

    def _check(self, st: _St, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        key, lag = first_number(record, self.cfg.keys)
        if lag is None:
            return []
        out: list[Finding] = []
        stale = lag > self.cfg.max_lag
        if self._latch(st, "lag", stale):
            self._emit(out, record, step, rank, "lag", lag,
                       f"{key} {lag:g} > {self.cfg.max_lag:g}: rollouts come from a policy {lag:g} steps old",
                       "warning")
        return out
