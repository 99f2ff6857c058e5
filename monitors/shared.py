"""Ranks that report the same values share one monitor state (``SharedRankedMonitor``), and a feed
that moves all such states at once for a rank that repeats its step's first rank (``Lockstep``).

Why a file of its own: the ranks of one run report the same global values (TRL gathers them,
TorchTitan logs the global loss), so one state per rank repeats the same work world-size times;
following one state exactly (a rank that diverges later gets its own, rebuilt from a logged copy) is
its own machinery, apart from the monitor contract in ``base.py``. Pure like every monitor: no ptops
imports, no I/O.
"""

from __future__ import annotations

import copy
import math
from operator import itemgetter
from typing import Any, Mapping

from .base import Finding, RankedMonitor, Severity, finite_of, record_attempt, record_ts

_LOG_MAX = 1024  # transitions kept before a checkpoint (a copy of the shared state) replaces them
_RESETS = [
    0
]  # SharedRankedMonitor.reset calls so far (any monitor): Lockstep drops its cached member entries
_LAZY = object()  # a logged transition's raw-value fingerprint, not taken yet (``_fingerprint``)
_JOIN_WINDOW = 4  # transitions a fresh group with one member keeps logging for other ranks to join


def _same_sig(a: tuple, b: tuple) -> bool:
    """The same inputs: equal, and equal as what a monitor makes of them. Inputs are parsed (floats,
    None, strings), where -0.0 == 0.0 (but may print differently) is the one trap; raw values
    (``_raw_keys``) are checked for 1, 1.0 and True too (equal, but True is no number)."""
    return a == b and (0.0 not in b or _strict_same(a, b))


def _strict_same(a: tuple, b: tuple) -> bool:
    return all(
        type(x) is type(y)
        and (type(x) is not float or x != 0.0 or math.copysign(1.0, x) == math.copysign(1.0, y))
        for x, y in zip(a, b)
    )


class _Node:
    """The state that ranks with the same inputs so far share, and how to get any member's state
    back.

    ``state`` is the state after ``pos`` transitions; ``base`` a copy of the state after ``pos0``
    (None: the fresh state, pos0 == 0); ``log[i]`` the transition ``pos0 + i``: (step, inputs,
    record, rewound, emissions tried, the raw values' fingerprint (getter, values, absent keys,
    whether a value equals 0 or 1) or None). A member at an earlier position catches up by checking
    that its inputs are the logged ones and replaying the emissions tried (deduplicated as its own
    ``_check`` would be); a member whose inputs differ gets its own state: the base, replayed up to
    its position."""

    __slots__ = ("state", "pos", "pos0", "base", "log", "n", "head")

    def __init__(self, state: Any, pos: int, log: list | None) -> None:
        self.state = state
        self.pos = pos
        self.pos0 = pos
        self.base: Any = None
        self.log = log
        self.n = 1  # members
        self.head = 1  # members at ``pos``


class SharedRankedMonitor(RankedMonitor):
    """A :class:`RankedMonitor` whose ranks share one state while their inputs agree.

    Why: the keys these monitors read are global (TRL gathers them across ranks, TorchTitan logs the
    global loss and norm), so N ranks would compute the same thing N times. Exact: a rank follows
    the shared state only while every (step, inputs, rewind) it feeds equals what the state was
    advanced with, and gets the same findings its own state would have given (the emissions the
    first rank tried are replayed for it, against the same once-per-(step, kind) table); a rank that
    diverges gets a state of its own, rebuilt from the last checkpoint. Ranks that differ from their
    first record on (several runs' worth of ranks in one stream) group by their first transition.
    Subclasses implement ``_inputs(record)`` (a tuple of everything ``_apply`` reads from the
    record) and ``_apply(state, inputs, record, step, rank)``, which reads ``record`` only for the
    findings' ``attempt``/``ts``.
    """

    # Optional (``_set_raw_keys``): every key (all spellings) whose value ``_inputs`` reads or whose
    # presence it tests; records with the same raw values there (missing told apart) give the same
    # inputs, so a follower compares those instead of parsing. ``_raw_ok``, set by the monitor
    # before each feed, says whether that holds for the record (e.g. only without held-out eval
    # keys). Worth it only when ``_inputs`` costs more than a map over the keys.
    share = (
        True  # False: every rank keeps its own state (the reference the tests compare sharing with)
    )
    # on the class that defines ``feed_at``: it is this follower path, or a wrapper that, for a
    # record with the keys and the read values of the record that just advanced the rank's state,
    # does nothing else (``Lockstep``)
    _lockstep = True
    # for a monitor with neither ``_raw_keys`` nor ``_one_key``: keys whose values, with the
    # record's key set, decide its inputs (``Lockstep`` compares them), or None (it never follows
    # there)
    _lockstep_keys: tuple[str, ...] | None = None
    _raw_keys: tuple[str, ...] | None = None
    _raw_ok = True
    # a key that makes a record idle for the monitor: it only sets the rank's last step (``m[2]``)
    # unless it rewinds, as the monitor's ``feed_at`` does itself (Lockstep does that for a follower
    # of a step whose records have it)
    _idle_key: str | None = None
    # inputs with which ``_apply`` changes nothing and finds nothing (no value to read): such a
    # record is no transition at all (unless it rewinds), for the first rank and the followers alike
    _noop: tuple = (None,)
    # a monitor whose inputs are ``(finite_of(record, _one_key),)``: read inline, without a call
    _one_key: tuple[str, str | None] | None = None

    def _set_raw_keys(self, *keys: str | None) -> None:
        out: list[str] = []
        for k in keys:
            if k:
                out += [k, k.replace("/", "_")]
        self._raw_keys = tuple(dict.fromkeys(out))
        self._layout: tuple | None = None

    def reset(self) -> None:
        super().reset()
        _RESETS[0] += 1  # (Lockstep's cached member entries of every monitor are void)
        self._members: dict[int, list] = {}  # rank -> [node, position]
        self._fresh: list[
            _Node
        ] = []  # logging nodes that started from the fresh state (new ranks join one)
        self._tried = None
        self._silent = False
        self._led: tuple | None = (
            None  # (record, node, position after it): the last transition Lockstep may lead
        )

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
        m = self._members.get(rank)
        if m is None:
            return None
        if m[1] < m[0].pos:
            self._fork(m)
        return m[0].state

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        gate = self._gate
        if gate is not None and keys.isdisjoint(gate):
            return []
        m = self._members.get(rank)  # [node, position, last step]
        if m is None:
            m = self._members[rank] = [None, 0, None]
            self._place(m, None)
        rew = False
        rk = self._rewind_keys
        if rk is None or rk is gate or not keys.isdisjoint(rk):  # (a record past the gate has one)
            last = m[2]
            if last is not None and step <= last:
                rew = True
                if self._fired:
                    for key, r in list(self._fired.items()):
                        if r == rank and key[0] >= step:
                            del self._fired[key]
            m[2] = step
        node = m[0]
        pos = m[1]
        inputs = None
        if (
            node.log is not None and pos < node.pos
        ):  # behind the shared state: follow it if the inputs agree
            e = node.log[pos - node.pos0]
            if e[0] == step and e[3] is rew:
                # with _raw_keys, first the raw values the inputs come from: equal raw values, equal
                # inputs, without parsing them (one C-level map; for monitors whose inputs cost more
                # than that)
                same = False
                get = e[5]
                if (
                    get is _LAZY
                ):  # the first follower of this transition: the leader's raw values, once
                    e = node.log[pos - node.pos0] = self._fingerprint(e)
                    get = e[5]
                if get is not None and self._raw_ok:
                    # (the keys present in the first rank's record, as one itemgetter; their values;
                    # the absent keys, None when none)
                    try:
                        vals = get(record)
                    except KeyError:
                        vals = None
                    # (values equal to the leader's hold a 0 or a 1 only where its do: e[8], tested
                    # once)
                    same = (
                        vals == e[6]
                        and (e[7] is None or keys.isdisjoint(e[7]))
                        and (not e[8] or _strict_same(e[6], vals))
                    )
                if not same:
                    ei = e[
                        1
                        # _same_sig, inlined (inputs are parsed: floats, None, strings; -0.0 == 0.0
                        # the one trap)
                    ]
                    one = self._one_key
                    if (
                        one is not None
                    ):  # one finite float under the key's first spelling: the common case
                        v = record.get(one[0])
                        if type(v) is not float or v - v != 0.0:
                            v = finite_of(record, one)
                            if v is None and not rew:
                                # changes nothing: not a transition (the leader logged none either)
                                return []
                        inputs = (v,)
                        same = ei[0] == v and (v or _strict_same(ei, inputs))
                    else:
                        inputs = self._inputs(record)
                        if not rew and inputs == self._noop:
                            # changes nothing: not a transition (the leader logged none either)
                            return []
                        same = ei == inputs and (0.0 not in inputs or _strict_same(ei, inputs))
                if same:
                    pos += 1
                    m[1] = pos
                    if pos == node.pos:
                        node.head += 1
                    if e[4]:
                        out: list[Finding] = []
                        self._replay(out, e[4], record, rank)
                        return out
                    return []
            if inputs is None:
                inputs = self._inputs(record)
                if not rew and inputs == self._noop:
                    return []
            if pos:
                self._fork(m)
                return self._solo(m[0].state, inputs, record, step, rank, rew)
            self._place(m, (step, inputs, rew))  # differs from its first record on: another group
            node = m[0]
            if node.pos:  # a group whose first transition is this one
                return self._follow(m, node, node.log[0], record, rank)
        if inputs is None:
            one = self._one_key
            if one is not None:
                v = record.get(one[0])
                inputs = (v,) if type(v) is float and v - v == 0.0 else (finite_of(record, one),)
            else:
                inputs = self._inputs(record)
            if not rew and inputs == self._noop:
                return []  # changes nothing: not a transition
        if node.log is None:  # alone for good: the plain path
            st = node.state
            if rew:
                self._rewind(st, step)
            return self._apply(st, inputs, record, step, rank)
        if node.n == 1 and node.pos0 == 0 and node.pos >= _JOIN_WINDOW:
            self._stop_logging(node)  # nobody joined
            return self._solo(node.state, inputs, record, step, rank, rew)
        # at the head: advance the shared state, logging the transition
        if len(node.log) >= _LOG_MAX:
            self._checkpoint(node)
        if node.log is None:
            return self._solo(node.state, inputs, record, step, rank, rew)
        st = node.state
        self._tried = tried = []
        try:
            if rew:
                self._rewind(st, step)
            out = self._apply(st, inputs, record, step, rank)
        finally:
            self._tried = None
        # (step, inputs, record, rewound, tried, then _LAZY: the raw values decide the inputs, their
        # fingerprint is taken from the record by the first follower that needs it
        # (``_fingerprint``; a follower that Lockstep moves on never does), else None)
        raw = self._raw_keys is not None and self._raw_ok
        node.log.append(
            (step, inputs, record, rew, tuple(tried) if tried else (), _LAZY if raw else None)
        )
        pos = node.pos = node.pos + 1
        m[1] = pos
        node.head = 1
        # a transition that other ranks repeating this record can follow in Lockstep: no rewind, no
        # finding tried, its inputs decided by the values Lockstep compares (for _raw_keys: only
        # when they decide them)
        self._led = (
            (record, node, pos)
            if not rew and not tried and (raw or self._raw_keys is None)
            else None
        )
        return out

    def _fingerprint(self, e: tuple) -> tuple:
        """The logged transition ``e`` with the raw values of its record: (..., getter, values,
        absent keys or None, whether a value equals 0 or 1: -0.0/0/False, 1/True need the strict
        test)."""
        record = e[2]
        rk = self._raw_keys
        lay = (
            self._layout
        )  # (getter of the present keys, the absent keys): the last record's, mostly the same
        vals = None
        if lay is not None and (lay[1] is None or record.keys().isdisjoint(lay[1])):
            try:
                vals = lay[0](record)
            except KeyError:
                vals = None
        if vals is None:
            present = ("step",) + tuple(
                [k for k in rk if k in record]
            )  # "step": the getter returns a tuple
            absent = tuple([k for k in rk if k not in present])
            lay = self._layout = (itemgetter(*present), absent or None)
            vals = lay[0](record)
        return e[:5] + (lay[0], vals, lay[1], 0 in vals or 1 in vals)

    def _follow(
        self, m: list, node: _Node, e: tuple, record: Mapping[str, Any], rank: int
    ) -> list[Finding]:
        """Catch up with the logged transition ``e`` (the same inputs): the findings it tried, no
        work."""
        pos = m[1] + 1
        m[1] = pos
        if pos == node.pos:
            node.head += 1
        out: list[Finding] = []
        if e[4]:
            self._replay(out, e[4], record, rank)
        return out

    def _solo(
        self, st: Any, inputs: tuple, record: Mapping[str, Any], step: int, rank: int, rew: bool
    ) -> list[Finding]:
        if rew:
            self._rewind(st, step)
        return self._apply(st, inputs, record, step, rank)

    def _place(self, m: list, first: tuple | None) -> None:
        """Put a rank at position 0 of a fresh group whose first transition is ``first`` (or that
        has none yet), else of a new fresh group that logs; leaves its old group (if any)."""
        old = m[0]
        if not self.share:
            m[0] = _Node(self._new_state(), 0, None)
            return
        target = None
        for node in self._fresh:
            if node is old or node.log is None or node.pos0 != 0:
                continue
            if node.pos == 0 or first is None:
                target = node
                break
            e = node.log[0]
            if e[0] == first[0] and e[3] is first[2] and _same_sig(e[1], first[1]):
                target = node
                break
        if old is not None:
            self._leave(old)
        if target is None:
            target = _Node(self._new_state(), 0, [])
            target.n = 0
            target.head = 0
            self._fresh.append(target)
        target.n += 1
        if target.pos == 0:
            target.head += 1
        m[0] = target
        m[1] = 0

    def _leave(self, node: _Node) -> None:
        """A member behind the head left ``node``."""
        node.n -= 1
        if node.n == 1 and node.head == 1:  # the one left is at the head: nobody to log for
            self._stop_logging(node)

    def _stop_logging(self, node: _Node) -> None:
        node.log = None
        node.base = None
        if node in self._fresh:
            self._fresh.remove(node)

    def _checkpoint(self, node: _Node) -> None:
        """Replace the log by a copy of the state; members behind get their own state first."""
        if node.head < node.n:
            for m in list(self._members.values()):
                if m[0] is node and m[1] < node.pos:
                    self._fork(m)
        if node.log is None:
            return
        if node.n <= 1:
            self._stop_logging(node)
            return
        node.base = copy.deepcopy(node.state)
        node.pos0 = node.pos
        node.log = []
        if node in self._fresh:
            self._fresh.remove(node)  # no fresh base any more: new ranks start elsewhere

    def _fork(self, m: list) -> None:
        """Give a member behind the shared state a state of its own, at its position."""
        node, pos = m[0], m[1]
        st = self._new_state() if node.base is None else copy.deepcopy(node.base)
        self._silent = True
        try:
            for e in node.log[: pos - node.pos0]:
                if e[3]:
                    self._rewind(st, e[0])
                self._apply(st, e[1], e[2], e[0], -1)
        finally:
            self._silent = False
        self._leave(node)
        m[0] = _Node(st, pos, None)
        m[1] = pos

    def _replay(
        self, out: list[Finding], tried: tuple, record: Mapping[str, Any], rank: int
    ) -> None:
        fired = self._fired
        for key, step, value, text, severity, episode, phase in tried:
            if key in fired:
                continue
            fired[key] = rank
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
                    episode=episode,
                    phase=phase,
                )
            )

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


class Lockstep:
    """Followers of the step's first rank, in every shared monitor at once: the live feed's fast
    path.

    Why: in one run the ranks log the same global values, so 7 of 8 records only follow the shared
    states (``SharedRankedMonitor``), and each shared monitor checking that on its own (its gate,
    the rank's place, the rewind, the raw values) cost ~1 µs a record. Here a record is compared
    once with the step's leader (its first record, when that advanced at least two shared states:
    the same keys, the same values under every key the shared monitors read, none of them rewinding
    or trying a finding), and the rank is moved on in each state the leader advanced, where it stood
    just behind it. Exact: that is what each monitor's ``feed_at`` would conclude and do for such a
    record (its follower path, return ``[]``); anything else goes to the monitors.

    ``calls``: (monitor, fast entry) pairs as ``MonitorFeed`` runs them. ``follow`` returns the
    pairs still to run for the record (the monitors it did not advance), or None (run them all, then
    ``lead``).
    """

    def __init__(self, calls: list) -> None:
        self._calls = list(calls)
        # a monitor qualifies when its fast entry is SharedRankedMonitor's follower path, possibly
        # behind a wrapper that its class declares to change nothing for such a record
        # (``_lockstep``)
        self.monitors = [
            m
            for m, f in self._calls
            if isinstance(m, SharedRankedMonitor)
            and m.share
            and getattr(f, "__self__", None) is m
            and getattr(f, "__func__", None) is type(m).feed_at
            and _lockstep_of(type(m))
            and _read_keys(m) is not None
        ]
        # (``monitors``: the shared monitors it can move a rank on in.) ``_reads``: each one and the
        # keys that make a record rewind it (None: every record; its gate is, as a record past the
        # gate has one)
        self._reads = [
            (m, None if m._rewind_keys is m._gate else m._rewind_keys) for m in self.monitors
        ]
        self._idlers = [m for m in self.monitors if m._idle_key]
        self._step: int | None = None
        # (monitor, node, position after the leader, whether the leader set its last step, the
        # position before it)
        self._adv: list = []
        self._rest: list = self._calls
        self._keys: Any = None
        self._get: Any = None
        self._vals: Any = None
        # (index, the leader's value) of the leader's values equal to 0 or 1
        self._strict: tuple = ()
        self._who: list = []  # the monitors of ``_adv`` when ``_rest`` and ``_get`` were built
        # rank -> its member entry ([node, position, last step]) in each monitor of ``_who``: a
        # monitor keeps a rank's entry (a list changed in place) until reset, which makes
        # ``_members`` a new dict (and counts)
        self._ms: dict[int, list] = {}
        self._resets = _RESETS[0]

    def follow(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list | None:
        adv = self._adv
        if step != self._step or not adv or keys != self._keys or _RESETS[0] != self._resets:
            return None
        try:
            vals = self._get(record)
        except KeyError:
            return None
        if vals != self._vals:
            return None
        for (
            i,
            v,
        ) in (
            self._strict
        ):  # equal to a 0 or a 1: the same type (True is no number), the same zero's sign
            w = vals[i]
            if type(w) is not type(v) or (
                type(v) is float and math.copysign(1.0, v) != math.copysign(1.0, w)
            ):
                return None
        ms = self._ms.get(rank)
        if ms is None:
            ms = [m._members.get(rank) for m in self._who]
            if any(m is None for m in ms):
                return None  # a rank new to one of them: all take the record their own way
            self._ms[rank] = ms
        n = len(adv)
        for i, m in enumerate(ms):
            if i < n:
                _, node, pos, sets_last, prev = adv[i]
                if (
                    m[0] is node
                    and m[1] == prev
                    and node.pos == pos
                    and node.log is not None
                    and not (sets_last and m[2] is not None and step <= m[2])
                ):  # (the last: a rewind for this rank)
                    m[1] = pos
                    node.head += 1
                    if sets_last:
                        m[2] = step
                    continue
            elif (
                m[2] is None or step > m[2]
            ):  # idle: no rewind, so its last step is all that changes
                m[2] = step
                continue
            if not i:
                return None
            # the monitors before it moved the rank on: the others take the record their own way
            done = {id(mon) for mon in self._who[:i]}
            return [c for c in self._calls if id(c[0]) not in done]
        return self._rest

    def lead(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> None:
        """After the monitors took ``record`` (not a follower): it leads its step if it advanced
        shared states (the first such record of a step does)."""
        if (
            step == self._step
        ):  # one leader a step (a record after it that did not follow: its own way)
            return
        self._step = step
        adv: list = []
        for mon, rk in self._reads:
            led = (
                mon._led
            )  # set by the transition this record made, if it made one Lockstep can follow
            if led is None or led[0] is not record:
                continue
            _, node, pos = led
            adv.append((mon, node, pos, rk is None or not keys.isdisjoint(rk), pos - 1))
        if (
            len(adv) < 2
        ):  # one state to follow: its own follower path costs less than the comparison here
            adv = []
        self._adv = adv
        if not adv:  # follow() stops at once; _rest and _get stay built for _who
            return
        # the calls left and the getter depend on which monitors it advanced and on its keys: mostly
        # the last ones. After them the idle ones: a record with their ``_idle_key`` changes nothing
        # in them but the rank's last step
        who = [a[0] for a in adv]
        who += [m for m in self._idlers if m._idle_key in keys and m not in who]
        if who != self._who or keys != self._keys or _RESETS[0] != self._resets:
            self._who = who
            self._ms = {}
            self._resets = _RESETS[0]
            done = {id(m) for m in who}
            self._rest = [c for c in self._calls if id(c[0]) not in done]
            read = [k for m in who[: len(adv)] for k in _read_keys(m)]
            present = ("step",) + tuple(
                [k for k in dict.fromkeys(read) if k in record]
            )  # "step": a tuple back
            self._get = itemgetter(*present)
            self._keys = set(keys)
        self._vals = vals = self._get(record)
        # -0.0/0/False, 1/True: equal values, maybe other inputs. Only these positions: elsewhere
        # equal values of two types (2 and 2.0) parse alike, as they do when no value is 0 or 1
        # (where nothing is checked)
        self._strict = (
            tuple([(i, v) for i, v in enumerate(vals) if v == 0 or v == 1])
            if 0 in vals or 1 in vals
            else ()
        )


def _read_keys(mon: SharedRankedMonitor) -> tuple | list | None:
    """The record keys whose values decide the monitor's inputs (with the record's key set), or
    None: it never follows in lockstep."""
    if mon._raw_keys is not None:
        return mon._raw_keys
    if mon._one_key is not None:
        return [k for k in mon._one_key if k]
    return mon._lockstep_keys


def _lockstep_of(cls: type) -> bool:
    """Whether the class that defines ``cls.feed_at`` declares it a plain wrapper for
    ``Lockstep``."""
    for c in cls.__mro__:
        if "feed_at" in c.__dict__:
            return bool(c.__dict__.get("_lockstep"))
    return False
