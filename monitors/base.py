"""The monitor contract: a stream of metric records in, findings out.

Everything under ``ptops.monitors`` is pure: no ptops imports, no torch, no I/O,
no wall clock. Time comes from the records themselves (``step``, and ``ts`` when
the writer stamped one), so the same monitor objects run live in the supervisor
and offline over a run's ``metrics.jsonl``, and a recorded run replays exactly.

A *record* is one line of ``metrics.jsonl``: a dict with at least ``step`` and
``rank`` (``attempt``, ``ts`` and the metric keys are optional). Non-finite
floats arrive as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (the probe's JSON
encoding) or as float NaN/Inf (a live feed that never went through JSON); TRL
logs ``None`` for a key whose values were all NaN. :func:`number` reads all of
them.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_left, insort
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

Severity = str  # "info" | "warning" | "critical"
# Where a finding stands in its episode (RL monitors report episodes, not repeats):
# ``open`` (the first finding: warning or critical), ``escalate`` (warning -> critical),
# ``resolved`` (the all-clear: severity ``info``; nothing to act on).
PHASES = ("open", "escalate", "resolved")


@dataclass(frozen=True)
class Finding:
    """One thing a monitor saw.

    ``step`` is the optimizer step of the record that completed the evidence;
    ``rank`` is set when the finding is about one rank (straggler, a rank-local
    NaN) and is the reporting rank otherwise; ``value`` is the score the
    threshold was compared against (a ratio, a z-score, the offending value;
    ``None`` for NaN); ``ts`` is copied from that record when it had one.

    ``episode`` / ``phase`` (monitors that report episodes): the episode's number
    in the monitor's stream and where the finding stands in it (:data:`PHASES`).
    A ``resolved`` finding is an all-clear: severity ``info``, the policy never
    acts on it and alerting does not fire on it. ``None`` for one-shot monitors.
    """

    monitor: str
    step: int
    value: float | None
    detail: str
    severity: Severity = "warning"
    rank: int | None = None
    attempt: int | None = None
    ts: float | None = None
    family: str = field(default="")
    episode: int | None = None
    phase: str | None = None

    @property
    def resolved(self) -> bool:
        """An all-clear: the episode ended, nothing to act on."""
        return self.phase == "resolved"

    def __post_init__(self) -> None:
        if not self.family:
            from .registry import (
                FAMILIES,
            )  # the registry imports the monitors, which import this module

            object.__setattr__(self, "family", FAMILIES.get(self.monitor, self.monitor))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        v = d["value"]
        if isinstance(v, float) and not math.isfinite(v):
            d["value"] = str(v)  # JSON-safe, like the probe's encoding
        return d

    def to_event(self) -> dict[str, Any]:
        """The ``events.jsonl`` fields (without ``ts``/``kind`` bookkeeping) for this finding.

        ``straggler {rank, ratio}`` for stragglers, ``anomaly {monitor, step, value, detail}``
        for everything else (the design's event vocabulary), plus ``severity`` and ``rank``,
        and ``episode``/``phase`` for a monitor that reports episodes.
        """
        value = self.to_dict()["value"]
        if self.monitor == "straggler":
            ev = {
                "kind": "straggler",
                "rank": self.rank,
                "ratio": value,
                "step": self.step,
                "detail": self.detail,
                "severity": self.severity,
            }
        else:
            ev = {
                "kind": "anomaly",
                "monitor": self.monitor,
                "step": self.step,
                "value": value,
                "detail": self.detail,
                "severity": self.severity,
                "rank": self.rank,
            }
        if self.phase is not None:
            ev["episode"] = self.episode
            ev["phase"] = self.phase
        return ev


class Monitor:
    """The contract: ``feed(record) -> list[Finding]`` and ``reset(step)``, a ``name``, a config.

    Write ``feed`` for one rank's records in step order and ``reset(step)`` to forget everything at
    or after ``step`` (the run went back to it: a restart or a rollback redoes those steps).
    Findings are :class:`Finding`; their ``rank``, ``attempt`` and ``ts`` are filled in from the
    record.
    ``feed`` must be deterministic, cheap, and must not raise on odd records (strings, None).

    The feed layer (:func:`replay`, the supervisor's ``MonitorFeed``) does the rest: one copy of the
    monitor per rank (``copy.deepcopy`` of it as built), ``reset(step)`` on a rank's copy when that
    rank's step goes back, a finding (its step and detail) reported once across ranks. Reading the
    record any way (``items()``, ``dict(record)``) is safe: nothing watches it.

    Opt-in, for scale: ``reads = ("loss",)`` says ``feed`` depends on those keys only (and the
    step). Then ``feed`` gets ``{"step": ..., key: value}`` of them alone, a record with none of
    them is not fed, and in the supervisor ranks whose values agree share one copy
    (``SharedRankedMonitor``: a follower costs a tuple comparison; node agents' summed-up ranks move
    on unread).
    """

    name: str = ""
    reads: tuple[str, ...] | None = None

    def feed(self, record: Mapping[str, Any]) -> list[Finding]:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self, step: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@runtime_checkable
class Fed(Protocol):
    """What the feed layer drives: a :class:`Monitor`, or a monitor with its own per-rank handling
    (``RankedMonitor``, ``StragglerMonitor``, ...): ``feed``, optionally ``feed_at(record, keys,
    step, rank)`` (the same findings from a record parsed once for all, see :func:`fast_entries`)
    and ``flush() -> list[Finding]`` (score anything buffered at the end of a stream)."""

    name: str

    def feed(self, record: Mapping[str, Any]) -> list[Finding]: ...


def replay(
    records: Iterable[Mapping[str, Any]], monitors: Iterable[Any], flush: bool = True
) -> list[Finding]:
    """Feed every record to every monitor, in order; all findings in the order they fired.

    With ``flush`` (default) monitors that buffer across ranks (straggler) score
    what they still hold at the end of the stream, as a finished run would.
    """
    mons = [driven(m) for m in monitors]
    calls = fast_entries(mons)
    out: list[Finding] = []
    for record in records:
        step = record.get("step")  # step_and_rank, once for every monitor
        if type(step) is not int:
            step = record_step(record)
            if step is None:
                for m in mons:
                    out.extend(m.feed(record))
                continue
        rank = record.get("rank", 0)
        if type(rank) is not int:
            rank = record_rank(record)
        keys = record.keys()
        for f in calls:
            found = f(record, keys, step, rank)
            if found:
                out.extend(found)
    if flush:
        for m in mons:
            f = getattr(m, "flush", None)
            if f is not None:
                out.extend(f())
    return out


def fast_entries(monitors: Iterable[Any]) -> list:
    """Each monitor's ``feed_at(record, keys, step, rank)`` (the record parsed once for all of them:
    its ``keys()`` and :func:`step_and_rank`, step not None), or an adapter to ``feed(record)`` for
    a monitor without one. ``replay`` and the supervisor's ``MonitorFeed`` call these; a record
    without a step goes to ``feed`` (every monitor here ignores it)."""
    out = []
    for m in monitors:
        m = driven(m)
        f = getattr(m, "feed_at", None)
        if f is None or _feed_overridden(m):
            f = _plain_entry(m.feed)
        out.append(f)
    return out


def _feed_overridden(m: Any) -> bool:
    """Whether ``feed`` was redefined below the class that defines ``feed_at`` (or on the object):
    then ``feed`` is what the monitor means, and the fast entry would skip it."""
    if "feed" in getattr(m, "__dict__", ()):
        return True
    mro = type(m).__mro__
    i = next((n for n, c in enumerate(mro) if "feed" in c.__dict__), len(mro))
    j = next((n for n, c in enumerate(mro) if "feed_at" in c.__dict__), len(mro))
    return i < j


def _plain_entry(feed: Any) -> Any:
    return lambda record, keys, step, rank: feed(record)


# ---------------------------------------------------------------- helpers shared by the monitors

_NONFINITE = {
    "nan": math.nan,
    "+nan": math.nan,
    "-nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
}


def number(value: Any) -> float | None:
    """A metric value as a float: NaN/Inf strings become NaN/Inf floats; None, bools and junk become
    None."""
    t = type(value)
    if t is float:  # the common case first: this runs several times per record per monitor
        return value
    if t is int:
        return float(value)
    if value is None or t is bool:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        v = _NONFINITE.get(value.strip().lower())
        if v is not None:
            return v
        try:
            return float(value)
        except ValueError:
            return None
    return None


_MISSING = object()


def spelled(key: str) -> tuple[str, str | None]:
    """(key, its sanitised ``a_b`` spelling or None): computed once per monitor, not per record."""
    alt = key.replace("/", "_")
    return key, (alt if alt != key else None)


def finite_floats(
    record: Mapping[str, Any], spellings: tuple[tuple[str, str | None], ...]
) -> tuple:
    """:func:`finite_of` of each spelled key, as a tuple (a shared monitor's inputs); a float under
    the first spelling is taken without a call (the common case)."""
    out = []
    for sp in spellings:
        v = record.get(sp[0])
        if type(v) is float and v - v == 0.0:
            out.append(v)
        else:
            out.append(finite_of(record, sp))
    return tuple(out)


def finite_of(record: Mapping[str, Any], spelling: tuple[str, str | None]) -> float | None:
    """The finite number under a :func:`spelled` key, else None."""
    v = record.get(spelling[0], _MISSING)
    if v is _MISSING:
        if spelling[1] is None:
            return None
        v = record.get(spelling[1], _MISSING)
        if v is _MISSING:
            return None
    if type(v) is float:
        return v if v - v == 0.0 else None  # inf - inf and nan - nan are nan
    v = number(v)
    return v if v is not None and math.isfinite(v) else None


def first_finite(
    record: Mapping[str, Any], spellings: tuple[tuple[str, str | None], ...]
) -> tuple[str | None, float | None]:
    """:func:`first_number` over :func:`spelled` keys."""
    for sp in spellings:
        v = finite_of(record, sp)
        if v is not None:
            return sp[0], v
    return None, None


def lookup(record: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """(present, raw value) for ``key``; ``a/b/c`` also matches the adapter's sanitised
    ``a_b_c``."""
    if key in record:
        return True, record[key]
    alt = key.replace("/", "_")
    if alt != key and alt in record:
        return True, record[alt]
    return False, None


def get_number(record: Mapping[str, Any], key: str) -> float | None:
    return number(lookup(record, key)[1])


def first_number(record: Mapping[str, Any], keys: Iterable[str]) -> tuple[str | None, float | None]:
    """The first of ``keys`` that holds a finite number: (key, value), else (None, None)."""
    for k in keys:
        v = get_number(record, k)
        if v is not None and math.isfinite(v):
            return k, v
    return None, None


def record_step(record: Mapping[str, Any]) -> int | None:
    try:
        return int(record["step"])
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: a step of inf
        return None


def record_rank(record: Mapping[str, Any]) -> int:
    try:
        return int(record.get("rank", 0) or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def step_and_rank(record: Mapping[str, Any]) -> tuple[int | None, int]:
    """(step, rank) of a record; step None when it has none. The probe writes ints: they skip the
    careful parse (every monitor's hot path)."""
    step = record.get("step")
    if type(step) is not int:
        step = record_step(record)
    rank = record.get("rank", 0)
    if type(rank) is not int:
        rank = record_rank(record)
    return step, rank


def record_ts(record: Mapping[str, Any]) -> float | None:
    v = number(record.get("ts"))
    return v if v is not None and math.isfinite(v) else None


def record_attempt(record: Mapping[str, Any]) -> int | None:
    try:
        a = record.get("attempt")
        return None if a is None else int(a)
    except (TypeError, ValueError):
        return None


def median(xs: list[float]) -> float:
    return median_sorted(sorted(xs))


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method)."""
    return quantile_sorted(sorted(xs), q)


class StepSeries:
    """Per-rank history of one value, keyed by step, that rewinds when the run does.

    A resumed or rolled-back run writes steps again (``step`` goes back); the
    history then drops every entry at or after the new step, so trailing windows
    describe the timeline the run is actually on.
    """

    __slots__ = ("steps", "values", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.steps: list[int] = []
        self.values: list[float] = []
        self.maxlen = maxlen

    def rewind(self, step: int) -> bool:
        """Drop entries at or after ``step``; True when anything was dropped."""
        if not self.steps or self.steps[-1] < step:
            return False
        i = len(self.steps)
        while i > 0 and self.steps[i - 1] >= step:
            i -= 1
        del self.steps[i:]
        del self.values[i:]
        return True

    def append(self, step: int, value: float) -> None:
        self.rewind(step)
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) > self.maxlen:
            del self.steps[0]
            del self.values[0]

    def __len__(self) -> int:
        return len(self.steps)


class SortedSeries(StepSeries):
    """A :class:`StepSeries` that also keeps its values, and the absolute step-to-step changes,
    sorted.

    Why: the numeric monitors take a median or a quantile of the trailing window on every record;
    sorting 50 values per record per rank was most of their cost. Insertion and removal by bisection
    keep the same multiset that ``sorted(values)`` would give, so medians and quantiles are
    bit-identical.
    """

    __slots__ = ("sorted", "diffs")

    def __init__(self, maxlen: int) -> None:
        super().__init__(maxlen)
        self.sorted: list[float] = []
        self.diffs: list[float] = []  # sorted abs(values[i+1] - values[i])

    def rewind(self, step: int) -> bool:
        if not super().rewind(step):
            return False
        v = self.values
        self.sorted = sorted(v)
        self.diffs = sorted([abs(b - a) for a, b in zip(v, v[1:])])
        return True

    def append(self, step: int, value: float) -> None:
        steps = self.steps
        if steps and steps[-1] >= step:
            self.rewind(step)
        v = self.values
        if v:
            insort(self.diffs, abs(value - v[-1]))
        steps.append(step)
        v.append(value)
        insort(self.sorted, value)
        if len(steps) > self.maxlen:
            old = v[0]
            del steps[0]
            del v[0]
            s = self.sorted
            del s[bisect_left(s, old)]
            d = self.diffs
            del d[bisect_left(d, abs(v[0] - old))]


def median_sorted(s: list[float]) -> float:
    """:func:`median` of an already sorted list (the windows kept sorted skip the sort)."""
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def quantile_sorted(s: list[float], q: float) -> float:
    """:func:`quantile` of an already sorted list."""
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class RankedMonitor:
    """Base for monitors that follow one series per rank.

    Handles what every such monitor needs: per-rank state, rewinding when a
    rank's step goes back (resume, rollback), and one finding per (step, kind)
    across ranks (most keys are global - the same loss on every rank - so two
    ranks would otherwise report the same thing twice). Subclasses implement
    ``_new_state``, ``_check`` and optionally ``_rewind``.
    """

    name = ""
    _silent = False  # SharedRankedMonitor: rebuilding a state, no findings
    _tried: list | None = None  # SharedRankedMonitor: the emissions a logged transition tried

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._ranks: dict[int, Any] = {}
        self._last_step: dict[int, int] = {}
        self._fired: dict[tuple[int, str], int] = {}

    def _new_state(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rewind(self, state: Any, step: int) -> None:
        """Forget everything at or after ``step`` (the run is redoing it)."""

    def _check(
        self, state: Any, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:  # pragma: no cover
        raise NotImplementedError

    _gate: frozenset | tuple | None = (
        None  # a record with none of these keys changes nothing: return at once
    )

    def feed(self, record: Mapping[str, Any]) -> list[Finding]:
        step, rank = step_and_rank(record)  # the live path parses once for every monitor: feed_at
        return [] if step is None else self.feed_at(record, record.keys(), step, rank)

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        """``feed`` with what every monitor would parse given once: ``keys`` is ``record.keys()``,
        ``step`` and ``rank`` are :func:`step_and_rank`'s (``step`` not None). Why: the supervisor
        feeds each record to every monitor; parsing it once for all (``feed_all``, ``MonitorFeed``)
        saves ~0.3 µs a monitor."""
        gate = self._gate
        if gate is not None and keys.isdisjoint(gate):
            return []
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = self._new_state()
        rk = self._rewind_keys
        if rk is None or not keys.isdisjoint(rk):
            last = self._last_step.get(rank)
            if last is not None and step <= last:
                self._rewind(state, step)
                if self._fired:
                    for key, r in list(self._fired.items()):
                        if r == rank and key[0] >= step:
                            del self._fired[key]
            self._last_step[rank] = step
        return self._check(state, record, step, rank)

    # Whether a record at an already-seen step means the run went back (resume, rollback): every
    # record (None), or only one with any of these keys (a monitor fed side records, evals between
    # steps, narrows it)
    _rewind_keys: frozenset | tuple | None = None

    def _emit(
        self,
        out: list[Finding],
        record: Mapping[str, Any],
        step: int,
        rank: int,
        kind: str,
        value: float | None,
        detail: str,
        severity: Severity,
    ) -> None:
        key = (step, kind)
        if key in self._fired:
            return
        self._fire(out, key, record, step, rank, value, detail, severity)

    def _fire(
        self,
        out: list[Finding],
        key: tuple,
        record: Mapping[str, Any],
        step: int,
        rank: int,
        value: float | None,
        detail: str,
        severity: Severity,
        episode: int | None = None,
        phase: str | None = None,
    ) -> None:
        """The finding of ``key``, reported once across ranks: ``rank`` is the one that fired it."""
        self._fired[key] = rank
        out.append(
            Finding(
                self.name,
                step,
                value,
                detail,
                severity,
                rank,
                record_attempt(record),
                record_ts(record),
                episode=episode,
                phase=phase,
            )
        )


# --------------------------------------------------------------- one state for the ranks that agree


# --------------------------------------------------------------- the feed layer around a Monitor


class PerRank(RankedMonitor):
    """What drives a :class:`Monitor` (``monitor``): a copy of it per rank, ``reset(step)`` on a
    rank's copy when its step goes back, each finding stamped with the rank, attempt and time of
    its record and reported once across ranks (its step and detail). With ``monitor.reads``, each
    copy is fed ``{"step", those keys}`` only and a record with none of them is not fed:
    ``SharedRankedMonitor``'s driver (``shared.Shared``) feeds the same, so both give the same
    findings."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.name = monitor.name
        fed = monitor.__dict__.get("_fed")  # (another driver of it: not part of a copy)
        self._pristine = copy.deepcopy(monitor, {id(fed): None} if fed is not None else None)
        reads = monitor.reads
        self._names = tuple(reads) if reads is not None else None
        if reads is not None:
            self._spell = tuple(spelled(k) for k in reads)
            self._gate = self._rewind_keys = frozenset(
                k for sp in self._spell for k in sp if k is not None
            )
        super().__init__()

    def _new_state(self) -> Monitor:
        return copy.deepcopy(self._pristine)

    def _rewind(self, state: Monitor, step: int) -> None:
        state.reset(step)

    def _check(
        self, state: Monitor, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        if self._names is None:
            return self._report(state.feed(record), record, rank)
        return self._report(state.feed(self._view(step, self._read(record))), record, rank)

    def _read(self, record: Mapping[str, Any]) -> tuple:
        """The values of ``reads`` (``_MISSING`` where absent; an int as a float: equal inputs are
        the same inputs)."""
        out = []
        for k, alt in self._spell:
            v = record.get(k, _MISSING)
            if v is _MISSING and alt is not None:
                v = record.get(alt, _MISSING)
            out.append(float(v) if type(v) is int else v)
        return tuple(out)

    def _view(self, step: int, values: tuple) -> dict[str, Any]:
        view: dict[str, Any] = {"step": step}
        for k, v in zip(self._names or (), values):
            if v is not _MISSING:
                view[k] = v
        return view

    def _report(self, found: list[Finding], record: Mapping[str, Any], rank: int) -> list[Finding]:
        if not found or self._silent:
            return []
        out: list[Finding] = []
        fired, tried = self._fired, self._tried
        for f in found:
            key = (f.step, f.detail)
            if tried is not None:  # SharedRankedMonitor: followers replay what the leader tried
                tried.append((key, f.step, f.value, f.detail, f.severity, f.episode, f.phase))
            if key not in fired:
                self._fire(
                    out,
                    key,
                    record,
                    f.step,
                    rank,
                    f.value,
                    f.detail,
                    f.severity,
                    f.episode,
                    f.phase,
                )
        return out


def driven(m: Any) -> Any:
    """What the feed layer calls for ``m``: a :class:`Monitor`'s :class:`PerRank` (kept on it, so
    that a second ``replay`` goes on where the first stopped), any other monitor itself."""
    if not isinstance(m, Monitor):
        return m
    d = m.__dict__.get("_fed")
    if d is None:
        d = m.__dict__["_fed"] = PerRank(m)
    return d
