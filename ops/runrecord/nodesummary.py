"""Which of a node's step records are routine, and the one summary entry that stands for them.

Why a module of its own: two places apply the same rule and must agree byte for byte: the
supervisor's ``metrics.jsonl`` writer (``[supervisor] metrics_rank_detail_every = K``: the file is
sampled, the monitors still read every record) and the node agent's batcher
(``[supervisor] node_summaries = true``: the routine ranks never leave the node between samples,
so the supervisor's work a step grows with nodes, not ranks; docs/scale.md). The writer's file of
a run is the same either way when the ranks differ only in keys the shared monitors do not read
(tests/supervisor/test_node_summaries.py).

The rule, on a step that is not a multiple of K: a follower (a record equal to its step's first
record of the batch, the leader, but for the keys of its ``diff``) is routine when it is not rank
0 (status, resume and goodput read rank 0), lacks no key of its leader's and differs only in
finite numbers (and, on the wire, in no key of ``read``: the keys the supervisor's shared
monitors read, which it could not rebuild); the leader is routine with them when every follower
is, it is not rank 0 and holds no NaN or inf. A summary entry is ``{"step", "ranks": [...],
"keys": {KEY: [min, min's rank, low median, max, max's rank]}}`` over the ranks left out.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


def sum_up(
    lead: dict[str, Any], followers: list, every: int, read: Iterable[str] | None = ()
) -> tuple[bool, list[int], dict[str, Any] | None]:
    """(the leader left out?, the places in ``followers`` left out, their summary entry or None).
    ``followers``: (record, diff) in order; ``read``: keys a follower may not differ in to be
    left out (None: any key, so none is)."""
    if every <= 1 or read is None:
        return False, [], None
    read = frozenset(read) - {"rank"}
    out = [
        i
        for i, (rec, diff) in enumerate(followers)
        if read.isdisjoint(diff) and routine(rec, diff, lead, every)
    ]
    if not out:
        return False, [], None
    lead_out = len(out) == len(followers) and routine_leader(lead, every)
    ranks = ([lead["rank"]] if lead_out else []) + [followers[i][0]["rank"] for i in out]
    diffs = {followers[i][0]["rank"]: followers[i][1] for i in range(len(followers))}
    return lead_out, out, spread(lead, ranks, diffs)


def between_samples(rec: dict[str, Any], every: int) -> bool:
    """A step record of a rank but 0, on a step that is not a multiple of ``every``."""
    step, rank = rec.get("step"), rec.get("rank")
    return type(step) is int and step % every != 0 and type(rank) is int and rank != 0


def routine(rec: dict[str, Any], diff: dict[str, Any], lead: dict[str, Any], every: int) -> bool:
    if not between_samples(rec, every):
        return False
    for k, v in diff.items():  # finite_number inlined: a relay asks this of 511 ranks a step
        t = type(v)
        if k != "rank" and (k not in lead or not (t is int or (t is float and _finite(v)))):
            return False
    return True


def routine_leader(rec: dict[str, Any], every: int) -> bool:
    return between_samples(rec, every) and not any(
        type(v) is float and not math.isfinite(v) for v in rec.values()
    )


_finite = math.isfinite


def finite_number(v: Any) -> bool:
    return type(v) is int or (type(v) is float and math.isfinite(v))  # a bool is not an int here


_NUMBERS = frozenset((int, float))  # exactly: a bool is not a number here


def _all_finite(vals: list) -> bool:
    """No NaN or inf among ints and floats: one sum (any NaN or inf makes it NaN or inf), each
    value looked at only when it is not finite or an int too large for a float overflowed it."""
    try:
        if _finite(sum(vals)):
            return True
    except OverflowError:
        pass
    return all(type(v) is int or _finite(v) for v in vals)


def spread(lead: dict[str, Any], ranks: list, diffs: dict) -> dict[str, Any]:
    """The summary entry over ``ranks``, for each key that differs in the group (``step_s``
    always), a rank's value its diff's or else its leader's."""
    names = {k for d in diffs.values() for k in d if k != "rank"}
    if "step_s" in lead:
        names.add("step_s")
    keys = {}
    own = [diffs.get(r) for r in ranks]  # a rank's diff, or None: its leader's values
    for k in sorted(names):  # (keys x ranks a step on a relay: no Python call a value)
        lv = lead.get(k)
        vals = [lv if d is None else d.get(k, lv) for d in own]
        if not _NUMBERS.issuperset(map(type, vals)) or not _all_finite(vals):
            continue
        pairs = sorted(zip(vals, ranks))
        lo, hi = pairs[0], pairs[-1]
        keys[k] = [lo[0], lo[1], pairs[(len(pairs) - 1) // 2][0], hi[0], hi[1]]
    return {"step": lead.get("step"), "ranks": ranks, "keys": keys}


def summary_entry(e: Any) -> dict[str, Any] | None:
    """``e`` as a summary entry when it is one, with only its well-formed keys (five finite
    numbers, the two ranks ints); None otherwise. A copied run directory or a frame is not
    trusted."""
    if type(e) is not dict:
        return None
    step, ranks, keys = e.get("step"), e.get("ranks"), e.get("keys")
    if not (
        type(step) is int
        and type(ranks) is list
        and all(type(r) is int for r in ranks)
        and type(keys) is dict
    ):
        return None
    good = {
        k: v
        for k, v in keys.items()
        if type(v) is list
        and len(v) == 5
        and all(finite_number(x) for x in v)
        and type(v[1]) is int
        and type(v[4]) is int
    }
    return {"step": step, "ranks": ranks, "keys": good}
