"""The hang check looks at deadlines, not at every rank (``monitors/hang.py::_might_stall``): a
check that finds nothing costs O(sections), and it never says "nothing" where walking every rank
would find a hang. Checked against the walk itself on random record streams."""

from __future__ import annotations

import random

import pytest

from ptops.monitors.hang import STARTUP_SECTIONS, HangConfig, HangMonitor


def _walk(m: HangMonitor, now: float):
    """What the check walking every rank finds (the code path before the deadline bound)."""
    m._check_memo = {}
    try:
        return m._check(now)
    finally:
        m._check_memo = None


def _bound(m: HangMonitor, now: float) -> bool:
    m._check_memo = {}
    try:
        return m._might_stall(now)
    finally:
        m._check_memo = None


def _record(rng: random.Random, rank: int, step: int, ts: float) -> dict:
    kind = rng.choice(["ping", "ping", "beat", "beat", "metrics", "exit"] if rng.random() < 0.02
                      else ["ping", "ping", "beat", "beat", "metrics"])  # fmt: skip
    rec = {"kind": kind, "rank": rank, "step": step, "ts": ts}
    if kind == "metrics":
        rec["step_s"] = rng.uniform(0.05, 2.0)
    elif kind == "beat":
        phase = rng.choice(["startup", "data", "step", "step", "checkpoint", "eval", "hold"])
        rec["phase"] = phase
        if phase == "startup":
            rec["section"] = rng.choice(STARTUP_SECTIONS[1:])
        elif phase == "step":
            rec["stage"] = rng.choice(["begin", None])
    return rec


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_never_hides_a_hang_the_walk_finds(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    cfg = HangConfig(
        floor_s=rng.uniform(0.5, 3.0), ping_stale_s=rng.uniform(1.0, 4.0),
        startup_ping_stale_s=rng.uniform(2.0, 8.0), checkpoint_s=rng.uniform(2.0, 10.0),
        total_steps=rng.choice([None, 5, 20]),
    )  # fmt: skip
    m = HangMonitor(world, 0.0, cfg)
    ts, step = 0.0, 0
    hangs = quiet = 0
    for _ in range(400):
        ts += rng.expovariate(4.0) * rng.choice([1, 1, 1, 10])  # now and then a long silence
        if rng.random() < 0.05:
            step += 1
        m.observe(_record(rng, rng.randrange(world + (1 if rng.random() < 0.01 else 0)), step, ts))
        for now in (ts, ts + rng.uniform(0, 3), ts + rng.uniform(3, 30)):
            found = _walk(m, now)
            if found is not None:
                hangs += 1
                assert _bound(m, now), (seed, now, found)
                assert m.check(now) == found  # the same finding through the bound
            else:
                quiet += 1
                assert m.check(now) is None
    assert hangs and quiet  # both sides were exercised


def test_a_quiet_check_at_scale_looks_at_the_heaps_not_the_ranks(monkeypatch):
    world = 16_384
    m = HangMonitor(world, 0.0, HangConfig(floor_s=10.0, ping_stale_s=10.0))
    begin = {"kind": "beat", "phase": "step", "stage": "begin"}
    for r in range(world):
        m.observe({**begin, "rank": r, "step": 1, "ts": 1.0})
    for r in range(world):
        m.observe({"kind": "metrics", "rank": r, "step": 1, "step_s": 1.0, "ts": 2.0})
    walked = []
    budget = m._budget
    monkeypatch.setattr(m, "_budget", lambda r: walked.append(r) or budget(r))
    for i in range(100):
        assert m.check(3.0 + i * 0.01) is None
    assert m.full_checks == 0 and walked == []  # no rank looked at
    assert len(m._progress["step"]) <= world  # the superseded entries were dropped
    # one rank silent past its budget: found, and only then the walk
    for r in range(1, world):
        m.observe({**begin, "rank": r, "step": 2, "ts": 4.0})
    found = m.check(40.0)
    assert found is not None and found.ranks == [0] and m.full_checks == 1


def test_a_group_of_ranks_is_one_deadline_entry_and_its_last_rank_still_counts():
    """``observe_steps`` stamps a group of ranks with ONE heap entry (a relay's step of 512 ranks:
    one push and one pop, not 512). A check cuts an entry down to its ranks still at its key, so
    one rank left behind by its group (pinging: stuck in a collective) is found on its own
    budget while the others step on, and a quiet check pops whole groups without a walk."""
    world, per = 4096, 512
    m = HangMonitor(world, 0.0, HangConfig(floor_s=10.0, ping_stale_s=10.0))
    begin = {"kind": "beat", "phase": "step", "stage": "begin"}
    for r in range(world):  # the first step one by one (its slow path), then groups
        m.observe({**begin, "rank": r, "step": 1, "ts": 1.0})
        m.observe({"kind": "metrics", "rank": r, "step": 1, "step_s": 1.0, "ts": 2.0})
    found = None
    for step in range(2, 30):
        for g in range(0, world, per):
            group = [r for r in range(g, g + per) if not (r == 777 and step > 2)]
            m.observe_steps("begin", [(r, step, None) for r in group], step + 0.1)
            m.observe_steps("metrics", [(r, step, 1.0) for r in group], step + 1.0)
        m.observe({"kind": "ping", "rank": 777, "ts": step + 1.0})  # alive, in a collective
        found = m.check(step + 1.5)
        if found is not None:
            break
        assert len(m._progress["step"]) <= 2 * world // per * step  # an entry a group-step
    assert m.full_checks == 1  # the quiet checks looked at the heaps only
    # rank 777 ended step 2 at 3.0; its budget is 10 s: found at the first check past it
    assert found is not None and found.ranks == [777] and step + 1.5 == 13.5


def test_the_hang_line_names_ranks_as_ranges():
    from ptops.ops.runrecord.ranks import rank_list

    assert rank_list([3]) == "[3]"
    assert rank_list([5, 0, 1, 2, 3]) == "[0-3, 5]"
    assert rank_list(list(range(8192))) == "[0-8191] (8192 ranks)"
    evens = rank_list(list(range(0, 100, 2)))
    assert evens.startswith("[0, 2, 4,") and "(34 more ranges)] (50 ranks)" in evens


def _entries(heap: list) -> list:
    """A deadline heap's (key, rank) pairs, a group entry's one a rank (``hang._push``)."""
    return sorted((e[0], r) for e in heap for r in (e[2] if len(e) > 2 else [e[1]]))


def _state(m: HangMonitor) -> dict:
    import dataclasses

    def own(st) -> dict:  # (how many ranks share it is not the rank's state)
        return {k: v for k, v in dataclasses.asdict(st).items() if k != "refs"}

    return {
        "ranks": {r: own(st) for r, st in m.ranks.items()},
        "learned": {s: (d.n, list(d.counts), list(d.mins)) for s, d in m.learned.sections.items()},
        "recent": (list(m._recent), m._recent_i),
        "progress": {s: _entries(h) for s, h in m._progress.items()},
        "seen": _entries(m._seen),
        "rdv": (dict(m._rdv_entered), m._rdv_version),
        "resumed_at": m.resumed_at,
        "finished_ts": m.finished_ts,
    }


@pytest.mark.parametrize("seed", range(30))
def test_a_step_group_in_one_call_leaves_the_state_of_each_observed_alone(seed):
    """``observe_steps`` (a node's step group: its records, or its beats that begin a step, in one
    call) against ``observe`` of each, on random streams that leave the steady state now and then
    (start-up, checkpoints, pauses, a first step, exits, ranks never seen): the same state, heaps
    included, and the same finding."""
    rng = random.Random(1000 + seed)
    world = rng.randint(1, 8)
    cfg = HangConfig(floor_s=rng.uniform(0.5, 3.0), window=rng.choice([None, None, 5]))
    one, grouped = HangMonitor(world, 0.0, cfg), HangMonitor(world, 0.0, cfg)
    ts, step = 0.0, 0
    groups = 0
    for _ in range(300):
        ts += rng.expovariate(4.0)
        if rng.random() < 0.5:  # a node's step group: some ranks (now and then one never seen)
            step += rng.random() < 0.5
            ranks = rng.sample(range(world + 1), rng.randint(1, world))
            kind = rng.choice(["metrics", "begin"])
            done = [(r, step, rng.choice([rng.uniform(0.05, 2.0), None, 0, True])) for r in ranks]
            for r, s, step_s in done:
                one.observe(
                    {"kind": "metrics", "rank": r, "step": s, "step_s": step_s, "ts": ts}
                    if kind == "metrics"
                    else {
                        "kind": "beat",
                        "rank": r,
                        "step": s,
                        "phase": "step",
                        "stage": "begin",
                        "section": None,
                        "ts": ts,
                    }  # fmt: skip
                )
            grouped.observe_steps(kind, done, ts)
            groups += 1
        else:  # anything else, alone, to both
            rec = _record(rng, rng.randrange(world), step, ts)
            one.observe(dict(rec))
            grouped.observe(dict(rec))
        assert _state(grouped) == _state(one)
    assert groups > 100
    later = ts + rng.uniform(1.0, 50.0)
    a, b = one.check(later), grouped.check(later)
    assert (a and a.as_event(1)) == (b and b.as_event(1))


def _live(m: HangMonitor) -> dict:
    """``_state`` with each heap as its live entries: a check pops stale entries, a rank's one at
    a time or a group's at once (what is left to judge is what must agree)."""
    state = _state(m)
    for section, pairs in state["progress"].items():
        state["progress"][section] = sorted({
            (key, r) for key, r in pairs
            if not m.ranks[r].exited and m.ranks[r].section == section
            and m.ranks[r].phase != "hold" and m.ranks[r].last_progress == key
        })  # fmt: skip
    state["seen"] = sorted({
        (key, r) for key, r in state["seen"]
        if not m.ranks[r].exited and m.ranks[r].seen_key == key
    })  # fmt: skip
    return state


def _as_one_by_one(m: HangMonitor, kind: str, ranks: list, step: int, ts: float, timed=None):
    for r in ranks:
        step_s = timed[1] if timed is not None and timed[0] == r else None
        m.observe(
            {"kind": "metrics", "rank": r, "step": step, "step_s": step_s, "ts": ts}
            if kind == "metrics"
            else {"kind": "beat", "rank": r, "step": step, "phase": "step", "stage": "begin",
                  "section": None, "ts": ts}
        )  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_a_relays_routine_ranks_share_one_state_and_each_leaves_it_exactly(seed):
    """``observe_ranks`` (a relay's step: its leader's record alone, its other ranks summed up,
    every rank's begin beat folded) against ``observe`` of each rank, on random streams where ranks
    leave the cohort now and then (a rank's own beat, ping, record or exit; a rank missing from a
    step; a checkpoint; a rank never seen): the same state, heaps included, at every step, and the
    same finding at the end. And the point: in the steady steps the cohort moves as one state
    (ranks share one object; an update a step, not one a rank)."""
    rng = random.Random(2000 + seed)
    world = rng.randint(40, 80)
    cfg = HangConfig(floor_s=rng.uniform(0.5, 3.0), window=rng.choice([None, 5]))
    one, grouped = HangMonitor(world, 0.0, cfg), HangMonitor(world, 0.0, cfg)
    moved = []
    real = grouped._move_cohort

    def counted(*a):
        done = real(*a)
        moved.append(done)
        return done

    grouped._move_cohort = counted
    ts = 0.0
    shared_seen = 0
    gone: set = set()
    for step in range(1, 80):
        ts += rng.uniform(0.5, 1.5)
        ranks = [r for r in range(world + (rng.random() < 0.03)) if r not in gone]
        if rng.random() < 0.1:  # a rank missing from this step (late, gone, in its own frame)
            ranks.remove(rng.choice(ranks[1:]))
        lead, followers = ranks[0], ranks[1:]
        slow = rng.choice([None, rng.choice(followers)])
        timed = (slow, rng.uniform(0.5, 2.0)) if slow is not None else None
        if step > 1:
            for m in (one, grouped):
                m.observe({"kind": "metrics", "rank": lead, "step": step - 1, "step_s": 1.0,
                           "ts": ts})  # fmt: skip
            _as_one_by_one(one, "metrics", followers, step - 1, ts, timed)
            grouped.observe_ranks("metrics", followers, step - 1, ts, timed)
        for _ in range(rng.choice([0, 0, 0, 1, 3])):  # a rank's own message between
            rec = _record(rng, rng.randrange(1, world), step, ts)
            one.observe(dict(rec))
            grouped.observe(dict(rec))
            if rec["kind"] == "exit":  # (it sends nothing more)
                gone.add(rec["rank"])
        if rng.random() < 0.05:  # a liveness frame naming some ranks
            for r in rng.sample(range(world), 5):
                one.seen(r, ts - 0.2)
                grouped.seen(r, ts - 0.2)
        _as_one_by_one(one, "begin", ranks, step, ts)
        grouped.observe_ranks("begin", ranks, step, ts)
        assert _live(grouped) == _live(one), (seed, step)
        live = [r for r in followers if r not in gone]
        shared_seen += grouped.ranks[live[-1]] is grouped.ranks[live[-2]]
        now = ts + rng.uniform(0, 20)
        a, b = one.check(now), grouped.check(now)
        assert (a and a.as_event(1)) == (b and b.as_event(1)), (seed, step)
        assert grouped.full_checks == one.full_checks  # (a stale cohort entry is no deadline)
    # most steps moved a cohort as one (its first steps, and a few after each break, go rank by
    # rank), and its ranks do share one state object
    assert moved.count(True) > 40 and shared_seen > 20, (moved.count(True), shared_seen)
    # what the bench reports (``group_moves``): those moves, and the groups that went rank by rank
    assert grouped.group_moves[0] == moved.count(True) and grouped.group_moves[1] > 0
    assert one.group_moves == [0, 0]


def test_a_ranks_own_copy_of_a_shared_state_holds_every_field():
    import dataclasses

    from ptops.monitors.hang import _Rank

    st = _Rank(*[object() for f in dataclasses.fields(_Rank) if f.name != "refs"], refs=9)
    own = st.alone()
    assert own.refs == 1 and all(
        getattr(own, f.name) is getattr(st, f.name)
        for f in dataclasses.fields(_Rank)
        if f.name != "refs"
    )
