"""RL health for TRL GRPO / DPO style runs: one small monitor per failure mode, reported as
episodes.

The keys are TRL's (``entropy``, ``kl``, ``reward``, ``frac_reward_zero_std``,
``completions/mean_length``, ``clip_ratio/region_mean``); the ptops TRL adapter
writes them sanitised (``completions_mean_length``) and both spellings match.
TRL gathers these across ranks before logging, so every rank carries the same
value; each monitor follows each rank and reports a step once, the ranks whose
values agree sharing one state (``SharedRankedMonitor``; stale_rollout keeps one
per rank: its check costs less than following).
A monitor whose key never appears stays silent (SFT, pre-training).

Why episodes: a condition that holds for 200 steps is one problem, not 200 (or a
dozen re-fired) pages. Each monitor keeps one episode at a time: ``open`` (the
first finding, warning or critical), at most one ``escalate`` (warning ->
critical), and one ``resolved`` all-clear (severity ``info``) once nothing holds
for ``clear_steps`` steps; only then can a new episode open. A run that rewinds
(resume, rollback) starts its redone timeline with no episode open.

Why incremental: ``feed`` runs for every record of every rank, so trends come
from running sums over fixed windows (:class:`_Fit`, :class:`_Tri`), O(1) per
record, no per-record window copies.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

from .base import (
    Finding,
    RankedMonitor,
    finite_floats,
    finite_of,
    first_finite,
    first_number,
    get_number,
    median,
    record_attempt,
    record_ts,
    spelled,
)
from .config import (
    EntropyCollapseConfig,
    KLDriftConfig,
    ModeCollapseConfig,
    RewardHackingConfig,
    StaleRolloutConfig,
)
from .shared import SharedRankedMonitor


def _finite(record: Mapping[str, Any], key: str) -> float | None:
    """The finite number under ``key`` (either spelling), else None (slow path: keys spelled per
    call)."""
    return finite_of(record, spelled(key))


def _spellings(*keys: str | None) -> tuple[str, ...]:
    """Both spellings of each key (TRL's ``a/b`` and the adapter's ``a_b``), for a cheap presence
    test."""
    out: list[str] = []
    for k in keys:
        if k:
            out += [k, k.replace("/", "_")]
    return tuple(dict.fromkeys(out))


def _has(record: Mapping[str, Any], spellings: tuple[str, ...]) -> bool:
    for k in spellings:
        if k in record:
            return True
    return False


class _Fit:
    """Least squares of y on x over the last ``n`` points, by running sums (O(1) per point)."""

    __slots__ = ("n", "q", "sx", "sy", "sxx", "sxy", "syy", "adds")

    def __init__(self, n: int) -> None:
        self.n = n
        self.q: deque[tuple[float, float]] = deque()
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
        self.adds = 0

    def __len__(self) -> int:
        return len(self.q)

    def add(self, x: float, y: float) -> None:
        q = self.q
        sx, sy, sxx, sxy, syy = self.sx, self.sy, self.sxx, self.sxy, self.syy
        if len(q) >= self.n:
            ox, oy = q.popleft()
            sx -= ox
            sy -= oy
            sxx -= ox * ox
            sxy -= ox * oy
            syy -= oy * oy
        q.append((x, y))
        self.sx = sx + x
        self.sy = sy + y
        self.sxx = sxx + x * x
        self.sxy = sxy + x * y
        self.syy = syy + y * y
        self.adds += 1
        if self.adds >= 64 * self.n:  # bound the rounding drift of add/subtract
            self._resum()

    def _resum(self) -> None:
        self.adds = 0
        self.sx = sum(x for x, _ in self.q)
        self.sy = sum(y for _, y in self.q)
        self.sxx = sum(x * x for x, _ in self.q)
        self.sxy = sum(x * y for x, y in self.q)
        self.syy = sum(y * y for _, y in self.q)

    def clear(self) -> None:
        self.q.clear()
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
        self.adds = 0

    def rewind(self, step: float) -> None:
        q = self.q
        if q and q[-1][0] >= step:
            while q and q[-1][0] >= step:
                q.pop()
            self._resum()

    def slope(self) -> float:
        k = len(self.q)
        d = k * self.sxx - self.sx * self.sx
        return 0.0 if k < 2 or d <= 0 else (k * self.sxy - self.sx * self.sy) / d

    def at(self, x: float) -> float:
        """The fitted y at ``x``."""
        k = len(self.q)
        b = self.slope()
        return (self.sy - b * self.sx) / k + b * x

    def tstat(self) -> float:
        """The slope over its standard error (0 with fewer than 3 points or no spread)."""
        k = len(self.q)
        ssxx = k * self.sxx - self.sx * self.sx
        if k < 3 or ssxx <= 0:
            return 0.0
        ssxy = k * self.sxy - self.sx * self.sy
        b = ssxy / ssxx
        sse = max(k * self.syy - self.sy * self.sy - b * ssxy, 0.0)
        se = math.sqrt(sse / (k - 2) / ssxx)
        return b / se if se > 0 else math.copysign(math.inf, b) if b else 0.0

    def corr(self) -> float:
        k = len(self.q)
        vx = k * self.sxx - self.sx * self.sx
        vy = k * self.syy - self.sy * self.sy
        if k < 2 or vx <= 0 or vy <= 1e-18 * max(1.0, k * self.syy):
            return 0.0
        return (k * self.sxy - self.sx * self.sy) / math.sqrt(vx * vy)


class _Tri:
    """Running sums of (x, a, b) over the last ``n`` points: r(x,a), r(x,b), r(a,b), slope of b on
    x."""

    __slots__ = ("n", "q", "x", "a", "b", "xx", "aa", "bb", "xa", "xb", "ab")

    def __init__(self, n: int) -> None:
        self.n = n
        self.q: deque[tuple[float, float, float]] = deque()
        self._zero()

    def _zero(self) -> None:
        self.x = self.a = self.b = self.xx = self.aa = self.bb = self.xa = self.xb = self.ab = 0.0

    def __len__(self) -> int:
        return len(self.q)

    def _sub(self, p: tuple[float, float, float]) -> None:
        x, a, b = p
        self.x -= x
        self.a -= a
        self.b -= b
        self.xx -= x * x
        self.aa -= a * a
        self.bb -= b * b
        self.xa -= x * a
        self.xb -= x * b
        self.ab -= a * b

    def add(self, x: float, a: float, b: float) -> None:
        # one method with locals (no _sub call): this runs several times per record; each sum sees
        # the same operations in the same order as subtract-then-add, so the sums are bit-identical
        q = self.q
        sx, sa, sb, sxx, saa, sbb, sxa, sxb, sab = (
            self.x,
            self.a,
            self.b,
            self.xx,
            self.aa,
            self.bb,
            self.xa,
            self.xb,
            self.ab,
        )
        if len(q) >= self.n:
            ox, oa, ob = q.popleft()
            sx -= ox
            sa -= oa
            sb -= ob
            sxx -= ox * ox
            saa -= oa * oa
            sbb -= ob * ob
            sxa -= ox * oa
            sxb -= ox * ob
            sab -= oa * ob
        q.append((x, a, b))
        self.x = sx + x
        self.a = sa + a
        self.b = sb + b
        self.xx = sxx + x * x
        self.aa = saa + a * a
        self.bb = sbb + b * b
        self.xa = sxa + x * a
        self.xb = sxb + x * b
        self.ab = sab + a * b

    def drop_before(self, x: float) -> None:
        q = self.q
        while q and q[0][0] < x:
            self._sub(q.popleft())

    def rewind(self, step: float) -> None:
        if self.q and self.q[-1][0] >= step:
            while self.q and self.q[-1][0] >= step:
                self.q.pop()
            kept = list(self.q)
            self.q.clear()
            self._zero()
            for p in kept:
                self.add(*p)

    def _r(self, si: float, sj: float, sii: float, sjj: float, sij: float) -> float:
        k = len(self.q)
        vi = k * sii - si * si
        vj = k * sjj - sj * sj
        if k < 2 or vi <= 1e-18 * max(1.0, k * sii) or vj <= 1e-18 * max(1.0, k * sjj):
            return 0.0
        return max(-1.0, min(1.0, (k * sij - si * sj) / math.sqrt(vi * vj)))

    def r_xa(self) -> float:
        return self._r(self.x, self.a, self.xx, self.aa, self.xa)

    def r_xb(self) -> float:
        return self._r(self.x, self.b, self.xx, self.bb, self.xb)

    def r_ab(self) -> float:
        return self._r(self.a, self.b, self.aa, self.bb, self.ab)

    def _t(self, sy: float, syy: float, sxy: float) -> float:
        """t statistic of the slope of a column on x (0 with fewer than 3 points or no spread)."""
        k = len(self.q)
        ssxx = k * self.xx - self.x * self.x
        if k < 3 or ssxx <= 0:
            return 0.0
        ssxy = k * sxy - self.x * sy
        slope = ssxy / ssxx
        sse = max(k * syy - sy * sy - slope * ssxy, 0.0)
        se = math.sqrt(sse / (k - 2) / ssxx)
        return slope / se if se > 0 else 0.0

    def t_xa(self) -> float:
        return self._t(self.a, self.aa, self.xa)

    def t_xb(self) -> float:
        return self._t(self.b, self.bb, self.xb)

    def z(self, col: str, sigma: float) -> float:
        """The slope of column ``col`` ("a" or "b") on x over its standard error for a known noise
        ``sigma``."""
        k = len(self.q)
        ssxx = (k * self.xx - self.x * self.x) / k if k else 0.0
        if k < 2 or ssxx <= 0:
            return 0.0
        sy, sxy = (self.a, self.xa) if col == "a" else (self.b, self.xb)
        slope = (k * sxy - self.x * sy) / (k * ssxx)
        if sigma <= 0:
            return math.copysign(math.inf, slope) if slope else 0.0
        return slope / (sigma / math.sqrt(ssxx))

    def b_line(self) -> tuple[float, float]:
        """(fitted b at the first x, fitted b at the last x)."""
        k = len(self.q)
        d = k * self.xx - self.x * self.x
        slope = 0.0 if d <= 0 else (k * self.xb - self.x * self.b) / d
        a = (self.b - slope * self.x) / k
        return a + slope * self.q[0][0], a + slope * self.q[-1][0]


def _bent_fit(
    pts: list, tau: float, col: int, bent: bool = True
) -> tuple[float, float, float, float]:
    """Least squares of column ``col`` of ``pts`` (step, reward, held-out) on two regressors and an
    intercept: min(step, tau) (``bent``; else the step) and (step - tau)+. Returns (the second
    coefficient: the slope after tau if ``bent``, else the change of slope at tau; the first; the
    second's variance factor; the residual sum of squares), zeros where the design is singular. A
    bent line is continuous at tau. O(len(pts)): called on at most ``_BEND_VALUES`` pairs."""
    k = len(pts)
    sm = su = sy = 0.0
    for p in pts:
        t = p[0]
        sm += tau if bent and t > tau else t
        su += t - tau if t > tau else 0.0
        sy += p[col]
    mm, mu, my = sm / k, su / k, sy / k
    smm = suu = smu = smy = suy = syy = 0.0
    for p in pts:
        t = p[0]
        m = (tau if bent and t > tau else t) - mm
        u = (t - tau if t > tau else 0.0) - mu
        y = p[col] - my
        smm += m * m
        suu += u * u
        smu += m * u
        smy += m * y
        suy += u * y
        syy += y * y
    det = smm * suu - smu * smu
    if det <= 1e-12 * max(1.0, smm * suu):
        return 0.0, 0.0, 0.0, 0.0
    d = (smm * suy - smu * smy) / det
    b = (suu * smy - smu * suy) / det
    return d, b, smm / det, max(syy - b * smy - d * suy, 0.0)


_BEND_VALUES = 16  # the bend rule judges at most this many held-out values (a sparse score)


def _t_tail(t: float, dof: int) -> float:
    """P(T > t) for Student's t with an integer ``dof`` >= 1 (Abramowitz & Stegun 26.7.3-4: a
    finite sum, exact)."""
    th = math.atan(t / math.sqrt(dof))
    c2, sn = math.cos(th) ** 2, math.sin(th)
    if dof % 2:
        term, acc = 1.0, 1.0 if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        a = 2 / math.pi * (th + sn * math.cos(th) * acc)
    else:
        term, acc = 1.0, 1.0
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = sn * acc
    return (1 - a) / 2


_TQ: dict[tuple[float, int], float] = {}  # (z, dof) -> _t_bar: a pure function, computed once


def _t_bar(z: float, dof: int) -> float:
    """The t with the one-sided tail of ``z`` standard errors under a normal, for ``dof`` degrees
    of freedom: the bar for an estimate whose noise comes from few values. Why exact: the first
    term of its expansion, ``z (1 + (z^2+1) / 4 dof)``, is 4.9 where the quantile is 6.6 at 3
    standard errors and 4 degrees of freedom, and the bend rule judged at 4-6 (bench/README.md:
    2 false alarms in 100 healthy sparse runs)."""
    if (z, dof) in _TQ:
        return _TQ[(z, dof)]
    p = 0.5 * math.erfc(z / math.sqrt(2))
    lo, hi = z, 2 * z
    while _t_tail(hi, dof) > p:  # bracket it (at 1 degree of freedom and 4 standard errors: ~1e4)
        lo, hi = hi, 2 * hi
    for _ in range(80):  # bisection: the tail falls as t rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_tail(mid, dof) > p else (lo, mid)
    _TQ[(z, dof)] = hi
    return hi


def _bend(pts: list, acc_t: float) -> tuple[float, float, float, float, float]:
    """Where the reward starts climbing faster, and what the held-out score does after it.

    The reward's bend: the pair step tau (at least two pairs up to it, one after it) where a line
    with one change of slope at tau fits the paired reward means best, the slope rising there by at
    least ``acc_t`` standard errors (else zeros). Returns (tau, that t, the held-out score's slope
    after tau on a line bent at tau, its variance factor, the residual sum of squares of that
    line)."""
    best, tau, acc, at = math.inf, 0.0, 0.0, 0
    k = len(pts)
    for j in range(1, k - 1):
        t = pts[j][0]
        g, _, vf, sse = _bent_fit(pts, t, 1, bent=False)
        if g > 0 and sse < best:
            best, tau, at = sse, t, j
            acc = g / math.sqrt(sse / (k - 3) * vf) if sse > 0 and vf > 0 else math.inf
    if not at or acc < acc_t:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    slope, _, vf, sse = _bent_fit(pts, tau, 2)
    return tau, acc, slope, vf, sse


def _d2_dof(n: int) -> float:
    """The degrees of freedom that ``n`` squared second differences of independent noise are worth
    (Satterthwaite: 2 E[S]^2 / Var[S] for their sum S): neighbours share values (correlations -2/3
    at lag 1, 1/6 at lag 2), so ``36 n^2 / (70 n - 36)``, about n / 2 - not n. Counted as n, a noise
    estimate from few of them looks surer than it is, and a t bar for it is too low."""
    return 36.0 * n * n / (70.0 * n - 36.0) if n > 0 else 0.0


def _bend_noise(sse: float, k: int, before: tuple[float, int]) -> tuple[float, int]:
    """(variance, integer degrees of freedom) of the held-out noise for the bend rule: the bent
    line's residuals over its ``k`` values (``sse``, k - 3 degrees of freedom: exact for that
    model), pooled with the second differences wholly before them (``before``: sum of squares,
    count; ``_d2_dof`` degrees of freedom, so weighted by that over 6 x count), and nothing else -
    the window's own second differences would count its values twice. The degrees of freedom are
    rounded down (a higher bar)."""
    sb, nb = before
    db = _d2_dof(nb)
    dof = k - 3 + db
    return (sse + (sb * db / (6 * nb) if nb else 0.0)) / dof, int(dof)


class _Noise:
    """A series' noise from its second differences: a steady trend cancels out (E[d2^2] = 6 sigma^2
    for independent noise), so a score that rises or falls does not look noisy; one kink adds one
    term. The last ``_BEND_VALUES`` squared differences are kept with the step of their last value
    (``before``: those wholly before a window, independent of a fit over it)."""

    __slots__ = ("prev", "ss", "n", "recent")

    def __init__(self) -> None:
        self.prev: tuple[float, ...] = ()
        self.ss = 0.0
        self.n = 0
        self.recent: deque[tuple[float, float]] = deque(maxlen=_BEND_VALUES)

    def add(self, v: float, step: float = 0.0) -> None:
        if len(self.prev) == 2:
            d2 = v - 2 * self.prev[1] + self.prev[0]
            self.ss += d2 * d2
            self.n += 1
            self.recent.append((step, d2 * d2))
        self.prev = (self.prev[-1], v) if self.prev else (v,)

    def rewind(self, step: float, prev: tuple[float, ...]) -> None:
        """The run rewound to ``step``: the differences after it stay in the sums (the same score,
        other evaluations: independent noise) but no longer overlap a window of the redone
        values."""
        while self.recent and self.recent[-1][0] >= step:
            self.recent.pop()
        self.prev = prev

    def before(self, step: float) -> tuple[float, int]:
        """(sum of squares, count) of the second differences whose three values all come before
        ``step``: at most ``_BEND_VALUES`` values from the end, so within a bend window's reach."""
        ss, n = self.ss, self.n
        for s, q in reversed(self.recent):
            if s < step:
                break
            ss -= q
            n -= 1
        return max(ss, 0.0), n

    def sigma(self) -> float:
        return math.sqrt(self.ss / self.n / 6) if self.n else math.inf


class _Episode:
    """One episode at a time: open -> (escalate) -> resolved after ``clear`` quiet steps."""

    __slots__ = ("n", "level", "quiet")

    def __init__(self) -> None:
        self.n = 0  # episodes opened so far (the next one's number is n + 1)
        self.level = 0  # 0 none open, 1 warning, 2 critical
        self.quiet = 0

    def update(self, level: int, quiet: bool, clear: int) -> str | None:
        """The phase this step starts (``open`` / ``escalate`` / ``resolved``), or None."""
        if level > self.level:
            phase = "open" if self.level == 0 else "escalate"
            if self.level == 0:
                self.n += 1
            self.level = level
            self.quiet = 0
            return phase
        if self.level and quiet:
            self.quiet += 1
            if self.quiet >= clear:
                self.level = 0
                self.quiet = 0
                return "resolved"
        else:
            self.quiet = 0
        return None

    def forget(self) -> None:
        """The run rewound: the redone timeline starts with no episode open (numbering goes on)."""
        self.level = 0
        self.quiet = 0


class _St:
    """Per-rank state: an episode plus whatever the monitor keeps (set in its ``_new_state``)."""

    def __init__(self) -> None:
        self.ep = _Episode()


_SEVERITY = {1: "warning", 2: "critical"}


class _RL(RankedMonitor):
    """Base of the RL monitors: per-rank state, episodes, and which records may rewind the state."""

    keys: tuple[str, ...] = ()  # a record carrying none of these is not this monitor's
    _own: tuple[str, ...] = ()

    # ``_gate`` and ``_rewind_keys``: ``_own`` (set in each monitor's __init__). A record with none
    # of the monitor's keys (pre-training, SFT, an eval) changes nothing: no rewind (``_rewinds``
    # needs one of them), no value to read; one C-level test instead of a feed.

    def _new_state(self) -> _St:
        return _St()

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()

    # each RL monitor's ``_rewinds``: only a record with its own training key rewinds (an eval
    # record logged before, after or between training steps never does)

    def _report(
        self,
        out: list[Finding],
        st: _St,
        record: Mapping[str, Any],
        step: int,
        rank: int,
        phase: str,
        level: int,
        value: float | None,
        detail: str,
        cleared: str,
    ) -> None:
        """Report the step's episode transition (``st.ep.update`` said which), once across ranks.
        The monitors build their texts only when there is a transition: no string work on a quiet
        step."""
        if self._silent:
            return
        key = (step, f"{phase}#{st.ep.n}")
        tried = self._tried
        if tried is None and key in self._fired:
            return
        if phase == "resolved":
            severity, text = "info", f"all clear (episode {st.ep.n}): {cleared}"
        else:
            severity = _SEVERITY[level]
            text = detail if phase == "open" else f"escalated (episode {st.ep.n}): {detail}"
        if tried is not None:  # a shared state's transition: the ranks that follow it replay this
            tried.append((key, step, value, text, severity, st.ep.n, phase))
            if key in self._fired:
                return
        self._fired[key] = rank
        out.append(
            Finding(
                self.name,
                step,
                value,
                text,
                severity,
                rank,
                record_attempt(record),
                record_ts(record),
                episode=st.ep.n,
                phase=phase,
            )
        )


class _SharedRL(_RL, SharedRankedMonitor):
    """An RL monitor whose ranks share one state while their inputs agree (TRL logs gathered
    values)."""


_NO_VALUE = (None,)


def _median_small(q: deque) -> float:
    """Median of a few (step, value) pairs (the smoothing window: a handful of values)."""
    vals = sorted([p[1] for p in q])
    n = len(vals)
    mid = n // 2
    return vals[mid] if n % 2 else 0.5 * (vals[mid - 1] + vals[mid])


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


class RewardHackingMonitor(_SharedRL):
    """Reward hacking (``monitor="reward_hacking"``).

    Reads ``reward``, a held-out score (``verifier_key``, else the first of
    ``heldout_keys`` such as ``eval/accuracy``; dense or logged only every N steps,
    on the step's record or on an eval record of its own) and ``coupled_keys``
    (``completions/mean_length``, ``clip_ratio/region_mean``).

    - Held-out rules, judged at each held-out value (and carried until the next):
      every held-out value is paired with the mean training reward since the
      previous one; over the last pairs within ``window`` steps (at least
      ``min_points`` pairs, spanning more steps when the score is sparse) the
      reward climbs (Pearson r against the step >= ``trend_corr``, and its slope over
      the last ``window`` steps >= ``rise_t`` standard errors) while the held-out slope
      is <= -``fall_z`` standard errors (hacking, critical; over that span or twice it).
      The held-out noise comes from its second differences (``_Noise``: a steady trend
      cancels), so 3 sparse values can already be confident; the bar is raised to the
      t quantile while that estimate rests on few differences. Or the held-out score
      does not follow (r <= ``flat_corr`` with the reward's r >= ``diverge_corr``, on
      at least 2 x ``min_points`` values: divergence, warning).
    - Bend rule (a sparse held-out score: at most 16 values over four spans): the step
      where the paired reward means start climbing faster (a line with one change of slope
      fits them best there, the change >= ``bend_t`` standard errors) and, on a held-out line
      bent at that step (continuous: the values before it pin where the fall starts), the
      slope after it <= -``bend_z`` standard errors (critical, no confirmation). A healthy run
      whose held-out score rises with the reward has a rising slope after the bend; the
      values before the bend make 1-2 sparse values after it enough.
    - Coupling (every step): the reward trends up and a coupled key trends up with
      it (r(reward, key) >= ``coupling_corr``, fitted rise >= ``min_growth``) - warning.

    A rule must hold for ``confirm`` evaluations in a row, waiting at most ``confirm_steps``
    steps for them (a sparse score's next value is far away); one episode opens,
    escalates once, and ends with an all-clear after ``clear_steps`` quiet steps.

    Known false positives: coupling fires on healthy reasoning RL where longer
    answers are the point (lengths grow with reward by design) - keep it an alert,
    or drop ``completions/mean_length`` from ``coupled_keys``; a held-out score on a
    tiny eval set is noisy (raise ``min_points``). Known misses: hacking without a
    held-out score and without length/clip coupling.
    """

    name = "reward_hacking"

    def __init__(self, cfg: RewardHackingConfig | None = None) -> None:
        self.cfg = cfg or RewardHackingConfig()
        keys = [k for k in (self.cfg.verifier_key, *self.cfg.heldout_keys) if k]
        self._heldout = tuple(dict.fromkeys(keys))
        # held-out evals (``[eval]`` records) outrank the in-training verifier proxy
        self._proxy = (self.cfg.verifier_key,) if self.cfg.verifier_key else ()
        self._evals = tuple(k for k in self._heldout if k not in self._proxy)
        self._prefix = self.cfg.heldout_prefix
        self._plain: set = (
            set()
        )  # record keys seen that are no held-out eval (neither prefixed nor listed)
        self._eval_spellings = frozenset(_spellings(*self._evals))
        self._own = _spellings(self.cfg.reward_key)
        self._reward = spelled(self.cfg.reward_key)
        self._coupled = tuple((k, spelled(k)) for k in self.cfg.coupled_keys)
        self._coupled_sp = tuple(sp for _, sp in self._coupled)
        self._quick = _spellings(self.cfg.reward_key, *self._proxy)
        self._proxy_sp = spelled(self._proxy[0]) if self._proxy else None
        self._rewind_keys = self._own
        self._noop = (None,) * 5
        super().__init__()

    def _new_state(self) -> _St:
        st = _St()
        w = self.cfg.window
        st.rfit = _Fit(w)
        st.coupled = {k: _Tri(w) for k in self.cfg.coupled_keys}
        st.cconf = {k: 0 for k in self.cfg.coupled_keys}
        st.pairs = _Tri(max(w, self.cfg.min_points))
        st.lpairs = _Tri(2 * max(w, self.cfg.min_points))  # twice the span, for a slower fall
        # four spans, for the bend rule (a sparse score: at most _BEND_VALUES values)
        st.xpairs = _Tri(4 * max(w, self.cfg.min_points))
        st.racc = 0.0
        st.rn = 0
        st.last_r = None
        st.h_last = None  # step of the last held-out value
        st.h_step = 0  # spacing of the held-out values
        st.noise_h = _Noise()  # of the held-out values
        st.h_min = 0  # the closest spacing of held-out values seen
        st.h_key = None
        st.h_level = 0  # carried between held-out values
        st.h_conf = 0
        st.h_conf2 = 0
        st.h_quiet = True
        st.h_detail = ""
        st.h_value = None
        st.h_src = (
            None  # "proxy" (verifier_key) or "eval" (a held-out eval; once seen, the only source)
        )
        return st

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()
        st.rfit.rewind(step)
        for t in st.coupled.values():
            t.rewind(step)
        st.cconf = {k: 0 for k in st.cconf}
        st.pairs.rewind(step)
        st.lpairs.rewind(step)
        st.xpairs.rewind(step)
        st.racc, st.rn = 0.0, 0
        st.h_last = st.pairs.q[-1][0] if st.pairs.q else None
        st.noise_h.rewind(step, tuple(p[2] for p in list(st.pairs.q)[-2:]))
        st.h_level = st.h_conf = st.h_conf2 = 0
        st.h_quiet = True

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        # no reward, no proxy, and only keys known to be no held-out eval: nothing to do (see
        # _RL.feed)
        if keys <= self._plain and keys.isdisjoint(self._quick):
            self._led = None
            return []
        return SharedRankedMonitor.feed_at(self, record, keys, step, rank)

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        """(reward, eval key, eval score, proxy key, proxy score, coupled values...): all ``_apply``
        reads. The eval score is a held-out eval (``heldout_keys``, else the record's first
        ``heldout_prefix`` key); the proxy is read only without one."""
        r = finite_of(record, self._reward)
        ek = ev = pk = pv = None
        if (
            not record.keys() <= self._plain
        ):  # a key not known to be plain: maybe an eval (one C set test)
            ek, ev = first_number(record, self._evals)
            if ev is None and self._prefix:
                ek, ev = self._prefixed(record)
        if (
            ev is None and self._proxy
        ):  # first_number over the one proxy key, its spellings computed once
            pv = finite_of(record, self._proxy_sp)
            if pv is not None:
                pk = self._proxy[0]
        if r is None:
            return (r, ek, ev, pk, pv)
        return (r, ek, ev, pk, pv) + finite_floats(record, self._coupled_sp)

    def _heldout_value(self, st: _St, inputs: tuple) -> tuple[str | None, float | None]:
        """The held-out eval score when the record has one, else the verifier proxy - until a rank's
        first eval, which switches that rank to evals for good (the proxy's pairs are dropped: a
        different score on a different scale)."""
        v = inputs[2]
        if v is not None:
            if st.h_src != "eval":
                if st.h_src == "proxy":
                    self._forget_heldout(st)
                st.h_src = "eval"
            return inputs[1], v
        if st.h_src == "eval" or not self._proxy:
            return None, None
        k, v = inputs[3], inputs[4]
        if v is not None:
            st.h_src = "proxy"
        return k, v

    def _prefixed(self, record: Mapping[str, Any]) -> tuple[str | None, float | None]:
        """The record's first ``heldout_prefix`` key with a finite value. Keys found to be neither
        an eval spelling nor prefixed join ``_plain``, so a record without an eval is ruled out by
        one subset test in C (``_heldout_value``), not a Python loop over its keys."""
        plain, prefix, evals = self._plain, self._prefix, self._eval_spellings
        found: tuple[str | None, float | None] = (None, None)
        for key in record:
            if key in plain:
                continue
            if isinstance(key, str) and prefix and key.startswith(prefix):
                if found[1] is None:
                    v = get_number(record, key)
                    if v is not None and math.isfinite(v):
                        found = (key, v)
            elif (
                key not in evals and len(plain) < 4096
            ):  # bounded: record keys are a small vocabulary
                plain.add(key)
        return found

    def heldout_source(self, rank: int = 0) -> tuple[str | None, str | None]:
        """("eval" | "proxy" | None, the key last read) for a rank: what the held-out rules compare
        against."""
        st = self._state_of(rank)
        return (st.h_src, st.h_key) if st is not None else (None, None)

    def _forget_heldout(self, st: _St) -> None:
        w = max(self.cfg.window, self.cfg.min_points)
        st.pairs, st.lpairs, st.xpairs = _Tri(w), _Tri(2 * w), _Tri(4 * w)
        st.h_last, st.h_step, st.h_key = None, 0, None
        st.noise_h, st.h_min = _Noise(), 0
        st.h_level = st.h_conf = st.h_conf2 = 0
        st.h_quiet, st.h_detail, st.h_value = True, "", None

    def _judge_heldout(self, st: _St, step: int) -> None:
        cfg = self.cfg
        p = st.pairs
        span = max(cfg.window, cfg.min_points * st.h_step)
        p.drop_before(step - span + 1)
        lp = st.lpairs
        lp.drop_before(step - 2 * span + 1)
        xp = st.xpairs
        xp.drop_before(step - 4 * span + 1)
        level = 0
        bend, bend_text = False, ""
        st.h_quiet = True
        if step > cfg.warmup_steps and len(p.q) >= cfg.min_points:
            rc, vc = p.r_xa(), p.r_xb()
            # the all-clear needs signs of health (the reward stopped climbing, or the held-out
            # score follows it), not only a noisy stretch where the evidence fell short of a finding
            st.h_quiet = rc < 0.5 * cfg.trend_corr or vc > 0
            # the reward up and the held-out score down by so many standard errors, each series'
            # noise from its second differences (``_Noise``): a few sparse values still give a
            # confident slope where their own residuals (1-2 degrees of freedom) would not. The
            # noise estimate from n differences is itself noisy: the held-out bar is the t quantile
            # for n degrees of freedom (its Cornish-Fisher approximation), not the normal one
            n = st.noise_h.n
            z = zl = 0.0
            if n >= cfg.noise_values:
                fall = cfg.fall_z * (1 + (cfg.fall_z**2 + 1) / (4 * n))
                sh = st.noise_h.sigma()
                z, zl = p.z("b", sh), lp.z("b", sh)
                climbs = (
                    st.rfit.tstat() >= cfg.rise_t
                )  # the reward climbs now, not only across the span
                if climbs and rc >= cfg.trend_corr and vc <= -cfg.trend_corr and z <= -fall:
                    level = 2
                elif (
                    climbs
                    and len(lp.q) >= 2 * cfg.min_points
                    and lp.r_xa() >= cfg.trend_corr
                    and zl <= -fall
                ):
                    level = 2  # a slower fall: twice the span
                # the bend rule (a sparse score): the reward starts climbing faster at some step
                # (its bend, from the paired reward means: precise) and the held-out score falls
                # after it, on a line bent there - continuous, so the values before the bend pin
                # where the fall starts from, and 2 values after it can be enough. Its noise: that
                # line's residuals pooled with the second differences before its values, each
                # counted for the degrees of freedom it has (``_bend_noise``)
                k = len(xp.q)
                if (
                    cfg.bend_z
                    and 5 <= k <= _BEND_VALUES
                    and xp.r_xa() >= cfg.trend_corr
                    and (climbs or lp.t_xa() >= cfg.rise_t)
                ):
                    tau, acc, slope, vf, sse = _bend(list(xp.q), cfg.bend_t)
                    if slope < 0 and vf > 0:
                        var, dof = _bend_noise(sse, k, st.noise_h.before(xp.q[0][0]))
                        sig = math.sqrt(var)
                        zb = slope / (sig * math.sqrt(vf)) if sig > 0 else -math.inf
                        if zb <= -_t_bar(cfg.bend_z, dof):
                            bend = True
                            if not level:
                                level, z = 2, zb
                                bend_text = (
                                    f"{cfg.reward_key} climbs faster from step {int(tau)} on "
                                    f"({acc:.1f} standard errors) while held-out {st.h_key} falls "
                                    f"after it ({slope:.2g} a step, {zb:.1f} standard errors)"
                                )
            if (
                not level
                and rc >= cfg.diverge_corr
                and vc <= cfg.flat_corr
                and len(p.q) >= 2 * cfg.min_points
            ):
                level = 1  # held-out flat: weaker evidence than a fall, twice the values
            if level and bend_text:
                first = xp.q[0]
                st.h_detail = (
                    f"{bend_text} over steps {int(first[0])}-{step} ({k} held-out values"
                    + (f", one every {st.h_step} steps)" if st.h_step > 1 else ")")
                )
                st.h_value = vc
            elif level:
                first, last = p.q[0], p.q[-1]
                how = "falls" if level == 2 else "does not follow"
                st.h_detail = (
                    f"{cfg.reward_key} rising ({first[1]:.3g} -> {last[1]:.3g}, r={rc:.2f}) "
                    "while held-out "
                    f"{st.h_key} {how} ({first[2]:.3g} -> {last[2]:.3g}, r={vc:.2f}, slope "
                    f"{min(z, zl):.1f} standard errors) over steps {int(first[0])}-{step} "
                    f"({len(p)} "
                    "held-out values"
                    + (f", one every {st.h_step} steps)" if st.h_step > 1 else ")")
                )
                st.h_value = vc
        st.h_conf = (
            st.h_conf + 1 if level >= 1 else 0
        )  # consecutive evaluations at warning or worse
        st.h_conf2 = st.h_conf2 + 1 if level >= 2 else 0  # ... at critical
        # confirmation costs at most ``confirm_steps`` steps: a sparse score's next value is far
        # away (the closest spacing seen: a gap in a dense score, a lost record or a rewind, does
        # not make it sparse)
        need = max(1, min(cfg.confirm, 1 + cfg.confirm_steps // max(1, st.h_min)))
        if bend:
            need = 1  # the bend rule's evidence accumulates over the values after the bend
        st.h_level = 2 if st.h_conf2 >= need else 1 if st.h_conf >= need + 1 else 0

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        cfg = self.cfg
        r = inputs[0]
        hk, hv = self._heldout_value(st, inputs)
        if r is None and hv is None:
            return []
        if r is not None:
            st.rfit.add(step, r)
            st.racc += r
            st.rn += 1
            st.last_r = r
        if hv is not None and (st.rn or st.last_r is not None):
            if st.h_last is not None and step > st.h_last:
                st.h_step = step - st.h_last
                st.h_min = min(st.h_min, st.h_step) if st.h_min else st.h_step
            if st.h_last is None or step > st.h_last:
                rm = st.racc / st.rn if st.rn else st.last_r
                st.pairs.add(step, rm, hv)
                st.noise_h.add(hv, step)
                st.lpairs.add(step, rm, hv)
                if not st.h_min or st.h_min * _BEND_VALUES >= 4 * cfg.window:
                    st.xpairs.add(step, rm, hv)  # a sparse score only (a dense one: no cost)
                st.racc, st.rn = 0.0, 0
                st.h_last = step
                st.h_key = hk
                self._judge_heldout(st, step)
        if r is None:
            return []
        level = st.h_level
        value, detail = st.h_value, st.h_detail
        rising = (
            step > cfg.warmup_steps
            and len(st.rfit.q) >= cfg.window
            and st.rfit.corr() >= cfg.trend_corr
        )
        coupled_of = st.coupled
        for i, (k, sp) in enumerate(self._coupled, 5):
            t = coupled_of[k]
            y = inputs[i]
            if y is not None:
                t.add(step, r, y)
            coupled = False
            if rising and y is not None and len(t.q) >= cfg.window:
                start, end = t.b_line()
                growth = (
                    (end - start) / abs(start)
                    if abs(start) > 1e-9
                    else (math.inf if end > start else 0.0)
                )
                rk = t.r_ab()
                coupled = (
                    t.r_xb() >= cfg.trend_corr
                    and rk >= cfg.coupling_corr
                    and growth >= cfg.min_growth
                )
            st.cconf[k] = st.cconf[k] + 1 if coupled else 0
            if st.cconf[k] >= cfg.confirm and level < 1:
                level, value = 1, t.r_ab()
                detail = (
                    f"{cfg.reward_key} rising ({t.q[0][1]:.3g} -> {r:.3g}) together with {k} "
                    f"({start:.3g} -> {end:.3g} fitted, r={value:.2f}) over steps "
                    f"{int(t.q[0][0])}-{step}"
                )
        out: list[Finding] = []
        phase = st.ep.update(level, level == 0 and st.h_quiet, cfg.clear_steps)
        if phase is not None:
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
                f"{cfg.reward_key} and the held-out score agree again, no coupled rise, for "
                f"{cfg.clear_steps} steps",
            )
        return out


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


class StaleRolloutMonitor(_SharedRL):
    """Stale rollouts (``monitor="stale_rollout"``): policy-version lag past a bound.

    Reads the first present of ``keys`` (``policy_lag``, ``policy_version_lag``,
    ``staleness``): how many optimizer steps old the policy that generated the
    step's rollouts was (async/off-policy generation, e.g. a vLLM server that
    syncs weights late). Lag > ``max_lag`` is reported (warning), once per episode;
    the all-clear comes after ``clear_steps`` steps within the bound.

    Known false positives: an intended off-policy setup with a large buffer
    (raise ``max_lag``). Known misses: engines that log no lag key (TRL's
    synchronous GRPO has none: it generates with the current policy).
    """

    name = "stale_rollout"

    def __init__(self, cfg: StaleRolloutConfig | None = None) -> None:
        self.cfg = cfg or StaleRolloutConfig()
        self._own = _spellings(*self.cfg.keys)
        self._keys = tuple(spelled(k) for k in self.cfg.keys)
        self._sp0 = self._keys[0] if self._keys else (None, None)
        self._gate = self._rewind_keys = self._own
        self._noop = (None, None)
        super().__init__()

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        """(key, lag): the first of ``keys`` holding a finite number, or (None, None)."""
        sp = self._sp0
        v = record.get(sp[0])
        t = type(v)
        if t is float and v - v == 0.0:  # first_finite's common case: the first key holds a number
            return sp[0], v
        if t is int:
            return sp[0], float(v)
        return first_finite(record, self._keys)

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        key, lag = inputs
        if lag is None:
            return []
        stale = lag > self.cfg.max_lag
        if not stale and not st.ep.level:
            # within the bound, no episode open: update() would change nothing (quiet is 0 then)
            return []
        out: list[Finding] = []
        phase = st.ep.update(1 if stale else 0, not stale, self.cfg.clear_steps)
        if phase is not None:
            self._report(
                out,
                st,
                record,
                step,
                rank,
                phase,
                1 if stale else 0,
                lag,
                f"{key} {lag:g} > {self.cfg.max_lag:g}: rollouts come from a policy {lag:g} "
                "steps old",
                f"{key} {lag:g} within {self.cfg.max_lag:g} for {self.cfg.clear_steps} steps",
            )
        return out
