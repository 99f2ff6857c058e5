"""The pure metric monitors (``ptops.monitors``) as the supervisor runs them live.

Why a part of its own: a monitor config that cannot be built must not leave a run going on with
zero monitors and nobody knowing, so it is a recipe error at launch (one line naming the file and
the key, exit 2); a monitor that raises on a record at run time is recorded once
(``monitor_error``) while the others keep running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ptops.monitors import fast_entries
from ptops.monitors.base import step_and_rank
from ptops.monitors.config import MonitorsSection
from ptops.monitors.shared import SharedRankedMonitor, driven, keys_any_record_reads, keys_read
from ptops.recipes.schema import build_monitors_of


def build(section: MonitorsSection | None, origin: str) -> list:
    """Fresh monitors of a ``[monitors]`` section, or :class:`RecipeError` naming the monitor that
    fails (the schema's own check: a recipe that loaded builds here too)."""
    return build_monitors_of(section or MonitorsSection(), origin)


@dataclass
class MonitorFeed:
    """Feeds each metric record to every monitor; a monitor that raises is reported once, never
    dropped silently.

    Why the fast path: the record is parsed once for all monitors (its keys, step and rank, handed
    to each monitor's ``feed_at``; see ``ptops.monitors.fast_entries``) instead of once per monitor
    in ``feed``. A ``Monitor`` (``feed`` and ``reset``) is driven here by ``shared.driven``: a copy
    per rank, shared by the ranks whose values agree when it declares ``reads``.
    """

    monitors: list
    errors: dict[str, int] = field(default_factory=dict)  # monitor name -> records it raised on
    # monitor name -> summed-up ranks it could not move on (``repeat_summary``)
    unmoved: dict[str, int] = field(default_factory=dict)
    # shared monitors whose inputs read every value of a record (``items()``, ...): left out of
    # what node agents may sum up, their summed-up ranks counted in ``unmoved`` (``read_keys``)
    read_every: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # id(monitor) -> (monitor, what drives it: ``shared.driven``)
        self._drivers: dict[int, tuple] = {}
        self._calls: list = []
        # the monitors ``_calls`` was built for (``monitors`` may be changed in place)
        self._of: list = []
        self._reps: list = []  # per call: the monitor's ``repeat`` where ``like`` goes, or None

    def feed(
        self, rec: dict[str, Any], like: tuple | None = None
    ) -> tuple[list, list[tuple[str, Exception]]]:
        """(findings, first errors): the findings of every monitor, and (name, exception) for each
        monitor that raised on this record for the first time in the run.

        ``like``: (rank, keys) when a node agent's batch certified this record equal to that
        rank's record of the step (fed just before) but for those keys (``unbatch``): the monitors
        that share state across ranks move the rank on without reading the record where those keys
        are none they read (``SharedRankedMonitor.repeat``); the rest are fed as usual."""
        findings: list = []
        first_errors: list[tuple[str, Exception]] = []
        step, rank = step_and_rank(rec)  # once for every monitor
        keys = rec.keys()
        self._sync()
        calls = self._calls
        if step is None:  # no step: each monitor's plain feed (the monitors here ignore it)
            calls = [(m, _plain(m)) for m, _ in calls]
            like = None
        reps = self._reps if like is not None else repeat(None)  # (zip stops at the calls)
        for (m, f), rep in zip(calls, reps):
            try:
                if rep is not None:
                    found = rep(rec, keys, step, rank, like[0], like[1])
                else:
                    found = f(rec, keys, step, rank)
                if found:
                    findings.extend(found)
            except Exception as e:  # one monitor's bug must not blind the others
                self._raised(m, e, first_errors)
        return findings, first_errors

    def feed_group(self, recs: list, likes: list) -> tuple[list, list[tuple[str, Exception, dict]]]:
        """``feed`` of each record of a node's step group in turn: ``recs[0]`` the leader (whole),
        each later one certified equal to it but for the keys in its ``likes`` entry
        (``unbatch``'s (leader's rank, keys)). The same findings in the same order, the same
        errors: each monitor takes the group in one call, a shared monitor moving its followers on
        at once where none of them changes its inputs (``SharedRankedMonitor.repeat_group``), and
        the findings are put back in record order. Why: at 16k nodes a call per record per
        monitor was a third of the monitors' cost (docs/scale.md, "The budget at 131,072 ranks").
        A group that is not one (steps or keys that differ, a record without a step) is fed
        record by record. The first errors come as (name, exception, the record)."""
        lead = recs[0]
        step, lead_rank = step_and_rank(lead)
        keys = lead.keys()
        ranks: list = []
        for rec, like in zip(recs[1:], likes[1:]):
            s, r = step_and_rank(rec)
            if s != step or like is None or like[0] != lead_rank or rec.keys() != keys:
                break
            ranks.append(r)
        if step is None or likes[0] is not None or len(ranks) != len(recs) - 1:
            return self._each(recs, likes)
        self._sync()
        diffs = [like[1] for like in likes[1:]]
        found: list = []  # (record's place, monitor's place, findings)
        first_errors: list = []  # (record's place, monitor's place, (name, exception))
        for mi, ((m, f), rep) in enumerate(zip(self._calls, self._reps)):
            try:
                got = f(lead, keys, step, lead_rank)
                if got:
                    found.append((0, mi, got))
            except Exception as e:  # as in ``feed``
                self._raised(m, e, first_errors, (0, mi))
            if rep is None:
                for i in range(1, len(recs)):
                    try:
                        got = f(recs[i], keys, step, ranks[i - 1])
                        if got:
                            found.append((i, mi, got))
                    except Exception as e:  # as in ``feed``
                        self._raised(m, e, first_errors, (i, mi))
            elif not _moved(m, step, ranks, lead_rank, diffs, keys):
                for i in range(1, len(recs)):
                    try:
                        got = rep(recs[i], keys, step, ranks[i - 1], lead_rank, diffs[i - 1])
                        if got:
                            found.append((i, mi, got))
                    except Exception as e:  # as in ``feed``
                        self._raised(m, e, first_errors, (i, mi))
        if len(found) > 1:
            found.sort(key=_place)
        findings = [x for _, _, got in found for x in got]
        return findings, [(*x, recs[i]) for i, _, x in sorted(first_errors, key=_place)]

    def repeat_summary(
        self, lead: dict[str, Any], ranks: list, names: frozenset
    ) -> tuple[list, list[tuple[str, Exception, dict]]]:
        """The ranks a node agent summed up (``node_summaries``), each equal to ``lead`` (fed
        before) but for keys in ``names``: each shared monitor moves them on with their leader
        (``repeat_group``), or else takes each as the leader's record under its own rank when
        none of ``names`` is a key it reads of it (then the same inputs: the same state and
        findings). A monitor that reads one of them cannot: those ranks stay where they were
        (at their next sample step it rebuilds them, ``SharedRankedMonitor``), counted in
        ``unmoved``. The other monitors see these ranks on sample steps only (docs/scale.md)."""
        step, lead_rank = step_and_rank(lead)
        if step is None or not ranks:
            return [], []
        self._sync()
        keys = lead.keys()
        findings: list = []
        first_errors: list = []
        for (m, _), rep in zip(self._calls, self._reps):
            # (``names``: every rank's diff, one set, not a list of it a rank: O(1) a monitor)
            if rep is None or _moved(m, step, ranks, lead_rank, names, keys):
                continue
            try:
                read = keys_read(m._inputs, lead)
            except Exception:  # as unreadable: left where they were
                read = None
            if read is None or not names.isdisjoint(read):
                name = getattr(m, "name", type(m).__name__)
                self.unmoved[name] = self.unmoved.get(name, 0) + len(ranks)
                continue
            for r in ranks:
                rec = dict(lead)
                rec["rank"] = r
                try:
                    got = rep(rec, keys, step, r, lead_rank, names)
                    if got:
                        findings.extend(got)
                except Exception as e:  # as in ``feed``
                    errs: list = []
                    self._raised(m, e, errs)
                    first_errors.extend((n, x, rec) for n, x in errs)
        return findings, first_errors

    def read_keys(self) -> frozenset | None:
        """What a summed-up rank may not differ from its leader in (``keys_any_record_reads``); the
        monitors left out of it for reading every value in ``read_every``."""
        self._sync()
        every: list = []
        read = keys_any_record_reads([m for m, _ in self._calls], every)
        self.read_every = every
        return read

    def _each(self, recs: list, likes: list) -> tuple[list, list[tuple[str, Exception, dict]]]:
        findings: list = []
        first_errors: list = []
        for rec, like in zip(recs, likes):
            got, errs = self.feed(rec, like)
            findings.extend(got)
            first_errors.extend((name, e, rec) for name, e in errs)
        return findings, first_errors

    def _sync(self) -> None:
        """The calls for the monitors as they are now (``monitors`` may be changed in place)."""
        if self._of != self.monitors:  # identity first, in C: ~0.1 µs
            self._of = list(self.monitors)
            old, self._drivers = self._drivers, {}
            for m in self._of:  # (a monitor kept keeps its driver and its state)
                kept = old.get(id(m))
                self._drivers[id(m)] = kept if kept and kept[0] is m else (m, driven(m))
            drivers = [self._drivers[id(m)][1] for m in self._of]
            self._calls = list(zip(drivers, fast_entries(drivers)))
            self._reps = [m.repeat if _repeats(m, f) else None for m, f in self._calls]

    def _raised(self, m: Any, e: Exception, first: list, place: tuple | None = None) -> None:
        name = getattr(m, "name", type(m).__name__)
        self.errors[name] = self.errors.get(name, 0) + 1
        if self.errors[name] == 1:
            first.append((name, e) if place is None else (*place, (name, e)))


def _moved(m: Any, step: int, ranks: list, lead: Any, diffs: Any, keys: Any) -> bool:
    """``m.repeat_group``; an exception there (a monitor's ``_inputs`` raising on the leader's
    record) is left to each follower's ``repeat`` to raise again and be counted, as it would be
    record by record (``repeat_group`` changes nothing before its checks pass)."""
    try:
        return m.repeat_group(step, ranks, lead, diffs, keys)
    except Exception:
        return False


def _place(x: tuple) -> tuple:
    return x[0], x[1]


def _repeats(m: Any, entry: Any) -> bool:
    """Whether ``m`` can move a certified repeat on (``feed`` not redefined past ``feed_at``)."""
    return (
        isinstance(m, SharedRankedMonitor)
        and m.share
        and getattr(entry, "__self__", None) is m
        and getattr(entry, "__name__", "") == "feed_at"
    )


def _plain(m: Any) -> Any:
    return lambda rec, keys, step, rank: m.feed(rec)
