"""The node agent between a node's ranks and the supervisor (issue 24). Liveness: the ranks'
``ping`` lines stay on the node, one ``a`` frame a second names the ranks heard from and how long
ago, and the supervisor turns it into the same ``last_seen`` a ping a rank gave. Batches: one ``b``
frame a few ms, a step's records as differences from the first, rebuilt exactly on the supervisor
(values, types, key order), each rank's lines in the order it sent them, a broken or forged line
dropped without its neighbours. Stacks: one reply a node at a hang, one file a node. Real agent
relay, real channel server, real rank clients on the agent's loopback listener (no torchrun: the
ranks are this test); the wire format is in ``ops/rank/channel.py``."""

from __future__ import annotations

import json
import os
import queue
import random
import time

import pytest

from ptops.monitors.hang import HangConfig, HangMonitor
from ptops.ops.node.agent import relay_in_thread
from ptops.ops.rank.channel import (
    BATCH_S,
    ENV_ADDRESS,
    ENV_TOKEN,
    Batcher,
    ChannelClient,
    encode,
    relay_frame,
    unbatch,
)
from ptops.ops.supervisor.channel import ChannelServer, batch_items


def _next(server: ChannelServer, t: str, timeout: float = 10.0):
    """The next inbox message of type ``t``; a node's batch is looked into (its rank messages)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            peer, msg, ts = server.inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        if msg.get("t") == t:
            return peer, msg, ts
        for vp, m, _ in batch_items(msg) if msg.get("t") == "_batch" else ():
            if m.get("t") == t:
                return vp, m, ts
    pytest.fail(f"no {t!r} message")


@pytest.fixture
def relay():
    server = ChannelServer()
    try:
        with relay_in_thread(server.address(), server.token) as agent:
            yield server, agent, agent.local_address
    finally:
        server.close()


def test_pings_stay_on_the_node_and_one_frame_names_the_ranks_heard(relay):
    server, agent, local = relay
    _next(server, "_hello")  # the node itself
    ranks = [
        ChannelClient(local, agent.local_token, {"role": "rank", "rank": r, "pid": 1, "host": "n"})
        for r in (4, 5)
    ]
    hellos = {_next(server, "_hello")[0].rank for _ in ranks}
    assert hellos == {4, 5}
    ranks[0].send({"t": "ping", "step": 1, "phase": "step"})
    ranks[0].send({"t": "beat", "step": 1, "phase": "step", "stage": "begin"})
    ranks[1].send({"t": "ping", "step": 1, "phase": "step"})
    peer, beat, _ = _next(server, "beat")  # progress is relayed as before
    assert peer.rank == 4
    deadline = time.monotonic() + 5
    while len(agent._heard) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the lines are ~0.2 s old when the frame leaves
    # rank 4's beat went up (a sign of life to the supervisor): only rank 5, heard by its ping
    frame = agent.alive_frame()
    assert frame is not None and len(frame["c"]) == 1 and all(150 <= a < 5000 for a in frame["ms"])
    assert agent.alive_frame() is None  # nothing heard since
    agent.up.send(frame)
    node, alive, recv = _next(server, "_alive")
    assert node.role == "node"
    seen = {vp.rank: at for vp, at in alive["seen"]}
    assert set(seen) == {5} and all(recv - 5 < at <= recv - 0.15 for at in seen.values())
    # the next interval: rank 4 only pings (stuck in a collective): listed again
    ranks[0].send({"t": "ping", "step": 1, "phase": "step"})
    deadline = time.monotonic() + 5
    while not agent._heard and time.monotonic() < deadline:
        time.sleep(0.05)
    frame = agent.alive_frame()
    assert frame is not None and len(frame["c"]) == 1
    agent.up.send(frame)
    assert {vp.rank for vp, _ in _next(server, "_alive")[1]["seen"]} == {4}
    # no ping ever reached the supervisor's inbox
    rest = []
    while not server.inbox.empty():
        msg = server.inbox.get_nowait()[1]
        rest += [msg.get("t")] + [m.get("t") for _, m in msg.get("items") or ()]
    assert "ping" not in rest
    for c in ranks:
        c.sock.close()


def test_a_malformed_or_foreign_frame_names_nobody(relay):
    server, agent, local = relay
    _next(server, "_hello")
    rank = ChannelClient(
        local, agent.local_token, {"role": "rank", "rank": 2, "pid": 1, "host": "n"}
    )
    _next(server, "_hello")
    sub = next(iter(agent._conns))
    for bad in (
        {"t": "a", "c": [sub], "ms": []},  # lengths differ
        {"t": "a", "c": "1", "ms": [1]},
        {"t": "a", "c": [sub + 100], "ms": [10]},  # not one of this node's ranks
        {"t": "a", "c": [sub], "ms": [-5]},  # an age from the future
        {"t": "a", "c": [sub], "ms": [1e12]},
    ):
        agent.up.send(bad)
    agent.up.send({"t": "a", "c": [sub], "ms": [30]})
    _, alive, _ = _next(server, "_alive")  # only the last, well-formed one
    assert [vp.rank for vp, _ in alive["seen"]] == [2]
    rank.sock.close()


def test_seen_is_a_ping_for_the_hang_monitor():
    cfg = HangConfig(floor_s=5.0, ping_stale_s=3.0)
    a, b = HangMonitor(2, 0.0, cfg), HangMonitor(2, 0.0, cfg)
    for m in (a, b):
        for r in (0, 1):
            m.observe(
                {"kind": "beat", "rank": r, "step": 1, "phase": "step", "stage": "begin", "ts": 1}
            )
    for t in (2.0, 3.0, 4.0):
        a.observe({"kind": "ping", "rank": 0, "ts": t})
        b.seen(0, t)
    for now in (5.0, 6.5, 9.0, 12.0):
        fa, fb = a.check(now), b.check(now)
        assert (fa is None) == (fb is None) and (fa is None or fa.ranks == fb.ranks)
    assert a.ranks[0].last_seen == b.ranks[0].last_seen == 4.0
    b.seen(7, 10.0)  # a rank the monitor had not met: as a ping would
    assert b.ranks[7].last_seen == 10.0


# ---------------------------------------------------------------- batches


def _line(msg: dict) -> bytes:
    return encode(msg).rstrip(b"\n")


def _record(rank: int, step: int, rng: random.Random) -> dict:
    """A record with the traps a diff could lose: 1 / 1.0 / True, 0.0 / -0.0, NaN, None, a list,
    and values the ranks share or not."""
    return {
        "step": step,
        "rank": rank,
        "attempt": 1,
        "loss": 6.5 - 0.01 * step,  # the run's: the same on every rank
        "step_s": rng.choice([0.5, 0.5, 0.51]),
        "zero": rng.choice([0.0, -0.0]),
        "one": rng.choice([1, 1.0, True]),
        "gone": rng.choice([None, None, "nan"]),
        "nan": float("nan"),
        "hist": [1, rng.choice([2, 2.0])],
        "ts": 1000.0 + step,
    }


def _same(a, b) -> bool:
    """Equal as JSON text (types, signs, order) - NaN included."""
    return json.dumps(a) == json.dumps(b)


def test_a_batch_rebuilds_every_line_exactly_in_each_ranks_order():
    rng = random.Random(7)
    for trial in range(50):
        b = Batcher()
        sent: dict[int, list[dict]] = {}
        for step in range(1, rng.randint(2, 4)):
            order = list(range(1, rng.randint(2, 9)))
            rng.shuffle(order)
            for cid in order:
                lines = [{"t": "metrics", "rec": _record(cid - 1, step, rng), "ts": 5.0}]
                if rng.random() < 0.3:
                    del lines[0]["rec"]["hist"]  # other keys: relayed whole
                if rng.random() < 0.5:
                    lines.append({"t": "beat", "step": step + 1, "stage": "begin"})
                if rng.random() < 0.2:
                    lines.insert(0, {"t": "event", "kind": "x", "step": step})
                for msg in lines:
                    assert b.add(cid, _line(msg), 0.0)
                    sent.setdefault(cid, []).append(msg)
        frame = b.frame()
        assert frame is not None and frame.endswith(b"\n") and b.frame() is None
        got: dict[int, list[dict]] = {}
        for cid, msg in unbatch(json.loads(frame)):
            got.setdefault(cid, []).append(msg)
        assert got.keys() == sent.keys(), trial
        for cid in sent:
            assert _same(got[cid], sent[cid]), (trial, cid)
            for g, s in zip(got[cid], sent[cid]):
                if g["t"] == "metrics":
                    assert list(g["rec"]) == list(s["rec"])  # key order kept


def test_records_of_one_step_cross_as_differences():
    rng = random.Random(1)
    b, plain = Batcher(), 0
    for cid in range(1, 9):
        raw = _line({"t": "metrics", "rec": _record(cid - 1, 3, rng), "ts": 5.0})
        plain += len(relay_frame(cid, raw))
        b.add(cid, raw, 0.0)
    frame = b.frame()
    assert len(frame) < 0.7 * plain
    parsed = json.loads(frame)
    assert len(parsed["k"]) == 1  # one leader for the step
    assert all("loss" not in m["rec"] for m in parsed["m"])  # the shared value crossed once


def test_a_record_after_its_ranks_later_line_starts_a_new_group():
    """Rank 2's record may not move ahead of a line rank 2 sent before it."""
    b = Batcher()
    rec = lambda r: {"t": "metrics", "rec": {"step": 1, "rank": r, "loss": 1.0}}  # noqa: E731
    b.add(1, _line(rec(0)), 0.0)
    b.add(2, _line({"t": "beat", "step": 1, "stage": "end"}), 0.0)
    b.add(2, _line(rec(1)), 0.0)
    frame = json.loads(b.frame())
    assert [m["t"] for m in frame["m"]] == ["metrics", "beat", "metrics"]
    assert frame["c"] == [1, 2, 2]
    out = unbatch(frame)
    assert [m["rec"]["rank"] for _, m in out if m["t"] == "metrics"] == [0, 1]


def test_the_beats_that_begin_a_step_cross_as_one_line():
    """A step's begin beats of several ranks are one line (``_b``: the same beat from these
    connections too), each rank given its beat back; a beat with another key, or of a rank that
    sent a line since the group's place, goes alone; a rank's own ``_b`` is refused (it would
    speak for other ranks); a summary after a folded line still stands after the right pairs."""
    beat = lambda step, ts, **kw: {  # noqa: E731
        "t": "beat", "step": step, "phase": "step", "stage": "begin", "ts": ts, **kw
    }  # fmt: skip
    b = Batcher()
    for c in range(1, 9):
        assert b.add(c, _line(beat(5, 100.0 + c)), 0.0)
    assert b.add(9, _line({"t": "event", "kind": "x"}), 0.0)
    assert b.add(9, _line(beat(5, 200.0)), 0.0)  # after its own line: a group of its own
    assert b.add(10, _line(beat(5, 300.0, section="data")), 0.0)  # another key: whole
    assert not b.add(11, _line({**beat(5, 1.0), "_b": [1, 2]}), 0.0)
    frame = json.loads(b.frame())
    assert frame["c"] == [1, 9, 9, 10]
    assert frame["m"][0] == {**beat(5, 101.0), "_b": [2, 3, 4, 5, 6, 7, 8]}
    out = unbatch(frame)
    assert out == [(c, beat(5, 101.0)) for c in range(1, 9)] + [
        (9, {"t": "event", "kind": "x"}),
        (9, beat(5, 200.0)),
        (10, beat(5, 300.0, section="data")),
    ]
    for bad in ([{"t": "beat", "step": 5, "_b": [2]}], [{**beat(5, 1.0, section="x"), "_b": [2]}]):
        assert unbatch({"t": "b", "c": [1], "m": bad}) == []  # no begin beat: dropped, alone
    # node summaries: 4 ranks' beats of step 7, then their records, 3 of them summed up
    b = Batcher(every=60, read=frozenset({"loss"}))
    for c in range(1, 5):
        b.add(c, _line(beat(7, 1.0)), 0.0)
    for c in range(1, 5):
        rec = {"step": 7, "rank": c - 1, "loss": 2.0, "step_s": 0.5 + c / 100}
        b.add(c, _line({"t": "metrics", "rec": rec}), 0.0)
    frame = json.loads(b.frame())
    assert frame["c"] == [1, 1] and frame["s"][0][:3] == [2, 1, [2, 3, 4]]
    sums: list = []
    out = unbatch(frame, sums=sums)
    assert [c for c, _ in out] == [1, 2, 3, 4, 1]
    ((at, lead, cids, entry, _, _),) = sums
    assert (at, lead, cids, entry["step"]) == (5, 4, [2, 3, 4], 7)  # after the 4 beats + leader


def test_broken_forged_and_malformed_entries_drop_alone():
    b = Batcher()
    assert not b.add(1, b'{"t":"beat"', 0.0)  # cut short
    assert not b.add(1, b"[1, 2]", 0.0)  # no object
    assert not b.add(1, b'{"t":"metrics","rec":{"step":1},"_k":0}', 0.0)  # the frame's own key
    assert b.add(2, _line({"t": "beat", "step": 1}), 0.0)
    assert unbatch(json.loads(b.frame())) == [(2, {"t": "beat", "step": 1})]
    bad = {
        "t": "b",
        "c": [1, 2, 3, 4],
        "k": [{"step": 1, "rank": 0}],
        "m": [
            {"t": "metrics", "rec": {"rank": 1}, "_k": 5},  # no such leader
            {"t": "metrics", "rec": "x", "_k": 0},
            7,
            {"t": "metrics", "rec": {"rank": 3}, "_k": 0},
        ],
    }
    assert unbatch(bad) == [(4, {"t": "metrics", "rec": {"step": 1, "rank": 3}})]
    assert unbatch({"t": "b", "c": [1], "m": []}) == []  # lengths differ


def test_a_certificate_names_the_leader_and_exactly_the_keys_that_differ():
    """``unbatch``'s likes: the node's first record of a step goes whole (no certificate); each
    later one of its group says (the leader's rank, the keys sent), and every other key holds the
    leader's own value. A certificate comes from the frame's structure only: a message's own
    fields cannot make one, and a group whose first entry is cut (not the leader) certifies
    nothing."""
    base = {"step": 3, "rank": 0, "loss": 2.5, "step_s": 0.5, "ok": 1.0, "z": 0.0}
    b = Batcher()
    b.add(1, _line({"t": "metrics", "rec": base}), 0.0)
    b.add(2, _line({"t": "metrics", "rec": {**base, "rank": 1, "step_s": 0.6}}), 0.0)
    b.add(3, _line({"t": "metrics", "rec": {**base, "rank": 2, "ok": 1, "z": -0.0}}), 0.0)
    b.add(4, _line({"t": "metrics", "rec": {**base, "rank": 3}, "like": [0, []]}), 0.0)
    likes: list = []
    out = unbatch(json.loads(b.frame()), likes)
    assert [m["rec"] for _, m in out][1] == {**base, "rank": 1, "step_s": 0.6}
    assert likes == [
        None,
        (0, frozenset({"rank", "step_s"})),
        (0, frozenset({"rank", "ok", "z"})),  # 1 is not 1.0, -0.0 is not 0.0
        (0, frozenset({"rank"})),  # its own "like" field is a field, nothing more
    ]
    forged = {
        "t": "b",
        "c": [1, 2],
        "k": [base],
        "m": [
            {"t": "metrics", "rec": {"loss": 9.0}, "_k": 0},  # cut: not the leader itself
            {"t": "metrics", "rec": {"rank": 1}, "_k": 0},
        ],
    }
    likes = []
    assert len(unbatch(forged, likes)) == 2 and likes == [None, None]


def test_due_after_the_hold_or_the_size():
    b = Batcher()
    assert not b.due(0.0) and b.wait_s(0.0, 0.5) == 0.5
    b.add(1, _line({"t": "beat", "step": 1}), 10.0)
    assert not b.due(10.0) and b.wait_s(10.0, 0.5) == pytest.approx(BATCH_S)
    assert b.due(10.0 + 2 * BATCH_S)
    b2 = Batcher()
    b2.add(1, _line({"t": "event", "text": "x" * 300_000}), 0.0)
    assert b2.due(0.0)


# ---------------------------------------------------------------- a real agent and server


def _rank_messages(server: ChannelServer, n: int, timeout: float = 10.0) -> list:
    """(rank, message, inbox entry type) of the next ``n`` rank messages."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            peer, msg, _ = server.inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        if msg.get("t") == "_batch":
            out += [(vp.rank, m, "_batch") for vp, m, _ in batch_items(msg)]
        elif peer.role == "rank" and not msg["t"].startswith("_"):
            out.append((peer.rank, msg, msg["t"]))
    return out


def test_the_agent_batches_and_the_server_rebuilds(relay):
    server, agent, local = relay
    ranks = [
        ChannelClient(local, agent.local_token, {"role": "rank", "rank": r, "pid": 1, "host": "n"})
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 10
    while len(server.nodes()) < 1 or sum(1 for _ in agent._conns) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # both hellos relayed
    while not server.inbox.empty():
        server.inbox.get_nowait()
    rng = random.Random(3)
    sent = {0: [], 1: []}
    for step in (1, 2):
        for r, c in enumerate(ranks):
            for msg in (
                {"t": "metrics", "rec": _record(r, step, rng), "ts": 9.0},
                {"t": "beat", "step": step + 1, "phase": "step", "stage": "begin"},
            ):
                c.send(msg)
                sent[r].append(msg)
    ranks[1].sock.sendall(b'{"t":"beat","step":\n')  # a broken line: dropped alone
    ranks[0].send({"t": "exit", "code": 0})
    sent[0].append({"t": "exit", "code": 0})
    got = _rank_messages(server, 9)
    assert {kind for _, _, kind in got} == {"_batch"}
    for r in (0, 1):
        assert _same([m for rank, m, _ in got if rank == r], sent[r])
    # a batch counts its messages in what the server received (+ the node's and ranks' hellos)
    assert server.received == len(got) + 3
    for c in ranks:
        c.sock.close()


# ---------------------------------------------------------------- stacks: one reply a node


def test_the_agent_gathers_its_ranks_stacks_in_one_reply(relay):
    """``dump``: the ranks asked answer over their connections (their answers are not relayed one
    by one); a rank not asked (not even pinging) goes to py-spy; ONE ``node_stacks`` comes back."""
    server, agent, local = relay
    answers = []

    def answer(msg):
        if msg.get("cmd") == "stacks":
            answers.append(msg["id"])
            ranks[0].send({"t": "stacks", "id": msg["id"], "text": "Thread 1 (most recent...)"})

    ranks = [
        ChannelClient(
            local,
            agent.local_token,
            {"role": "rank", "rank": r, "pid": 1, "host": "n"},
            on_message=answer if r == 0 else None,
        )
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 10
    while len(agent._conns) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    subs = sorted(agent._conns)
    agent._from_supervisor(
        {
            "cmd": "dump",
            "id": 4,
            "timeout_s": 0.5,
            "ranks": {
                "0": {"c": subs[0], "pid": 999_999_991, "ask": True},
                "1": {"c": subs[1], "pid": 999_999_992, "ask": False},  # silent: py-spy only
                "x": {"c": "bad"},  # malformed: skipped
            },
        }
    )
    # the reply comes beside the inbox (``replies``: never behind a backlog), and the rank's own
    # answer is not relayed as a rank message
    peer, reply, _ = server.replies.get(timeout=30)
    assert peer.role == "node" and reply["t"] == "node_stacks"
    while not server.inbox.empty():
        msg = server.inbox.get_nowait()[1]
        assert msg.get("t") != "node_stacks"
        assert "stacks" not in [m.get("t") for _, m in msg.get("items") or ()]
    assert reply["id"] == 4 and answers == [0]
    got = reply["stacks"]
    assert set(got) == {"0", "1"}
    assert got["0"]["note"] == "channel" and got["0"]["text"].startswith("Thread 1")
    assert got["1"]["note"] != "channel" and not got["1"]["text"]  # no such process to py-spy
    for c in ranks:
        c.sock.close()


def test_the_wait_for_stacks_ends_when_each_asked_rank_is_answered_for():
    """The supervisor's side: each reply crosses off its own ranks (no walk of every rank and
    every link after each reply: O(nodes x ranks) at a hang); it stops reading once all are
    answered for, looks at the links only when no reply comes, and a reply's rank that only
    looks like a number ("\u00b2" is a digit to str.isdigit) is dropped, not fatal."""
    from types import SimpleNamespace

    from ptops.ops.supervisor.hangs import HangMixin
    from ptops.ops.supervisor.messages import MessagesMixin

    class Replies:
        def __init__(self, items):
            self.items, self.empties = list(items), 0

        def get(self, timeout):
            if not self.items:
                self.empties += 1
                raise queue.Empty
            return self.items.pop(0)

    def host(items, closed=False):
        h = SimpleNamespace(node_stacks={}, cfg=SimpleNamespace(stack_timeout_s=5.0))
        h.server = SimpleNamespace(replies=Replies(items))
        h.handle = lambda peer, msg, ts: MessagesMixin._on_node_stacks(h, peer, msg, ts)
        peers = {n: SimpleNamespace(closed=closed, hello={"node": n}) for n in "abc"}
        by_node = {n: (peers[n], {str(2 * i): {}, str(2 * i + 1): {}}) for i, n in enumerate("abc")}
        return h, peers, by_node

    def reply(peer, ranks, **extra):
        stacks = {str(r): {"text": f"rank {r}"} for r in ranks}
        return peer, {"t": "node_stacks", "stacks": {**stacks, **extra}}, 0.0

    h, peers, by_node = host([])
    late = reply(peers["c"], [5])
    h.server.replies.items = [
        reply(peers["a"], [0, 1], **{"\u00b2": {"text": "odd"}}),
        reply(peers["b"], [2, 3]),
        reply(peers["c"], [4, 5]),
        late,  # after every asked rank is answered for: not read
    ]
    HangMixin._wait_node_agents(h, by_node)
    assert sorted(h.node_stacks) == [0, 1, 2, 3, 4, 5]
    assert h.server.replies.items == [late] and h.server.replies.empties == 0

    h, peers, by_node = host([reply(peers["a"], [0, 1])], closed=True)  # every link gone
    HangMixin._wait_node_agents(h, by_node)
    assert sorted(h.node_stacks) == [0, 1] and h.server.replies.empties == 1


def test_a_node_file_reads_back_rank_by_rank(tmp_path):
    from ptops.diagnostics.stacks import analyse, node_sections, read_attempt
    from ptops.ops.runrecord.rundir import STACK_SECTION

    head = 'Thread 0x1 "MainThread" (most recent call last):\n'
    wait = head + '  File "/x/c10d.py", line 9, in all_reduce\n'
    odd = head + '  File "/x/data.py", line 3, in next_batch\n'
    src = "# source: channel (the rank's own dump)"
    parts = [f"{STACK_SECTION % r}\n{src}\n{wait}" for r in (8, 9)]
    parts.append(f"{STACK_SECTION % 10}\n# source: node agent n2: py-spy\n{odd}")
    parts.append(f"{STACK_SECTION % 11}\n# no stack: node agent n2: no answer\n")
    (tmp_path / "node-n2.txt").write_text("\n".join(parts))
    (tmp_path / "rank-0.txt").write_text(f"# source: channel\n{wait}")
    got = read_attempt(tmp_path)
    assert sorted(got) == [0, 8, 9, 10, 11]
    assert got[10].top.func == "next_batch" and got[10].source.startswith("node agent n2")
    assert got[11].note.startswith("no stack") or "no answer" in (got[11].note or "")
    res = analyse(tmp_path, blamed=[10])
    assert res is not None and 10 in res["odd"]["ranks"]
    assert node_sections("garbage\n#### rank x ####\n") == {}  # a hostile file: nothing, no error


# ------------------------------------------------------------ the local path (a one-node run)
def test_a_local_attempt_runs_its_launcher_through_the_node_agent(tmp_path):
    """Every local attempt is a one-node run: the supervisor starts the agent, which starts the
    launcher it was given (torchrun, or warmlaunch on a warm restart; here a stand-in rank) with
    its output where the supervisor reads torchrun's lines; the rank reaches the supervisor through
    the agent (a node peer), and the agent exits as the launcher did. A Slurm variable in the
    environment (a run started inside an allocation) does not make it node 3 of something."""
    import subprocess
    import sys

    from ptops.ops.supervisor.launcher import RankCommand, node_agent_command

    rank = (
        "import os, sys; from ptops.ops.rank.channel import ChannelClient, ENV_ADDRESS, ENV_TOKEN; "
        "c = ChannelClient(os.environ[ENV_ADDRESS], os.environ[ENV_TOKEN], "
        "{'rank': 0, 'pid': os.getpid(), 'attempt': 1}); "
        "c.send({'t': 'beat', 'step': 1, 'phase': 'step'}); c.close(); "
        "print('launcher says bye'); sys.exit(3)"
    )
    server = ChannelServer()
    log = tmp_path / "torchrun.log"
    cmd = node_agent_command(RankCommand([sys.executable, "-c", rank], {}), 1, log)
    assert cmd.argv[-2:] == ["-m", "ptops.ops.node.agent"]
    assert json.loads(cmd.env["PTOPS_NODE_ARGV"])[1] == "-c"
    env = {**os.environ, **cmd.env, ENV_ADDRESS: server.address(), ENV_TOKEN: server.token}
    env.update({"SLURM_NODEID": "3", "PTOPS_ATTEMPT": "1"})
    try:
        with open(log, "ab") as out:
            agent = subprocess.Popen(cmd.argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            peer, beat, _ = _next(server, "beat", timeout=30)
            assert agent.wait(timeout=30) == 3
    finally:
        server.close()
    assert beat["step"] == 1 and peer.rank == 0
    assert peer.via is not None and peer.via.hello["node_rank"] == 0  # through the node agent
    text = log.read_text()
    assert "launcher says bye" in text and "local node: launcher pid" in text


@pytest.mark.parametrize("raw", ["{}", "[]", '["python", 3]', '"python"'])
def test_a_launcher_that_is_not_a_list_of_strings_is_refused(raw):
    from ptops.ops.node.agent import _launcher_argv

    with pytest.raises(ValueError, match="PTOPS_NODE_ARGV: expected a JSON list of strings"):
        _launcher_argv(raw)


@pytest.mark.parametrize("code", [0, 1, 3, -9, -15])
def test_the_local_agent_exits_as_its_launcher_did(code):
    """The supervisor blames on the launcher's status (blame.root_cause): a code passes through,
    and so does death by a signal."""
    import subprocess
    import sys

    prog = f"from ptops.ops.node.agent import _exit_as; _exit_as({code})"
    assert subprocess.run([sys.executable, "-c", prog], timeout=30).returncode == code


def test_the_agent_starts_without_the_supervisors_imports():
    """The agent is started on every attempt, restarts included: importing it must not pull in
    the supervisor (~0.7 s: pydantic, the monitors, the recipes) or torch."""
    import subprocess
    import sys

    prog = (
        "import sys, ptops.ops.node.agent; "
        "print(sorted(m for m in sys.modules if m.startswith(('ptops.ops.supervisor.core', "
        "'ptops.monitors', 'ptops.recipes', 'torch', 'pydantic'))))"
    )
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
