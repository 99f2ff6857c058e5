"""Replay equality: the monitors' findings on recorded runs and synthetic traces equal the stored
ones.

Why: the monitors' hot paths are tuned for speed (issue 12: <= 10 us per record); a faster
monitor must say exactly what the old one said. ``tests/data/monitors_golden.json`` holds the
findings of the monitors as they were before that work (every field, texts included) on the
recorded runs' metrics.jsonl (tests/data/obs-*, tests/data/traces/*.jsonl), on every synthetic
fault, and on rewound (restart/rollback) and garbled copies. Regenerate it only for an intended
change of findings: ``PTOPS_WRITE_GOLDEN=1 pytest tests/monitors/test_monitors_replay.py``.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import synth  # tests/data/traces (pytest's pythonpath)
from conftest import TESTS
from replay_corpus import corpus

from ptops.monitors import build_monitors, replay
from ptops.ops.supervisor.monitorfeed import MonitorFeed

DATA = TESTS / "data"
TRACES = DATA / "traces"
GOLDEN = DATA / "monitors_golden.json"


def findings(recs: list[dict], flush: bool) -> list[dict]:
    return json.loads(
        json.dumps([f.to_dict() for f in replay(recs, build_monitors(), flush=flush)])
    )


def test_findings_equal_the_stored_ones():
    got = {}
    for name, recs in corpus().items():
        got[name] = findings(recs, True)
        got[name + "#live"] = findings(recs, False)
    if os.environ.get("PTOPS_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, sort_keys=True, indent=0) + "\n")
        pytest.fail("golden written; rerun without PTOPS_WRITE_GOLDEN")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    assert (
        sum(len(v) for v in want.values()) > 300
    )  # the corpus does find things: equality is not vacuous
    for name in want:
        assert got[name] == want[name], name


# ---------------------------------------------------------------- ranks that share one state


def _shuffled(recs: list[dict], rng: random.Random) -> list[dict]:
    """The same records with one rank's stream delayed by a few steps (a live supervisor reads the
    ranks' streams as they come): followers fall several transitions behind the shared state."""
    late = max(r["rank"] for r in recs if isinstance(r.get("rank"), int))
    lag = rng.randint(2, 9)
    out, held = [], []
    for r in recs:
        (held if r.get("rank") == late else out).append(r)
        if (
            held
            and isinstance(r.get("step"), int)
            and isinstance(held[0].get("step"), int)
            and r["step"] - held[0]["step"] >= lag
        ):
            out.append(held.pop(0))
    return out + held


def _diverged(recs: list[dict], rng: random.Random) -> list[dict]:
    """One rank's values drift from a random step on (a rank-local loss, a per-rank reward): its
    state must split from the shared one exactly where it diverges."""
    rank = rng.choice(sorted({r["rank"] for r in recs if isinstance(r.get("rank"), int)}))
    at = rng.randint(1, max(r["step"] for r in recs if isinstance(r.get("step"), int)))
    keys = [
        "loss",
        "grad_norm",
        "entropy",
        "kl",
        "reward",
        "completions_mean_length",
        "frac_reward_zero_std",
        "policy_lag",
        "rewards_verifier_mean",
    ]
    out = []
    for r in recs:
        if r.get("rank") == rank and isinstance(r.get("step"), int) and r["step"] >= at:
            r = dict(r)
            k = rng.choice(keys)
            if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool):
                r[k] = r[k] * (1 + rng.choice([0.0, 1e-9, 0.5, 3.0]))
        out.append(r)
    return out


def _lockstep_traps(recs: list[dict], rng: random.Random) -> list[dict]:
    """Followers equal to the step's first rank but for what only a strict look tells apart (a
    follower compares its inputs with the logged ones): -0.0 for 0.0, 1
    or True for 1.0, an extra key (a held-out eval, an unknown key), a key missing, the other
    spelling of a key, the same step twice from one rank (a rewind)."""
    keys = [
        "loss",
        "grad_norm",
        "entropy",
        "kl",
        "reward",
        "completions_mean_length",
        "frac_reward_zero_std",
        "rewards_verifier_mean",
        "clip_ratio_region_mean",
    ]
    out = []
    for r in recs:
        r = dict(r)
        if r["rank"] == 0 and r["step"] % 7 == 0:  # the leader's values 0.0 or 1.0 at these steps
            for k in keys:
                if k in r:
                    r[k] = rng.choice([0.0, 1.0])
        out.append(r)
    lead = {r["step"]: r for r in out if r["rank"] == 0}
    traps = []
    for r in out:
        if r["rank"] != 0:
            r.update(
                {k: v for k, v in lead[r["step"]].items() if k not in ("rank", "step_s", "ts")}
            )
            if (
                r["step"] % 7 == 0 and rng.random() < 0.5
            ):  # equal to the leader's 0.0 / 1.0, not the same
                k = rng.choice([k for k in keys if k in r])
                r[k] = -0.0 if r[k] == 0.0 else rng.choice([1, True])
            elif rng.random() < 0.15:
                k = rng.choice([k for k in keys if k in r])
                v = r[k]
                trap = rng.choice(["neg0", "int", "bool", "extra", "eval", "missing", "spelling"])
                if trap == "neg0" and v == 0.0:
                    r[k] = -0.0
                elif trap == "int" and v == 1.0:
                    r[k] = 1
                elif trap == "bool" and v == 1.0:
                    r[k] = True
                elif trap == "extra":
                    r["mystery"] = 1.0
                elif trap == "eval":
                    r["eval/heldout"] = 0.5
                elif trap == "missing":
                    del r[k]
                elif trap == "spelling" and "/" not in k:
                    r.pop(k)
                    r["train/" + k] = v
        traps.append(r)
        if r["rank"] == 1 and r["step"] % 41 == 0:
            traps.append(dict(r))  # the same step again from one rank: a rewind
    return traps


def _restart_after_finding(recs: list[dict]) -> list[dict] | None:
    """A restart just after the stream's first finding, with the last rank's records a few steps
    late: the rank that fired rewinds (its once-per-step entry goes) before the late rank feeds the
    step that fired, which must then fire again for it, as its own state would."""
    f = [x for x in replay(recs, build_monitors(), flush=False) if x.monitor != "straggler"]
    if not f:
        return None
    s0 = f[0].step
    out = [r for r in recs if r["step"] <= s0 + 1] + [
        dict(r, attempt=2) for r in recs if r["step"] >= s0 - 3
    ]
    late = max(r["rank"] for r in recs)
    held, res = [], []
    for r in out:
        (held if r["rank"] == late else res).append(r)
        if len(held) > 4:  # the late rank: 4 steps behind the others
            res.append(held.pop(0))
    return res + held


def _sharing_corpus() -> dict[str, list[dict]]:
    rng = random.Random(11)
    out: dict[str, list[dict]] = {}
    for seed in range(1):
        bases = [
            synth.pretrain(250, seed, ranks=4, with_busy=True, with_data=True),
            synth.pretrain(250, seed, ranks=4, inject="loss_spike", at=180),
            synth.pretrain(250, seed, ranks=4, inject="nan", at=120),
            synth.pretrain(250, seed, ranks=4, inject="none_nan", at=140),
            synth.grpo(250, seed, ranks=4),
            synth.grpo(250, seed, ranks=4, inject="entropy_collapse", at=150),
            synth.grpo(250, seed, ranks=4, inject="reward_hacking", at=200),
            synth.grpo(250, seed, ranks=4, inject="kl_drift", at=220),
            synth.grpo(250, seed, ranks=4, inject="mode_collapse", at=180),
            synth.grpo(250, seed, ranks=4, inject="stale_rollout", at=150),
        ]
        for i, base in enumerate(bases):
            a, b = sorted(rng.sample(range(len(base)), 2))
            rewound = base[:b] + [dict(r, attempt=2) for r in base[a:]]
            again = _restart_after_finding(base)
            if again is not None:
                out[f"{seed}-{i}-restart-after-finding"] = again
            for name, recs in (
                ("plain", base),
                ("rewound", rewound),
                ("late", _shuffled(base, rng)),
                ("rewound-late", _shuffled(rewound, rng)),
                ("diverged", _diverged(base, rng)),
                ("diverged-late", _shuffled(_diverged(rewound, rng), rng)),
            ):
                out[f"{seed}-{i}-{name}"] = recs
    for every, ranks_with in (
        (10, (0, 1)),
        (25, (0,)),
    ):  # held-out evals on the step's record (TRL's [eval])
        recs = []
        for r in synth.grpo(250, 3, ranks=2, inject="reward_hacking", at=120):
            if r["step"] % every == 0 and r["rank"] in ranks_with:
                r = dict(r, **{"eval/heldout": round(0.6 - 0.001 * r["step"], 6)})
            recs.append(r)
        out[f"eval-every-{every}-ranks-{len(ranks_with)}"] = recs
    out["lockstep-traps"] = _lockstep_traps(synth.grpo(250, 5, ranks=4), rng)
    out["lockstep-traps-pretrain"] = _lockstep_traps(synth.pretrain(250, 5, ranks=4), rng)
    for name, recs in corpus().items():
        if name.startswith(("odd-", "rewind-", "obs-", "trl-grpo-tiny-100")):
            out[name] = recs
    return out


def _dump(x):
    """A monitor state as plain data (floats by repr: NaN equals NaN), to compare two states."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {repr(k): _dump(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(repr(v) for v in x)
    if isinstance(x, (list, tuple)) or type(x).__name__ == "deque":
        return [_dump(v) for v in x]
    slots = [a for c in type(x).__mro__ for a in getattr(c, "__slots__", ())]
    attrs = {a: getattr(x, a) for a in slots if hasattr(x, a)}
    attrs.update(getattr(x, "__dict__", {}))
    return {type(x).__name__: {k: _dump(v) for k, v in sorted(attrs.items())}}


def test_shared_state_gives_the_findings_of_one_state_per_rank(monkeypatch):
    """Ranks whose inputs agree share one state (monitors/shared.py SharedRankedMonitor): the
    findings, texts and ranks included, equal those of the same monitors with a state per rank, on
    streams where ranks arrive late, diverge at a random step, rewind, carry garbage; with
    checkpoints every few transitions (the shipped interval is 1,024, longer than these streams) so
    that forks rebuild from them."""
    import ptops.monitors.shared as shared
    from ptops.monitors import SharedRankedMonitor as Shared

    shared_kinds = [m for m in build_monitors() if isinstance(m, Shared)]
    # straggler alone keeps a state per rank (its signals differ by rank by nature)
    assert {m.name for m in shared_kinds} == {
        "nan",
        "loss_spike",
        "grad_explosion",
        "entropy_collapse",
        "kl_drift",
        "reward_hacking",
        "mode_collapse",
        "stale_rollout",
        "train_inference_gap",
    }
    own_states: dict[str, tuple] = {}  # a state per rank does not depend on _LOG_MAX: once
    for log_max in (1024, 16):
        monkeypatch.setattr(shared, "_LOG_MAX", log_max)
        forks = 0
        for name, recs in _sharing_corpus().items():  # fresh records: nothing carried over
            mons = build_monitors()
            got = [f.to_dict() for f in replay(recs, mons)]
            if name not in own_states:
                alone = build_monitors()
                for m in alone:
                    if isinstance(m, Shared):
                        m.share = False
                own_states[name] = (alone, [f.to_dict() for f in replay(recs, alone)])
            alone, want = own_states[name]
            assert json.loads(json.dumps(got)) == json.loads(json.dumps(want)), (log_max, name)
            # the live path (MonitorFeed): the same findings and states
            live = build_monitors()
            feed = MonitorFeed(live)
            got_live = [f for r in recs for f in feed.feed(r)[0]]
            for m in live:
                if getattr(m, "flush", None) is not None:
                    got_live.extend(m.flush())
            assert not feed.errors, (name, feed.errors)
            got_live = [f.to_dict() for f in got_live]
            assert json.loads(json.dumps(got_live)) == json.loads(json.dumps(want)), (
                log_max,
                name,
                "live",
            )
            for m in mons + live:
                if isinstance(m, Shared):
                    forks += sum(1 for mm in m._members.values() if mm[0].log is None)
                    own = next(a for a in alone if a.name == m.name)
                    for rank in list(
                        m._members
                    ):  # every rank's state (rebuilt when behind) is what its own is
                        assert _dump(m._state_of(rank)) == _dump(own._state_of(rank)), (
                            log_max,
                            name,
                            m.name,
                            rank,
                        )
                        if getattr(m, "heldout_source", None):
                            assert m.heldout_source(rank) == own.heldout_source(rank)
        assert forks > 0  # the corpus does split states (and rebuild them), not only share them


def _through_batches(recs: list[dict], rng: random.Random, per_node: int) -> list[tuple]:
    """The records as a supervisor handles them from node agents: each node's ranks' lines through
    the agent's own Batcher, frames flushed every few records (every node's, in node order), each
    frame rebuilt by ``unbatch`` with its certificates (``likes``). (record, like) pairs."""
    from ptops.ops.rank.channel import Batcher, unbatch

    batchers: dict[int, Batcher] = {}
    out: list[tuple] = []

    def flush() -> None:
        for node in sorted(batchers):
            frame = batchers[node].frame()
            if frame is not None:
                likes: list = []
                for (_, msg), like in zip(unbatch(json.loads(frame), likes), likes):
                    out.append((msg["rec"], like))

    for r in recs:
        rank = r.get("rank") if isinstance(r.get("rank"), int) else 0
        raw = json.dumps({"t": "metrics", "rec": r}).encode()
        batchers.setdefault(rank // per_node, Batcher()).add(rank % per_node + 1, raw, 0.0)
        if rng.random() < 0.15:
            flush()
    flush()
    return out


def test_a_node_batch_certified_repeat_gives_the_findings_and_states_of_one_state_per_rank(
    monkeypatch,
):
    """The live path with node agents: a record that the agent's batch certifies equal to its
    node's first record of the step but for some keys (``unbatch`` likes) moves the shared states
    on without being read (``SharedRankedMonitor.repeat``) when none of those keys is one the
    monitor's inputs read. Findings and every rank's state equal a state per rank on the same
    handled stream (late, diverged, rewound, garbled, eval-on-some-ranks streams), and the repeat
    really skips reading records (fewer ``_inputs`` calls than without the certificates, with 4
    ranks a node). Fed a node's step group at a time (``MonitorFeed.feed_group``, the
    supervisor's path): the same findings and states, and whole groups moved on in one call."""
    from ptops.monitors import SharedRankedMonitor as Shared

    rng = random.Random(5)
    calls = {"n": 0}
    repeated = 0
    moved = [0]  # groups whose followers a shared monitor moved on in one call
    group_of = Shared.repeat_group

    def counted_group(self, *a):
        done = group_of(self, *a)
        moved[0] += done
        return done

    monkeypatch.setattr(Shared, "repeat_group", counted_group)
    for i, (name, recs) in enumerate(_sharing_corpus().items()):
        if (i % 4 >= 2 and not name.startswith(("lockstep", "eval-"))) or not all(
            isinstance(r, dict) for r in recs
        ):
            continue  # (half the corpus and the traps, 2 and 4 ranks a node in turn: suite time)
        for per_node in (2, 4) if name.startswith("lockstep") else (2 + 2 * (i % 2),):
            handled = _through_batches(recs, rng, per_node)
            stream = [r for r, _ in handled]
            alone = build_monitors()
            for m in alone:
                if isinstance(m, Shared):
                    m.share = False
            want = [f.to_dict() for f in replay(stream, alone)]
            got = {}
            for with_likes in (False, True, "groups"):
                live = build_monitors()
                for m in live:
                    if isinstance(m, Shared):
                        inputs = m._inputs

                        def counted(record, _inputs=inputs):
                            calls["n"] += 1
                            return _inputs(record)

                        m._inputs = counted
                feed = MonitorFeed(live)
                before = calls["n"]
                if with_likes == "groups":  # a node's step group in one call (the supervisor's)
                    found = [f for g in _step_groups(handled) for f in feed.feed_group(*g)[0]]
                else:
                    found = [
                        f
                        for r, like in handled
                        for f in feed.feed(r, like if with_likes else None)[0]
                    ]
                for m in live:
                    if getattr(m, "flush", None) is not None:
                        found.extend(m.flush())
                assert not feed.errors, (name, feed.errors)
                got[with_likes] = (
                    json.loads(json.dumps([f.to_dict() for f in found])),
                    calls["n"] - before,
                )
                for m in live:
                    if isinstance(m, Shared):
                        own = next(a for a in alone if a.name == m.name)
                        for rank in list(m._members):
                            assert _dump(m._state_of(rank)) == _dump(own._state_of(rank)), (
                                name,
                                per_node,
                                with_likes,
                                m.name,
                                rank,
                            )
            assert got[False][0] == json.loads(json.dumps(want)), (name, per_node)
            assert got[True][0] == got[False][0], (name, per_node)
            assert got["groups"][0] == got[False][0], (name, per_node)
            if per_node == 4:  # (with 2 a node, one follower per leader: what it saves, the
                # leader's read keys cost once)
                repeated += got[False][1] - got[True][1]
    print("records moved on without being read:", repeated, "groups moved at once:", moved[0])
    assert repeated > 5_000  # records really moved on without being read
    assert moved[0] > 1_000  # and whole groups in one call


def _step_groups(handled: list) -> list[tuple[list, list]]:
    """(records, likes) of consecutive records the way the supervisor groups a node's batch: a
    record whole, then those certified against its rank (``_group_end``); the rest alone."""
    out: list[tuple[list, list]] = []
    for r, like in handled:
        if (
            like is not None
            and out
            and out[-1][1][0] is None
            and like[0] == out[-1][0][0].get("rank")
        ):
            out[-1][0].append(r)
            out[-1][1].append(like)
        else:
            out.append(([r], [like]))
    return out


def _through_summaries(recs: list[dict], rng: random.Random, per_node: int, every: int, read):
    """The records through two node agents' Batchers fed alike and flushed together: one plain,
    one with ``node_summaries`` (``Batcher(every, read)``). (the plain frames' (record, like)
    pairs, the summing frames' items: ("rec", record, like) or ("sum", leader, ranks, names)),
    in the order the supervisor handles them."""
    from ptops.ops.rank.channel import Batcher, unbatch

    plain: dict[int, Batcher] = {}
    summing: dict[int, Batcher] = {}
    whole: list[tuple] = []
    items: list[tuple] = []

    def flush() -> None:
        for node in sorted(plain):
            frame = plain[node].frame()
            if frame is None:
                continue
            likes: list = []
            for (_, msg), like in zip(unbatch(json.loads(frame), likes), likes):
                whole.append((msg["rec"], like))
            likes, sums = [], []
            pairs = unbatch(json.loads(summing[node].frame()), likes, sums)
            got = [("rec", msg["rec"], like) for (_, msg), like in zip(pairs, likes)]
            for at, lead, cids, _, _, names in reversed(sums):
                ranks = [node * per_node + c - 1 for c in cids]
                got.insert(at, ("sum", pairs[lead][1]["rec"], ranks, names))
            items.extend(got)

    for r in recs:
        rank = r.get("rank") if isinstance(r.get("rank"), int) else 0
        raw = json.dumps({"t": "metrics", "rec": r}).encode()
        for batchers, b in ((plain, Batcher()), (summing, Batcher(every, read))):
            batchers.setdefault(rank // per_node, b).add(rank % per_node + 1, raw, 0.0)
        if rng.random() < 0.15:
            flush()
    flush()
    return whole, items


def test_a_record_with_no_rl_key_gates_reward_hacking_for_the_ranks_certified_like_it():
    """Reward hacking skips a record of only keys it has learned are plain (pre-training's); a
    node's followers certified equal to it but for some values have its keys, so they are skipped
    as one group (``repeat_group``), not each fed its leader's record (it was 7 copies and calls a
    node-step under node summaries); a record with a reward is judged as before."""
    from ptops.monitors.config import RewardHackingConfig
    from ptops.monitors.rl.reward_hacking import RewardHackingMonitor

    m = RewardHackingMonitor(RewardHackingConfig())
    rec = {"step": 4, "rank": 0, "loss": 6.5, "grad_norm": 0.5, "lr": 3e-4, "step_s": 1.0}
    keys, differ = frozenset(rec), [frozenset({"step_s"})] * 3
    assert m.feed_at(rec, keys, 4, 0) == []  # its keys learned: none is an eval
    assert keys <= m._plain
    seen = dict(m._last_step)
    rec = {**rec, "step": 5}
    assert m.feed_at(rec, keys, 5, 0) == []
    assert m.repeat_group(5, [1, 2, 3], 0, differ, keys) is True
    assert m.repeat({**rec, "rank": 4, "step_s": 1.1}, keys, 5, 4, 0, differ[0]) == []
    assert m._last_step == seen  # skipped: no step noted, no rank placed
    assert not any(m._members.get(r) for r in (1, 2, 3, 4))
    judged = {**rec, "step": 6, "reward": 0.5}
    assert m.feed_at(judged, frozenset(judged), 6, 0) == [] and m._last_step[0] == 6


def test_node_summaries_give_the_shared_monitors_the_findings_and_states_of_every_record():
    """``[supervisor] node_summaries``: the corpus through the agents' summaries (routine ranks
    between samples never reach the supervisor; ``MonitorFeed.repeat_summary`` moves them on
    with their leader) gives the shared monitors (NaN, loss spike, grad norm, the RL ones) the
    findings and every rank's state of a state per rank fed every record. The monitors that do
    not share state (straggler, memory, SDC) see those ranks on sample steps only: what they
    find differently is counted here and listed in docs/scale.md, not hidden."""
    from ptops.monitors import SharedRankedMonitor as Shared

    rng = random.Random(7)
    read = MonitorFeed(build_monitors()).read_keys()
    assert read is not None and "loss" in read and "step_s" not in read
    summed = 0
    others_differ: dict[str, int] = {}
    for i, (name, recs) in enumerate(_sharing_corpus().items()):
        if (i % 3 and not name.startswith(("lockstep", "eval-"))) or not all(
            isinstance(r, dict) for r in recs
        ):
            continue  # (a third of the corpus and the traps: suite time)
        whole, items = _through_summaries(recs, rng, 2 + 2 * (i % 2), 2 + i % 3, read)
        alone = build_monitors()
        for m in alone:
            if isinstance(m, Shared):
                m.share = False
        names = {m.name for m in alone if isinstance(m, Shared)}
        want = [f.to_dict() for f in replay([r for r, _ in whole], alone, flush=False)]
        feed = MonitorFeed(build_monitors())
        found: list = []
        group: tuple[list, list] = ([], [])
        for item in items + [("end",)]:
            if item[0] == "rec" and item[2] is not None and group[0]:
                if item[2][0] == group[0][0].get("rank") and group[1][0] is None:
                    group[0].append(item[1])
                    group[1].append(item[2])
                    continue
            if group[0]:
                found.extend(feed.feed_group(*group)[0])
            group = ([], [])
            if item[0] == "rec":
                group = ([item[1]], [item[2]])
            elif item[0] == "sum":
                summed += len(item[2])
                found.extend(feed.repeat_summary(item[1], item[2], item[3])[0])
        assert not feed.errors and not feed.unmoved, (name, feed.errors, feed.unmoved)
        got = json.loads(json.dumps([f.to_dict() for f in found]))
        want = json.loads(json.dumps(want))
        assert [f for f in got if f["monitor"] in names] == [
            f for f in want if f["monitor"] in names
        ], name
        for m in feed.monitors:
            if isinstance(m, Shared):
                own = next(a for a in alone if a.name == m.name)
                for rank in list(own._members):
                    assert _dump(m._state_of(rank)) == _dump(own._state_of(rank)), (
                        name,
                        m.name,
                        rank,
                    )
        for kind in ("got", "want"):
            for f in got if kind == "got" else want:
                if f["monitor"] not in names and (f in want) != (f in got):
                    key = f"{f['monitor']} {kind} only"
                    others_differ[key] = others_differ.get(key, 0) + 1
    print("ranks summed up:", summed, "other monitors' differences:", others_differ)
    assert summed > 5_000  # the summaries were there: the equality is not vacuous


class _Counted(dict):
    """A dict that counts the ranks read or written through it (``get``, ``[]``, ``update``)."""

    n = 0

    def get(self, key, default=None):
        _Counted.n += 1
        return dict.get(self, key, default)

    def __getitem__(self, key):
        _Counted.n += 1
        return dict.__getitem__(self, key)

    def __setitem__(self, key, value):
        _Counted.n += 1
        dict.__setitem__(self, key, value)

    def update(self, other=(), **kw):
        _Counted.n += len(other) + len(kw)
        dict.update(self, other, **kw)


def test_a_cohort_of_followers_moves_on_in_one_step_and_dissolves_exactly():
    """A relay's followers, summed up step after step (``repeat_summary``), move on as a cohort:
    no rank's step or place is read or written (``_last_step``, ``_members``) on a steady step.
    One of them fed its own record (another loss: a state of its own), another rewound to an
    earlier step, then the group again (with and without them, the same list or an equal one):
    the findings, every rank's state, step and fired table are those of a state per rank fed
    every record."""
    from ptops.monitors import SharedRankedMonitor as Shared

    lead, ranks = 0, list(range(1, 65))
    names = frozenset({"step_s"})
    shared = [m for m in build_monitors() if isinstance(m, Shared)]
    alone = [m for m in build_monitors() if isinstance(m, Shared)]
    for m in alone:
        m.share = False
    feed = MonitorFeed(shared)
    found, fed = [], []  # (the shared monitors' findings, every record as if each came)

    def rec(step, rank, loss=None):
        loss = 5.0 - 0.01 * step + 0.003 * (step % 3) if loss is None else loss
        return {"step": step, "rank": rank, "loss": loss, "grad_norm": 0.5, "step_s": 1.0 + rank}

    def group(step, members, spike=False):
        lr = rec(step, lead, 50.0 if spike else None)
        found.extend(feed.feed(lr)[0])
        found.extend(feed.repeat_summary(lr, members, names)[0])
        fed.extend([lr] + [{**lr, "rank": r, "step_s": 1.0 + r} for r in members])

    def alone_rec(r):
        found.extend(feed.feed(r)[0])
        fed.append(r)

    steady = []
    for step in range(1, 41):  # the same list (``current_ranks``' memo), then an equal one
        before = _Counted.n
        group(step, ranks if step < 30 else list(ranks), spike=step == 25)
        if step >= 5 and step not in (25, 26):  # (the spike: each rank replays its finding)
            steady.append(_Counted.n - before)
        if step == 3:  # counted from here: the cohorts are there by now
            for m in shared:
                m._last_step, m._members = _Counted(m._last_step), _Counted(m._members)
    # the leader's own record takes a few a step; a rank at a time would be 64 a monitor or more
    assert max(steady) <= 2 * len(shared), steady
    alone_rec(rec(40, 7, loss=9.0))  # one follower's own record: another loss than its leader's
    rest = [r for r in ranks if r != 7]
    for step in range(41, 46):
        group(step, ranks if step == 41 else rest)
    alone_rec(rec(42, 11))  # another one rewinds to an earlier step
    for step in range(46, 52):
        group(step, ranks if step in (46, 50) else rest)
    got = json.loads(json.dumps([f.to_dict() for f in found]))
    want = json.loads(json.dumps([f.to_dict() for f in replay(fed, alone, flush=False)]))
    assert any(f["step"] == 25 for f in want)  # (the spike: the equality is not vacuous)
    assert got == want
    for m in shared:
        own = next(a for a in alone if a.name == m.name)
        for rank in [lead, *ranks]:
            assert _dump(m._state_of(rank)) == _dump(own._state_of(rank)), (m.name, rank)
        assert dict(m._last_step) == own._last_step and m._fired == own._fired, m.name
        assert not m._cohort_of and len({id(v) for v in m._members.values()}) == len(m._members)
