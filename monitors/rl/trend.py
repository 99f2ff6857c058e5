"""The RL monitors' statistics, O(1) a record: running least-squares fits over fixed windows
(:class:`_Fit`, :class:`_Tri`), the t quantiles that bound a trend's noise, and the bend rule that
tells a plateau from a turn in a sparse held-out score."""

from __future__ import annotations

import math
from collections import deque


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
_TURN_VALUES = 48  # the turn rule fits at most this many held-out values
_NOISE_KEEP = 64  # squared second differences kept with their steps (> _TURN_VALUES: see before())


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
        self.recent: deque[tuple[float, float]] = deque(maxlen=_NOISE_KEEP)

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
        ``step``: at most ``_NOISE_KEEP`` values from the end, so within a window's reach."""
        ss, n = self.ss, self.n
        for s, q in reversed(self.recent):
            if s < step:
                break
            ss -= q
            n -= 1
        return max(ss, 0.0), n

    def sigma(self) -> float:
        return math.sqrt(self.ss / self.n / 6) if self.n else math.inf


def _reward_bend(xs: list, ys: list, min_before: int = 10, min_after: int = 3) -> tuple:
    """Where a dense series starts climbing faster: the step tau at which a continuous line with one
    change of slope fits ``ys`` (at steps ``xs``) best, at least ``min_before`` points before it and
    ``min_after`` after. Returns (tau, the change of slope over its standard error, the change), or
    None. O(len(xs)): prefix sums, then each candidate's 3 x 3 normal equations from its suffix
    sums; called only when a held-out value is judged."""
    n = len(xs)
    if n < min_before + min_after + 2:
        return None
    p0, p1, p2, py, pxy = [0.0], [0.0], [0.0], [0.0], [0.0]
    syy = 0.0
    for x, y in zip(xs, ys):
        p0.append(p0[-1] + 1.0)
        p1.append(p1[-1] + x)
        p2.append(p2[-1] + x * x)
        py.append(py[-1] + y)
        pxy.append(pxy[-1] + x * y)
        syy += y * y
    N, X, XX, Y, XY = p0[-1], p1[-1], p2[-1], py[-1], pxy[-1]
    cxx, cxy, cyy = XX - X * X / N, XY - X * Y / N, syy - Y * Y / N
    best = None
    for j in range(min_before - 1, n - min_after - 1):
        tau = xs[j]
        s0, s1, s2 = N - p0[j + 1], X - p1[j + 1], XX - p2[j + 1]
        sy, sxy = Y - py[j + 1], XY - pxy[j + 1]
        su = s1 - tau * s0  # sums over the points after tau of u = x - tau
        cuu = s2 - 2 * tau * s1 + tau * tau * s0 - su * su / N
        cxu = s2 - tau * s1 - X * su / N
        cuy = sxy - tau * sy - su * Y / N
        det = cxx * cuu - cxu * cxu
        if det <= 1e-12 * max(1.0, cxx * cuu):
            continue
        g = (cxx * cuy - cxu * cxy) / det
        sse = cyy - ((cuu * cxy - cxu * cuy) / det) * cxy - g * cuy
        if best is None or sse < best[0]:
            best = (sse, tau, g, cxx / det)
    if best is None:
        return None
    sse, tau, g, vf = best
    s2e = max(sse, 0.0) / (n - 3)
    t = g / math.sqrt(s2e * vf) if s2e > 0 and vf > 0 else math.copysign(math.inf, g)
    return tau, t, g


class _Turn:
    """The turn rule's memory: the dense training reward over the last ``steps`` steps and the
    last ``values`` held-out values. ``judge`` finds the step where the reward starts climbing
    faster (its bend, from every reward value: precise) and fits the held-out values on a line bent
    there (continuous: the values before the bend pin where the score was heading)."""

    __slots__ = ("steps", "r", "h")

    def __init__(self, steps: int = 200, values: int = _TURN_VALUES) -> None:
        self.steps = steps
        self.r: deque[tuple[float, float]] = deque()
        self.h: deque[tuple[float, float, float]] = deque(maxlen=values)

    def add_reward(self, step: float, v: float) -> None:
        r = self.r
        r.append((step, v))
        while r[0][0] <= step - self.steps:
            r.popleft()

    def add_held(self, step: float, v: float) -> None:
        self.h.append((step, 0.0, v))  # _bent_fit's (step, reward, held-out) layout

    def rewind(self, step: float) -> None:
        for q in (self.r, self.h):
            while q and q[-1][0] >= step:
                q.pop()

    def judge(self, bend_t: float, pre_min: int = 2) -> tuple | None:
        """(tau, the reward's change of slope there in standard errors, the held-out slope after
        tau, its variance factor, the bent line's residual sum of squares, held-out values) when
        the reward bends up by ``bend_t`` standard errors with at least ``pre_min`` held-out values
        up to the bend and one after it; else None."""
        h = self.h
        if len(h) < pre_min + 3 or len(self.r) < 16:
            return None
        rb = _reward_bend([p[0] for p in self.r], [p[1] for p in self.r])
        if rb is None or rb[1] < bend_t:
            return None
        tau, acc, _ = rb
        pts = list(h)
        pre = sum(1 for p in pts if p[0] <= tau)
        if pre < pre_min or pre == len(pts):
            return None
        slope, _, vf, sse = _bent_fit(pts, tau, 2)
        if vf <= 0:
            return None
        return tau, acc, slope, vf, sse, len(pts)
