"""Straggler ranks: one rank persistently slower than the others at the same steps.

Which keys are read, in this order of trust (per rank, per step):

1. **busy time** - the first of ``busy_keys`` (``compute_s``): time the rank
   spent working, excluding waits inside collectives. Scored directly: a rank
   is slow when its busy time is ``>= (1 + margin)`` x the median of the other
   ranks at the same step. Best signal; the adapters/probe should report it.
2. **step_s - wait_s** - when a wait key (``wait_s``: time blocked in
   collectives) is reported but no busy key; scored like busy time.
3. **data-loading time** - the first of ``data_keys`` (``data_s``,
   ``data_loading_s``, ...), scored directly, on its own, when present.
4. **step_s alone** (the fallback every record has), read according to
   ``step_s_mode``:

   - ``wait_inferred`` (default): in synchronous data parallel (DDP, FSDP,
     TRL's DDP) every rank leaves the step's gradient collectives at the same
     time, so the slow rank does *not* show a longer ``step_s``: the others do,
     because they wait for it. Measured on a 2-rank gloo DDP
     (tests/data/traces/ddp_sleep_rank1.jsonl, recorded with
     tests/data/traces/ddp_slow_recorder.py): rank 1 sleeping 0.3 s before each
     step (how the ``slow`` fault and a slow data loader look) gave rank 1
     ``step_s`` ~0.01 s and rank 0 ~0.31 s when step_s is measured from the
     step's start to its end (the TRL adapter's definition), and 0.31 s on both
     when measured end-to-end (the probe's fallback). So in this mode the rank
     whose step is persistently *shorter* than the others' median by the margin
     is reported (value = others' median / its own).
   - ``busy``: read step_s as busy time (ranks that are not synchronised per
     step, e.g. independent workers). ``off``: ignore step_s.

A rank is reported when the *median* of its per-step ratios over the last
``window`` scored steps passes ``1 + margin`` and the median absolute excess is
at least ``min_excess_s`` (the noise floor of tiny CPU steps); once per episode
per (rank, signal): again only after it cleared.

Known false positives: ranks doing different work by design (pipeline stages,
rank 0 doing logging/eval/checkpoint-writing: a rank-0-only save makes the
others *wait*, which ``wait_inferred`` reads as rank 0 being slow - that is true
but expected); uneven sequence lengths per rank without packing; a noisy
neighbour for a few steps (the window median absorbs short bursts).
Known misses: with only step_s, a rank that is slow *inside* its measured step
before the collective (a slow GPU) makes every rank's step_s equal
(tests/data/traces/ddp_slowcompute_rank1.jsonl) - nothing distinguishes it
without ``compute_s``/``wait_s``; step_s measured end-to-end carries no signal
at all; a job of one rank.

A step is scored once every rank seen so far reported it and a later step was
seen, or once any rank is ``lag_steps`` past it, or at ``flush()``. The world is
the set of ranks seen (or ``world_size`` from a record that carries it). When a
rank's step goes back (restart, rollback) the monitor starts over from that step.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from typing import Any, Mapping

from .base import (
    Finding,
    first_finite,
    median,
    number,
    record_attempt,
    record_ts,
    spelled,
    step_and_rank,
)
from .config import StragglerConfig

_MAX_PENDING = 256
_INF = float("inf")


class StragglerMonitor:
    name = "straggler"

    def __init__(self, cfg: StragglerConfig | None = None) -> None:
        self.cfg = cfg or StragglerConfig()
        c = self.cfg
        self._busy = tuple(spelled(k) for k in c.busy_keys)
        self._wait = tuple(spelled(k) for k in c.wait_keys)
        self._data = tuple(spelled(k) for k in c.data_keys)
        self._step_name = c.step_key + ("~wait" if c.step_s_mode == "wait_inferred" else "")
        self._step_key = c.step_key
        self._step_on = c.step_s_mode != "off"
        # every spelling of each key group: a record with none of a group skips its lookups (one C
        # test)
        self._busy_any = frozenset(k for sp in self._busy for k in sp if k)
        self._wait_any = frozenset(k for sp in self._wait for k in sp if k)
        self._data_any = frozenset(k for sp in self._data for k in sp if k)
        self._special = self._busy_any | self._wait_any | self._data_any
        self._thr = 1 + c.margin
        self.reset()

    def reset(self) -> None:
        self._known: set[int] = set()
        self._world: int | None = None
        self._last: dict[int, int] = {}
        self._floor = -(1 << 62)  # steps <= floor are scored (or given up)
        self._pending: dict[int, dict[int, tuple[dict[str, float], Mapping[str, Any]]]] = {}
        self._hist: dict[
            str, dict[int, _Hist]
        ] = {}  # signal -> rank -> its last ``window`` scored steps
        self._latched: set[tuple[int, str]] = set()
        self._newest = -(
            1 << 62
        )  # max(self._last.values()), kept as _last changes (was O(ranks) a record)
        self._expected_memo: tuple[tuple, set[int]] | None = None

    # ------------------------------------------------------------ signals

    def _signals(self, record: Mapping[str, Any], keys: Any) -> dict[str, float]:
        sig: dict[str, float] = {}
        busy = None
        if not keys.isdisjoint(self._busy_any):
            key, busy = first_finite(record, self._busy)
        if busy is not None:
            sig[key or "busy"] = busy
        else:
            step_s = record.get(self._step_key)
            if type(step_s) is not float:  # number()'s common case inline
                step_s = number(step_s)
            wait = None
            if not keys.isdisjoint(self._wait_any):
                wkey, wait = first_finite(record, self._wait)
            if wait is not None and step_s is not None and step_s == step_s:
                sig[f"{self._step_key}-{wkey}"] = max(step_s - wait, 0.0)
            elif step_s is not None and step_s == step_s and step_s != _INF and self._step_on:
                sig[self._step_name] = step_s
        if keys.isdisjoint(self._data_any):
            return sig
        dkey, data = first_finite(record, self._data)
        if data is not None:
            sig[dkey or "data"] = data
        return sig

    # ------------------------------------------------------------ feeding

    def feed(self, record: Mapping[str, Any]) -> list[Finding]:
        step, rank = step_and_rank(record)  # the live path parses once for every monitor: feed_at
        return [] if step is None else self.feed_at(record, record.keys(), step, rank)

    def feed_at(self, record: Mapping[str, Any], keys: Any, step: int, rank: int) -> list[Finding]:
        """``feed`` of a record already parsed (``keys()``, step, rank: see ``fast_entries``)."""
        ws = record.get("world_size")
        if ws is not None and isinstance(ws, int) and ws > 0:
            self._world = ws
        last = self._last.get(rank)
        if last is None:
            self._known.add(rank)  # the ranks of _last (no other way in or out but reset)
        elif step <= last:
            self._restart(step)
        self._last[rank] = step
        if step > self._newest:
            self._newest = step
        if step <= self._floor:
            return []
        pending = self._pending
        pend = pending.get(step)
        if pend is None:
            pend = pending[step] = {}
        if keys.isdisjoint(
            self._special
        ):  # step_s alone (most records): _signals' last branch, inlined
            step_s = record.get(self._step_key)
            if type(step_s) is not float:
                step_s = number(step_s)
            sig = (
                {self._step_name: step_s}
                if step_s is not None and step_s == step_s and step_s != _INF and self._step_on
                else {}
            )
        else:
            sig = self._signals(record, keys)
        pend[rank] = (sig, record)
        if len(pending) == 1 and step == self._newest and self._world is None:
            # only this step pending, nothing past it yet: not complete, not lagging (most records)
            return []
        return self._score_ready()

    def flush(self) -> list[Finding]:
        """Score every pending step (end of a replay)."""
        out: list[Finding] = []
        for s in sorted(self._pending):
            out.extend(self._score(s))
        return out

    def _restart(self, step: int) -> None:
        """The run redoes ``step``: every rank will, so start over from there."""
        self._pending = {s: v for s, v in self._pending.items() if s < step}
        for by_rank in self._hist.values():
            for h in by_rank.values():
                h.rewind(step)
        self._latched.clear()
        self._floor = min(self._floor, step - 1)
        for r in self._last:
            self._last[r] = min(self._last[r], step - 1)
        self._newest = max(self._last.values(), default=-(1 << 62))

    def _expected(self) -> set[int]:
        if self._world is not None:
            # _known only grows between resets: (world, its size) names the set; built once, not per
            # record
            key = (self._world, len(self._known))
            memo = self._expected_memo
            if memo is None or memo[0] != key:
                memo = self._expected_memo = (key, set(range(self._world)) | self._known)
            return memo[1]
        return self._known

    def _score_ready(self) -> list[Finding]:
        out: list[Finding] = []
        pending = self._pending
        if not pending:
            return out
        newest = self._newest
        expected = self._expected()
        lag = self.cfg.lag_steps
        world = self._world
        for s in sorted(pending):
            ranks = pending[s]
            # the length first; then ``keys() >=`` tests expected's members in the dict (issubset of
            # a dict would build a set of it)
            complete = (
                len(ranks) >= len(expected)
                and ranks.keys() >= expected
                and (newest > s or world is not None)
            )
            if complete or newest >= s + lag or len(pending) > _MAX_PENDING:
                out.extend(self._score(s))
            else:
                break
        return out

    # ------------------------------------------------------------ scoring

    def _score(self, s: int) -> list[Finding]:
        ranks = self._pending.pop(s, None)
        self._floor = max(self._floor, s)
        out: list[Finding] = []
        if not ranks or len(ranks) < 2:
            return out
        cfg = self.cfg
        window = cfg.window
        thr = self._thr
        need = (
            window - window // 2
        )  # a median over the window reaches thr only if this many values do
        latched = self._latched
        names: set[str] = set()
        for sig, _ in ranks.values():
            names.update(sig)
        for name in sorted(names):
            vals = {r: sig[name] for r, (sig, _) in ranks.items() if name in sig}
            if len(vals) < 2:
                continue
            inferred = name.endswith("~wait")
            srt = sorted(vals.values())
            n = len(srt)
            mid = (n - 1) // 2
            odd = (n - 1) % 2
            hist = self._hist.get(name)
            if hist is None:
                hist = self._hist[name] = {}
            # the median of the others (srt without one v) takes two values (three for an odd
            # count), picked by where v sorts (bisect_left(srt, v) > mid <=> srt[mid] < v); computed
            # once here. With a NaN the order means nothing: then _median_without for each rank
            plain = all(x == x for x in srt)
            if plain:
                sm = srt[mid]
                if odd:
                    above, below = sm, srt[mid + 1]
                elif n > 1:
                    sl = srt[mid - 1]
                    above, at, below = (
                        0.5 * (sl + sm),
                        0.5 * (sl + srt[mid + 1]),
                        0.5 * (sm + srt[mid + 1]),
                    )
            for r, v in vals.items():
                if not plain:
                    others = _median_without(srt, v)
                elif odd:
                    others = above if sm < v else below
                # (i > mid: above; i == mid: at; i < mid: below, as the inlined bisect had it)
                else:
                    others = above if sm < v else at if sl < v else below
                if inferred:  # the others waited for r: their step is longer than r's
                    ratio = others / v if v > 0 else (_INF if others > 0 else 1.0)
                    excess = others - v
                else:
                    ratio = v / others if others > 0 else (_INF if v > 0 else 1.0)
                    excess = v - others
                h = hist.get(r)
                if h is None:
                    h = hist[r] = _Hist(window, thr)
                q = h.q  # h.add, inlined
                if q and q[-1][0] >= s:
                    h.rewind(s)
                if len(q) == window:
                    old = q[0][1]
                    if old >= thr:
                        h.nge -= 1
                    elif old != old:
                        h.nnan -= 1
                q.append((s, ratio, excess))
                if ratio >= thr:
                    h.nge += 1
                elif ratio != ratio:
                    h.nnan += 1
                if len(q) < window:
                    continue
                # most steps of a healthy run: too few ratios past thr for the median to be (a NaN
                # ratio sorts anywhere: then the median decides)
                if h.nge < need and not h.nnan:
                    slow = False
                else:
                    med_ratio = median([x[1] for x in h.q])
                    # the excess is needed only when the ratio passes (most steps of a healthy run
                    # it does not)
                    slow = med_ratio >= thr and median([x[2] for x in h.q]) >= cfg.min_excess_s
                if not slow:
                    if latched:
                        latched.discard((r, name))
                    continue
                key = (r, name)
                if key in latched:
                    continue
                latched.add(key)
                med_excess = median([x[2] for x in h.q])
                rec = ranks[r][1]
                first = h.q[0][0]
                if inferred:
                    detail = (
                        f"rank {r}: the other ranks' {cfg.step_key} is {med_ratio:.2f}x its own "
                        f"(+{med_excess:.3f} s, median over steps {first}-{s}): they wait for "
                        f"rank {r} in the "
                        "collectives; its slowness lies outside its measured step (data "
                        "loading, host stall)"
                    )
                    signal = cfg.step_key
                else:
                    detail = (
                        f"rank {r}: {name} is {med_ratio:.2f}x the other ranks' median "
                        f"(+{med_excess:.3f} s, median over steps {first}-{s})"
                    )
                    signal = name
                out.append(
                    Finding(
                        "straggler",
                        s,
                        med_ratio,
                        f"{detail} [signal {signal}]",
                        "warning",
                        r,
                        record_attempt(rec),
                        record_ts(rec),
                    )
                )
        return out


class _Hist:
    """One rank's last ``window`` scored steps of one signal, (step, ratio, excess), with how many
    ratios reach ``thr`` (and how many are NaN), kept as values enter and leave."""

    __slots__ = ("q", "thr", "nge", "nnan")

    def __init__(self, window: int, thr: float) -> None:
        self.q: deque = deque(maxlen=window)
        self.thr = thr
        self.nge = 0
        self.nnan = 0

    def _drop(self, ratio: float) -> None:
        if ratio >= self.thr:
            self.nge -= 1
        elif ratio != ratio:
            self.nnan -= 1

    def rewind(self, step: int) -> None:
        q = self.q
        while q and q[-1][0] >= step:
            self._drop(q.pop()[1])

    def add(self, s: int, ratio: float, excess: float) -> None:
        q = self.q
        if q and q[-1][0] >= s:
            self.rewind(s)
        if len(q) == q.maxlen:
            self._drop(q[0][1])
        q.append((s, ratio, excess))
        if ratio >= self.thr:
            self.nge += 1
        elif ratio != ratio:
            self.nnan += 1


def _median_without(srt: list[float], v: float) -> float:
    """The median of sorted ``srt`` with one ``v`` taken out, without building that list (any
    occurrence of an equal value leaves the same multiset, so the result is bit-identical)."""
    i = bisect_left(srt, v)
    if i == len(srt) or srt[i] != v:  # v is a NaN (no match): fall back to the plain way
        rest = list(srt)
        for j, x in enumerate(rest):
            if x is v or (x != x and v != v):
                del rest[j]
                break
        return median(rest)
    m = len(srt) - 1
    if m == 0:
        return math.nan
    mid = m // 2

    def at(j: int) -> float:
        return srt[j] if j < i else srt[j + 1]

    return at(mid) if m % 2 else 0.5 * (at(mid - 1) + at(mid))
