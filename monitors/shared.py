"""Ranks that report the same values share one monitor state (``SharedRankedMonitor``).

Why a file of its own: the ranks of one run report the same global values (TRL gathers them,
TorchTitan logs the global loss), so one state per rank repeats the same work world-size times;
following one state exactly (a rank that diverges later gets its own, rebuilt from a logged copy) is
its own machinery, apart from the monitor contract in ``base.py``. Pure like every monitor: no ptops
imports, no I/O.

A :class:`~.base.Monitor` opts in with ``reads`` (the keys its ``feed`` depends on): ``driven``
wraps it in :class:`Shared`, whose inputs are those keys' values. The monitors written against
this class directly give ``_inputs(record)`` (a tuple of everything the monitor reads) and
``_apply(state, inputs, record, step, rank)``. What a shared monitor reads of a record is learnt
by reading it through a dict that notes the keys (``_Reads``, ``_Probe``); a read of every value
(``items()``, ``dict(record)``, ``json.dumps``) is noted as such, never missed, and only takes that
monitor off the node agents' summing-up (``keys_any_record_reads``), counted and said
(``MonitorFeed.unmoved``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from .base import _MISSING as _MISSING_INPUT
from .base import Finding, Monitor, PerRank, RankedMonitor, Severity

_LOG_MAX = 1024  # transitions kept before a checkpoint (a copy of the shared state) replaces them
_GATED = object()  # ``_led``: the record had none of the monitor's keys
_NOOP = object()  # ``_led``: its inputs changed nothing


class _Reads(dict):
    """A record that notes the keys whose values are read: ``get``, ``[]``, and every way of reading
    all of them (``items``, ``values``, ``dict(record)``, ``{**record}``, ``copy``, ``|``, ``==``,
    ``repr``, ``json.dumps``). Its keys themselves (``in``, ``keys()``, iteration) are no values: a
    certified repeat has the same keys."""

    __slots__ = ("read",)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return dict.get(self, key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return dict.__getitem__(self, key)

    def __iter__(self) -> Any:  # (not dict's own: ``dict(r)``, ``{**r}`` then read through ``[]``)
        return dict.__iter__(self)

    def _all(self) -> None:
        self.read.update(dict.keys(self))

    def items(self) -> Any:
        self._all()
        return dict.items(self)

    def values(self) -> Any:
        self._all()
        return dict.values(self)

    def copy(self) -> dict:
        self._all()
        return dict(dict.items(self))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return dict.setdefault(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return dict.pop(self, key, *default)

    def __or__(self, other: Any) -> Any:
        self._all()
        return dict.__or__(self, other)

    def __ror__(self, other: Any) -> Any:
        self._all()
        return dict.__ror__(self, other)

    def __eq__(self, other: Any) -> bool:
        self._all()
        return dict.__eq__(self, other)

    def __ne__(self, other: Any) -> bool:
        self._all()
        return dict.__ne__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._all()
        return dict.__repr__(self)


def _keys_read(inputs: Any, record: Mapping[str, Any]) -> frozenset:
    """The keys whose values ``inputs(record)`` reads."""
    r = _Reads(record)
    r.read = set()
    inputs(r)
    return frozenset(r.read)


class _Every(Exception):
    """A monitor's inputs read every value of the record (``items``, ``dict(record)``, ...)."""


class _Probe(dict):
    """A record that has every key asked for but those ``absent`` (None: it has none), a finite
    number each: what a monitor's inputs read of a record they might be given. Its key set is
    empty (a summed-up rank has its leader's keys: what its inputs make of the keys alone is the
    same). Reading all values (``items``, ``values``, ``copy``, ``|``, ``==``, ``repr``,
    ``json.dumps``) raises :class:`_Every`: that monitor reads every value. A read this misses
    (``dict(record)`` copies no key of it) is caught on the real record (``_Reads``)."""

    def __init__(self, absent: frozenset | None) -> None:
        super().__init__()
        self.absent, self.read = absent, set()

    def _has(self, key: Any) -> bool:
        return self.absent is not None and key not in self.absent

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return 1.0 if self._has(key) else default

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        if not self._has(key):
            raise KeyError(key)
        return 1.0

    def __contains__(self, key: Any) -> bool:
        return self._has(key)

    def _every(self, *_: Any) -> Any:
        raise _Every

    items = values = copy = __or__ = __ror__ = __eq__ = __ne__ = __repr__ = _every
    __hash__ = None  # type: ignore[assignment]


PROBES = 256  # a monitor's probes at most (``keys_any_record_reads``)


def keys_any_record_reads(monitors: list, every: list | None = None) -> frozenset:
    """The keys the shared monitors' inputs read of a record: probed with no key present, with
    every key, and then with each key read missing in turn, and so on (a second spelling is read
    only when the first is missing), at most ``PROBES`` a monitor. What a node agent's rank may
    differ from its leader in and still be summed up (``node_summaries``); a key missed here is
    still checked against the record itself (``repeat_group``, ``keys_read``). A monitor whose
    inputs read every value (``items()``, ``dict(record)``, ...) or raise on a probe is left out,
    its name appended to ``every``: summing up stays on for the others, and the ranks it cannot
    move on are counted (``MonitorFeed.unmoved``) and judged again from their next whole record."""
    read: set = set()
    for m in monitors:
        if not (isinstance(m, SharedRankedMonitor) and m.share):
            continue
        mine: set = set()
        todo: list = [None, frozenset()]
        tried: set = set()
        try:
            while todo and len(tried) < PROBES:
                absent = todo.pop(0)
                if absent in tried:
                    continue
                tried.add(absent)
                probe = _Probe(absent)
                m._inputs(probe)
                mine |= probe.read
                if absent is not None:
                    todo.extend(absent | {k} for k in probe.read if k not in absent)
        except Exception:  # _Every, or a probe it cannot read: it reads all
            if every is not None:
                every.append(getattr(m, "name", type(m).__name__))
            continue
        read |= mine
    return frozenset(read)


def keys_read(inputs: Any, record: Mapping[str, Any]) -> frozenset:
    """The keys whose values ``inputs(record)`` reads (the public name of ``_keys_read``)."""
    return _keys_read(inputs, record)


def _same_sig(a: tuple, b: tuple) -> bool:
    """The same inputs: equal, and equal as what a monitor makes of them. Inputs are parsed (floats,
    None, strings), where -0.0 == 0.0 (but may print differently) is the one trap."""
    return a == b and (0.0 not in b or _strict_same(a, b))


def _strict_same(a: tuple, b: tuple) -> bool:
    return all(
        type(x) is type(y)
        and (type(x) is not float or x != 0.0 or math.copysign(1.0, x) == math.copysign(1.0, y))
        for x, y in zip(a, b)
    )


class _Group:
    """A state and the ranks at or behind it.

    ``state`` is the state after ``pos0 + len(log)`` transitions; ``base`` a copy of the state after
    ``pos0`` (None: the fresh state, pos0 == 0); ``log[i]`` the transition ``pos0 + i``: (step,
    inputs, record, rewound, emissions tried). ``log`` None: one rank's own state."""

    __slots__ = ("state", "pos0", "base", "log", "n")

    def __init__(self, state: Any, log: list | None, pos0: int = 0) -> None:
        self.state = state
        self.pos0 = pos0
        self.base: Any = None
        self.log = log
        self.n = 1  # members

    @property
    def head(self) -> int:
        return self.pos0 + len(self.log or ())


class _Cohort:
    """Followers that ``repeat_group`` moved on as one and that nothing touched one by one since:
    their step and their place, held once for all of them. Why: a relay's 511 followers come as the
    same group every step, for each shared monitor; noting each one's step and place was most of
    the supervisor's core at 131,072 ranks (docs/scale.md).

    ``step``: the step of every rank (their ``_last_step`` entries are stale), or None (each one's
    own ``_last_step`` entry). ``member``: the one ``[group, position]`` list that is every rank's
    ``_members`` entry (never changed through one rank: it is dissolved first), or None (each
    one's own entry). ``ranks``: a copy (the caller's list is compared, never trusted)."""

    __slots__ = ("ranks", "step", "member")

    def __init__(self, ranks: list, step: int | None, member: list | None) -> None:
        self.ranks = list(ranks)
        self.step = step
        self.member = member


class SharedRankedMonitor(RankedMonitor):
    """A :class:`RankedMonitor` whose ranks share one state while their inputs agree.

    Exact: a rank follows the shared state only while every (step, inputs, rewind) it feeds equals
    what the state was advanced with at its position, and gets the findings its own state would
    have given (the emissions the leading rank tried are replayed for it, against the same
    once-per-(step, kind) table); a rank that diverges gets a state of its own, rebuilt from the
    last checkpoint and the log. Ranks that differ from their first transition on (several runs'
    worth of ranks in one stream) group by that first transition.
    """

    share = True  # False: every rank keeps its own state (the reference the tests compare with)
    _noop: tuple = (None,)  # inputs with which ``_apply`` changes nothing: no transition at all

    def reset(self) -> None:
        super().reset()
        self._members: dict[int, list] = {}  # rank -> [group or None (not placed yet), position]
        self._cohort_of: dict[int, _Cohort] = {}  # rank -> the cohort it is in (``repeat_group``)
        self._cohorts: dict[_Cohort, None] = {}  # the cohorts (``_checkpoint``)
        self._fresh: list[_Group] = []  # logging groups from the fresh state (new ranks join one)
        self._tried: list | None = None
        self._silent = False
        # the last transition this monitor made, for ``repeat``: (step, rank, record, log entry |
        # _GATED | _NOOP, group, position, rewound[, keys read]), None after a rank's own state
        self._led: tuple | None = None

    def _inputs(self, record: Mapping[str, Any]) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(
        self, state: Any, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        raise NotImplementedError  # pragma: no cover - abstract

    def _check(self, state: Any, record: Mapping[str, Any], step: int, rank: int) -> list[Finding]:
        return self._apply(state, self._inputs(record), record, step, rank)

    def _state_of(self, rank: int) -> Any:
        """The rank's own state (rebuilt when it is behind the state it shares), or None."""
        c = self._cohort_of.get(rank)
        if c is not None:
            self._dissolve(c)
        m = self._members.get(rank)
        if m is None or m[0] is None:
            return None
        if m[0].log is not None and m[1] < m[0].head:
            self._fork(m)
        return m[0].state

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        gate = self._gate
        if gate is not None and keys.isdisjoint(gate):
            self._led = (step, rank, record, _GATED, None, 0, False)
            return []
        c = self._cohort_of.get(rank)
        if c is not None:
            self._dissolve(c)
        rew = self._seen(keys, step, rank)
        inputs = self._inputs(record)
        if not rew and inputs == self._noop:
            self._led = (step, rank, record, _NOOP, None, 0, False)
            return []  # changes nothing: not a transition
        return self._move(record, step, rank, rew, inputs)

    def repeat(
        self, record: Mapping[str, Any], keys: Any, step: int, rank: int, lead: Any, diff: Any
    ) -> list[Finding]:
        """``feed_at`` for a record that a node agent certified equal, key for key, to rank
        ``lead``'s record of this step but for the keys in ``diff`` (``unbatch`` in
        ``ops/rank/channel.py``: the keys, their order and every other value are the same). If
        that record was the last one this monitor moved on and none of ``diff`` is a key whose
        value ``_inputs`` read from it, the inputs are the same: the rank follows that transition
        without its record being read. Why: at thousands of nodes most records repeat their node's
        first one; the comparison is made once, on the node, not once per monitor here."""
        led = self._led
        if led is None or led[0] != step or led[1] != lead:
            return self.feed_at(record, keys, step, rank)
        e = led[3]
        if e is _GATED:  # the same keys: gated too
            return []
        c = self._cohort_of.get(rank)
        if c is not None:
            self._dissolve(c)
        if len(led) == 7:  # the keys whose values the leader's inputs came from, once
            self._led = led = led + (_keys_read(self._inputs, led[2]),)
        if not diff.isdisjoint(led[7]):
            return self._aside(record, keys, step, rank)
        rew = False
        rk = self._rewind_keys
        if rk is None or rk is self._gate or not keys.isdisjoint(rk):  # _seen, inlined
            last = self._last_step.get(rank)
            if last is not None and step <= last:
                rew = self._seen(keys, step, rank)
            else:
                self._last_step[rank] = step
        if e is _NOOP:
            if not rew:
                return []
            return self._aside(record, keys, step, rank, rew)
        g, pos = led[4], led[5]
        m = self._members.get(rank)
        log = g.log
        if (
            rew is not led[6]
            or m is None
            or m[0] is not g
            or m[1] != pos
            or log is None
            or pos < g.pos0
            or log[pos - g.pos0] is not e
        ):
            return self._aside(record, keys, step, rank, rew)
        m[1] = pos + 1
        if not e[4]:
            return []
        out: list[Finding] = []
        self._replay(out, e[4], record, rank)
        return out

    def repeat_group(self, step: int, ranks: list, lead: Any, diffs: Any, keys: Any) -> bool:
        """``repeat`` of a whole step group's followers (``ranks``, each certified equal to rank
        ``lead``'s record, fed just before, but for its keys in ``diffs``: a list, one set a rank,
        or one set for all of them; all with ``keys``), when every one of them would just follow
        the leader's transition with no finding: True when done (each rank moved on), False when
        nothing was done and each is for ``repeat``. The checks come first and change nothing, so
        a group is never half moved. Why: a node's step is one unit for the supervisor
        (docs/scale.md), one call here, not one a rank; and the group that was moved on last time
        (a ``_Cohort``, the same ``ranks`` again) is moved on in O(1), not a rank at a time."""
        led = self._led
        if led is None or led[0] != step or led[1] != lead:
            return False
        e = led[3]
        if e is _GATED:  # the same keys: gated too
            return True
        if len(led) == 7:
            self._led = led = led + (_keys_read(self._inputs, led[2]),)
        read = led[7]
        if isinstance(diffs, (set, frozenset)):  # every rank's (``repeat_summary``)
            if not diffs.isdisjoint(read):
                return False
        else:
            for d in set(diffs):  # (a summary's ranks: one set of names, checked once)
                if not d.isdisjoint(read):
                    return False
        rk = self._rewind_keys
        noted = rk is None or rk is self._gate or not keys.isdisjoint(rk)
        g = pos = None
        if e is not _NOOP:
            g, pos = led[4], led[5]
            log = g.log
            if led[6] or e[4] or log is None or pos < g.pos0 or log[pos - g.pos0] is not e:
                return False
        cohort_of = self._cohort_of
        c = cohort_of.get(ranks[0]) if ranks else None
        if (
            c is not None
            and ranks == c.ranks  # (equal ints are mostly the same objects: ~2 us)
            and cohort_of.get(lead) is not c
            and (not noted or c.step is not None)
            and (g is None or c.member is not None)
        ):  # the cohort moved on last time: its step and place, once for all its ranks
            if noted and step <= c.step:
                return False  # a rewind: its own way
            if g is not None:
                m = c.member
                if m[0] is not g or m[1] != pos:
                    return False
                m[1] = pos + 1
            if noted:
                c.step = step
            return True
        if len(set(ranks)) != len(ranks) or lead in ranks:
            return False
        if cohort_of:  # ranks of other cohorts (or this one, not all it holds): each its own again
            for c in set(map(cohort_of.get, ranks)):
                if c is not None:
                    self._dissolve(c)
        last_step = self._last_step
        # the loops a rank below run in C (``map``, ``count``), once: then the ranks are a cohort
        if noted and ranks and step <= max(map(last_step.get, ranks, [-(2**62)] * len(ranks))):
            return False  # a rewind: its own way
        member = None
        if g is not None:
            ms = list(map(self._members.get, ranks))
            if ms.count([g, pos]) != len(ms):  # each placed in g at pos (g compared by identity)
                return False
            member = [g, pos + 1]
        if ranks and (noted or member is not None):
            c = _Cohort(ranks, step if noted else None, member)
            cohort_of.update(dict.fromkeys(ranks, c))
            self._cohorts[c] = None
            if member is not None:
                self._members.update(dict.fromkeys(ranks, member))
        return True

    def _dissolve(self, c: _Cohort) -> None:
        """Each rank of cohort ``c`` its own step and its own place again (a list of its own, never
        shared): before anything reads or moves one of them alone."""
        del self._cohorts[c]
        cohort_of = self._cohort_of
        ranks = c.ranks
        for r in ranks:
            del cohort_of[r]
        if c.step is not None:
            self._last_step.update(dict.fromkeys(ranks, c.step))
        if c.member is not None:
            g, pos = c.member
            members = self._members
            for r in ranks:
                members[r] = [g, pos]

    def _aside(
        self, record: Mapping[str, Any], keys: Any, step: int, rank: int, rew: bool | None = None
    ) -> list[Finding]:
        """The record the plain way (its step already noted when ``rew`` is given), leaving the
        leader's transition in place for the followers after it."""
        led = self._led
        try:
            if rew is None:
                return self.feed_at(record, keys, step, rank)
            inputs = self._inputs(record)
            if not rew and inputs == self._noop:
                return []  # changes nothing: not a transition
            return self._move(record, step, rank, rew, inputs)
        finally:
            self._led = led

    def _seen(self, keys: Any, step: int, rank: int) -> bool:
        """Note the rank's step; True when it went back (resume, rollback: a rewind)."""
        rew = False
        rk = self._rewind_keys
        if rk is None or rk is self._gate or not keys.isdisjoint(rk):  # (past the gate: it has one)
            last = self._last_step.get(rank)
            if last is not None and step <= last:
                rew = True
                if self._fired:
                    for key, r in list(self._fired.items()):
                        if r == rank and key[0] >= step:
                            del self._fired[key]
            self._last_step[rank] = step
        return rew

    def _move(
        self, record: Mapping[str, Any], step: int, rank: int, rew: bool, inputs: tuple
    ) -> list[Finding]:
        """A transition: follow the shared state, lead it, or move the rank's own state."""
        m = self._members.get(rank)
        if m is None:
            m = self._members[rank] = [None, 0]
        g = m[0]
        if g is None:  # its first transition: the group that began with the same one, or a new one
            g = m[0] = self._place(step, inputs, rew)
        pos = m[1]
        if g.log is not None and pos < g.head:  # behind the shared state: follow it if it agrees
            e = g.log[pos - g.pos0]
            if e[0] == step and e[3] is rew and _same_sig(e[1], inputs):
                m[1] = pos + 1
                self._led = (step, rank, record, e, g, pos, rew)
                if not e[4]:
                    return []
                out: list[Finding] = []
                self._replay(out, e[4], record, rank)
                return out
            self._fork(m)  # differs: a state of its own, at its position
            g = m[0]
        if g.log is not None and len(g.log) >= _LOG_MAX:
            self._checkpoint(g)
        st = g.state
        if g.log is None:  # its own state
            self._led = None
            if rew:
                self._rewind(st, step)
            return self._apply(st, inputs, record, step, rank)
        # at the head: advance the shared state, logging the transition and the emissions it tried
        self._tried = tried = []
        try:
            if rew:
                self._rewind(st, step)
            out = self._apply(st, inputs, record, step, rank)
        finally:
            self._tried = None
        e = (step, inputs, record, rew, tuple(tried))
        g.log.append(e)
        self._led = (step, rank, record, e, g, m[1], rew)
        m[1] += 1
        return out

    def _place(self, step: int, inputs: tuple, rew: bool) -> _Group:
        """The fresh group whose first transition is this one (or that has none yet), else a new
        one."""
        if not self.share:
            return _Group(self._new_state(), None)
        for g in self._fresh:
            if not g.log:
                g.n += 1
                return g
            e = g.log[0]
            if e[0] == step and e[3] is rew and _same_sig(e[1], inputs):
                g.n += 1
                return g
        g = _Group(self._new_state(), [])
        self._fresh.append(g)
        return g

    def _checkpoint(self, g: _Group) -> None:
        """Replace the log by a copy of the state; members behind get their own state first."""
        head = g.head
        for c in [c for c in self._cohorts if c.member is not None and c.member[0] is g]:
            if c.member[1] < head:
                self._dissolve(c)  # (at the head, a cohort's one list is left as it is)
        for m in self._members.values():
            if m[0] is g and m[1] < g.head:
                self._fork(m)
        if g in self._fresh:
            self._fresh.remove(g)  # no fresh base any more: new ranks start elsewhere
        if g.n <= 1:
            g.log = None
            g.base = None
            return
        g.base = copy.deepcopy(g.state)
        g.pos0 = g.head
        g.log = []

    def _fork(self, m: list) -> None:
        """Give a member behind the shared state a state of its own, at its position."""
        g, pos = m[0], m[1]
        st = self._new_state() if g.base is None else copy.deepcopy(g.base)
        self._silent = True
        try:
            for e in g.log[: pos - g.pos0]:
                if e[3]:
                    self._rewind(st, e[0])
                self._apply(st, e[1], e[2], e[0], -1)
        finally:
            self._silent = False
        g.n -= 1
        m[0] = _Group(st, None, pos)

    def _replay(
        self, out: list[Finding], tried: tuple, record: Mapping[str, Any], rank: int
    ) -> None:
        fired = self._fired
        for key, step, value, text, severity, episode, phase in tried:
            if key not in fired:
                self._fire(out, key, record, step, rank, value, text, severity, episode, phase)

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
        if self._silent:
            return
        if self._tried is not None:
            self._tried.append(((step, kind), step, value, detail, severity, None, None))
        super()._emit(out, record, step, rank, kind, value, detail, severity)


class Shared(SharedRankedMonitor, PerRank):
    """:class:`PerRank` for a :class:`~.base.Monitor` that declares ``reads``: the ranks whose
    values of those keys agree share one copy of it. Its inputs are those values; the copy is fed
    the same ``{"step", keys}`` as ``PerRank`` feeds each rank's own, so the findings are the
    same (``tests/monitors/test_monitor_contract.py``)."""

    def __init__(self, monitor: Monitor) -> None:
        super().__init__(monitor)
        self._noop = (_MISSING_INPUT,) * len(self._spell)  # (past the gate: never all missing)

    def _inputs(self, record: Mapping[str, Any]) -> tuple:
        return self._read(record)

    def _apply(
        self, state: Monitor, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        return self._report(state.feed(self._view(step, inputs)), record, rank)


def driven(m: Any) -> Any:
    """What the supervisor's feed calls for ``m``: a :class:`~.base.Monitor` with ``reads`` in
    :class:`Shared`, one without in :class:`PerRank`, any other monitor itself. A new driver each
    call: the caller keeps it (``MonitorFeed``)."""
    if not isinstance(m, Monitor):
        return m
    return Shared(m) if m.reads is not None else PerRank(m)
