"""A node's step group handled as ONE unit by the supervisor (``_on_step_group``: the lines, the
monitors' ``feed_group``, the hang monitor's ``observe_steps``) has the effect of its messages
handled one by one: the same ``metrics.jsonl`` bytes, events, monitor errors, hang-monitor state
and hang finding, on a stream with the troubles that break groups (NaN losses, spikes, a
straggler, a diverging rank, a restart that rewinds, checkpoints, a monitor that raises)."""

from __future__ import annotations

import dataclasses
import json
import random

from conftest import REPO, supervisor_without_ranks

from ptops.ops.rank.channel import Batcher, encode
from ptops.ops.runrecord.rundir import read_jsonl

TITAN = REPO / "tests" / "data" / "obs-titan"
PER_NODE = 8
NODES = 3
WORLD = NODES * PER_NODE


def _stream(seed: int = 0) -> list[tuple[int, list]]:
    """Per node and step, the node's lines as its agent receives them: each rank's record of the
    step, then its beat that begins the next one (rank 0 now and then saves a checkpoint between).
    Steps 1-30, then a restart from 26 (a rewind) to 34."""
    rnd = random.Random(seed)
    base = [r for r in read_jsonl(TITAN / "metrics.jsonl") if r["rank"] == 0][0]
    steps = list(range(1, 31)) + list(range(26, 35))
    out = []
    for step in steps:
        for node in range(NODES):
            lines = []
            for rank in range(node * PER_NODE, (node + 1) * PER_NODE):
                loss = 6.0 / step
                if step == 12:
                    loss = float("nan")
                elif step in (18, 19):
                    loss *= 20
                elif rank == 9 and step > 20:
                    loss *= 1.5  # diverges from its node's leader
                rec = {
                    **base,
                    "step": step,
                    "rank": rank,
                    "loss": loss,
                    "grad_norm": 50.0 if step == 23 else base["grad_norm"],
                    "ts": 1796007405.0 + step + rnd.random() * 0.01,
                    "step_s": round((0.3 if rank == 5 else 0.8) + rnd.random() * 0.05, 4),
                }
                if rnd.random() < 0.05:
                    rec["mem_rss_mb"] = 900.0 + rnd.random()  # a key of its own: sent whole
                lines.append((rank, {"t": "metrics", "rec": rec}))
            for rank in range(node * PER_NODE, (node + 1) * PER_NODE):
                if rank == 0 and step % 10 == 0:
                    lines.append((0, {"t": "beat", "phase": "checkpoint", "step": step}))
                    lines.append((0, {"t": "beat", "phase": "step", "step": step}))
                beat = {"t": "beat", "phase": "step", "stage": "begin", "step": step + 1}
                lines.append((rank, beat))
            out.append((node, lines))
    return out


class _Raises:
    """A monitor with a bug: raises on rank 7's records and on every 9th step."""

    name = "raises"

    def feed(self, record):
        if record.get("rank") == 7 or record.get("step", 0) % 9 == 0:
            raise ValueError("boom")
        return []


class _Says:
    """A monitor that finds something in the records of ranks ``at`` (a node's place) at step 7:
    one at the front of the monitors and one at the back, so the order of their findings within a
    group is that of the records, not of the monitors."""

    def __init__(self, name: str, at: int) -> None:
        self.name, self.at = name, at

    def feed(self, record):
        from ptops.monitors.base import Finding

        if record.get("step") == 7 and record.get("rank", 0) % PER_NODE == self.at:
            return [Finding(self.name, 7, 1.0, "said", "warning", record["rank"], 1)]
        return []


def _run(tmp_path, groups: bool):
    from ptops.ops.supervisor.channel import Peer, batch_entry

    sup, run = supervisor_without_ranks(
        tmp_path, [f"launch.nproc={WORLD}", "supervisor.metrics_lines=node"], WORLD
    )
    sup.STEP_GROUPS = groups
    sup.feed.monitors[:] = [_Says("says-late", 7), *sup.feed.monitors, _Raises(), _Says("says", 0)]
    calls = {"groups": 0}
    inner, begun = sup._on_step_group, sup._on_begun

    def counted(items, ts):
        calls["groups"] += 1
        return inner(items, ts)

    def counted_begun(msg, ts):  # a folded line of begin beats: a group unless groups are off
        calls["groups"] += groups
        return begun(msg, ts)

    sup._on_step_group, sup._on_begun = counted, counted_begun
    nodes = [
        Peer(cid=100 + n, sock=None, hello={"role": "node", "node": f"node{n}", "attempt": 1})
        for n in range(NODES)
    ]
    peers = {}
    for r in range(WORLD):
        hello = {"role": "rank", "rank": r, "attempt": 1, "pid": 1}
        peers[r] = Peer(cid=r, sock=None, hello=hello, via=nodes[r // PER_NODE])
        nodes[r // PER_NODE].subs[r] = peers[r]
        sup.handle(peers[r], {"t": "_hello"}, 0.5)
        for section in ("import", "rendezvous", "build", "load"):
            beat = {"t": "beat", "phase": "startup", "section": section, "step": 0}
            sup.handle(peers[r], beat, 0.6)
        sup.handle(peers[r], {"t": "beat", "phase": "step", "stage": "begin", "step": 1}, 0.7)
    for i, (node, lines) in enumerate(_stream()):
        b = Batcher()
        for rank, msg in lines:
            b.add(rank, encode(msg).rstrip(b"\n"), 0.0)
        entry = batch_entry(nodes[node], json.loads(b.frame()))  # the channel thread's
        sup.handle(nodes[node], entry, 1.0 + i * 0.05)
    sup.metrics_out.close()
    finding = sup.monitor.check(1.0 + len(_stream()) * 0.05 + 500.0)
    return sup, run, calls["groups"], finding


def _events(run) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("ts", "time")} for e in read_jsonl(run.events)]


def _entries(heap: list, valid) -> list:
    """A deadline heap's (key, rank) pairs still true of their rank, a group entry's one a rank
    (``hang._push``): what the checks read (how many stale entries wait to be popped is not
    state: one by one a node's records and beats of one arrival are two entries a rank)."""
    pairs = {(e[0], r) for e in heap for r in (e[2] if len(e) > 2 else [e[1]])}
    return sorted(p for p in pairs if valid(*p))


def _hang_state(mon) -> dict:
    rk = mon.ranks
    return {
        "ranks": {
            r: {k: v for k, v in dataclasses.asdict(st).items() if k != "refs"}
            for r, st in mon.ranks.items()
        },
        "learned": {
            s: (d.n, list(d.counts), list(d.mins)) for s, d in mon.learned.sections.items()
        },
        "recent": (list(mon._recent), mon._recent_i),
        "progress": {
            s: _entries(h, lambda k, r, s=s: (rk[r].section, rk[r].last_progress) == (s, k))
            for s, h in mon._progress.items()
        },
        "seen": _entries(mon._seen, lambda k, r: rk[r].seen_key == k),
        "resumed_at": mon.resumed_at,
    }


def test_a_nodes_step_group_as_one_unit_has_the_effect_of_its_messages_one_by_one(tmp_path):
    grouped, run_g, n_groups, finding_g = _run(tmp_path / "groups", groups=True)
    alone, run_a, n_alone, finding_a = _run(tmp_path / "alone", groups=False)
    assert n_alone == 0 and n_groups > 2 * len(_stream())  # records and beats went as groups
    assert run_g.metrics.read_bytes() == run_a.metrics.read_bytes()
    events = _events(run_g)
    assert events == _events(run_a)
    kinds = {(e.get("kind"), e.get("monitor")) for e in events}
    troubles = {("anomaly", m) for m in ("nan", "loss_spike", "grad_explosion")}
    troubles |= {("straggler", None), ("monitor_error", "raises")}
    troubles |= {("anomaly", "says"), ("anomaly", "says-late")}
    assert troubles <= kinds, kinds  # the stream's troubles were found
    assert grouped.feed.errors == alone.feed.errors and grouped.feed.errors["raises"] > 20
    assert _hang_state(grouped.monitor) == _hang_state(alone.monitor)
    assert finding_g is not None and finding_g.as_event(1) == finding_a.as_event(1)
    assert (grouped.step, grouped.state) == (alone.step, alone.state) and grouped.step == 34
    assert {r: (grouped.rank_step(i), i.step_s) for r, i in grouped.ranks.items()} == {
        r: (alone.rank_step(i), i.step_s) for r, i in alone.ranks.items()
    }
