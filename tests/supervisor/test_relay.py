"""The relay between node agents and the supervisor (issue 24; ``ops/node/relay.py``). To the
supervisor a relay is one node agent whose ranks live on several hosts; to an agent it is the
supervisor. Checked here with the real parts on loopback: a real channel server, a real relay,
real node agents (``relay_in_thread``), real rank clients. What must hold: every rank's lines
arrive exactly as sent and in its order, under its own node's name; a step's records of several
nodes cross as ONE group (a leader and certified differences) and, with node summaries, their
routine ranks as ONE summary over the nodes; commands, ``g`` and liveness find the right rank
through two numberings; a hang's ``dump`` reaches each agent under its own numbers, and an agent
gone silent is answered for by the relay at once."""

from __future__ import annotations

import contextlib
import json
import queue
import random
import socket
import threading
import time

import pytest
from test_node_agent import _rank_messages, _record, _same

from ptops.ops.node import relay as relay_mod
from ptops.ops.node.agent import relay_in_thread
from ptops.ops.rank import channel as channel_mod
from ptops.ops.rank.channel import (
    ENV_ADDRESS,
    ENV_TOKEN,
    SUMMARY_ENV,
    SUMMED,
    ChannelClient,
    encode,
)
from ptops.ops.supervisor.channel import ChannelServer, batch_items


@contextlib.contextmanager
def _relay(server: ChannelServer, **env: str):
    r = relay_mod.Relay(
        {ENV_ADDRESS: server.address(), ENV_TOKEN: server.token, **env}, name="relay-host"
    )
    t = threading.Thread(target=r.loop, daemon=True)
    t.start()
    try:
        yield r
    finally:
        r.stop("over")
        t.join(timeout=5)


@contextlib.contextmanager
def _nodes(relay: relay_mod.Relay, server: ChannelServer, per_node: dict[str, list[int]]):
    """Agents named after ``per_node``'s keys behind ``relay``, each with its ranks connected:
    ``{rank: its client}``, with ``.got`` ({rank: the commands it got}) and ``.agents`` ({name:
    agent}). The agents relay only (no ``run``): a test sends their ``a`` frames and keepalives."""
    with contextlib.ExitStack() as stack:
        cs = _Clients()
        for name, ranks in per_node.items():
            agent = stack.enter_context(relay_in_thread(relay.address, server.token))
            agent.node = name  # what its ranks' hellos say (a host name a node)
            cs.agents[name] = agent
            for r in ranks:
                cs.got[r] = []
                cs[r] = ChannelClient(
                    agent.local_address,
                    agent.local_token,
                    {"role": "rank", "rank": r, "pid": 1000 + r, "host": name},
                    on_message=cs.got[r].append,
                )
        _until(lambda: len(relay._down) == len(cs))
        _until(lambda: sum(len(n.subs) for n in server.nodes()) == len(cs))
        yield cs
        for c in cs.values():
            c.close()


class _Clients(dict):
    def __init__(self) -> None:
        super().__init__()
        self.got: dict[int, list] = {}
        self.agents: dict = {}


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _drain(server: ChannelServer) -> list:
    time.sleep(0.3)
    out = []
    while not server.inbox.empty():
        out.append(server.inbox.get_nowait())
    return out


def test_ranks_of_many_nodes_reach_the_supervisor_through_one_relay_exactly():
    server = ChannelServer()
    try:
        with _relay(server) as relay, _nodes(relay, server, {"n1": [0, 1], "n2": [2, 3]}) as cs:
            # one link at the supervisor; each rank's hello keeps its own node's name
            assert [n.hello["node"] for n in server.nodes()] == ["relay-host"]
            (link,) = server.nodes()
            assert {vp.hello["rank"]: vp.hello["node"] for vp in link.subs.values()} == {
                0: "n1",
                1: "n1",
                2: "n2",
                3: "n2",
            }
            _drain(server)
            rng = random.Random(5)
            sent: dict[int, list] = {r: [] for r in cs}
            for step in (1, 2):
                for r, c in cs.items():
                    for msg in (
                        {"t": "metrics", "rec": _record(r, step, rng), "ts": 9.0},
                        {"t": "beat", "step": step + 1, "phase": "step", "stage": "begin"},
                    ):
                        c.send(msg)
                        sent[r].append(msg)
            got = _rank_messages(server, 16)
            for r in cs:
                assert _same([m for rank, m, _ in got if rank == r], sent[r]), r
    finally:
        server.close()


def _one_window(monkeypatch) -> None:
    """Agents and relay hold their batches 2 s (not 20 ms) and the relay's ``a`` frame waits: a
    step's lines of both nodes meet in ONE relay batch however slow the machine is that second."""
    monkeypatch.setattr(channel_mod, "BATCH_S", 2.0)
    monkeypatch.setattr(relay_mod, "ALIVE_S", 3600.0)


def test_a_steps_records_of_two_nodes_cross_as_one_group(monkeypatch):
    """The point of the relay: one leader for the step over all its nodes, the other nodes'
    records certified as its differences (the supervisor's ``like``), not a leader a node."""
    _one_window(monkeypatch)
    server = ChannelServer()
    try:
        with _relay(server) as relay, _nodes(relay, server, {"n1": [0, 1], "n2": [2, 3]}) as cs:
            _drain(server)
            base = {"step": 4, "loss": 2.5, "lr": 1e-4, "step_s": 1.0}
            for r, c in cs.items():
                c.send({"t": "metrics", "rec": {**base, "rank": r, "step_s": 1.0 + r / 10}})
            items = []
            _until(lambda: items.extend(_batched(server)) or len(items) >= 4)
            likes = {vp.rank: like for vp, m, like in items if m.get("t") == "metrics"}
            assert sorted(likes) == [0, 1, 2, 3]
            leader = next(r for r, like in likes.items() if like is None)
            assert all(
                like == (leader, frozenset({"rank", "step_s"}))
                for r, like in likes.items()
                if r != leader
            )
    finally:
        server.close()


def _batched(server: ChannelServer) -> list:
    out = []
    for _, msg, _ in _drain(server):
        if msg.get("t") == "_batch":
            out += batch_items(msg)
    return out


def test_routine_ranks_of_all_its_nodes_become_one_summary(monkeypatch):
    """``PTOPS_NODE_SUMMARY`` on the relay: the routine ranks of both nodes (between samples, not
    rank 0, differing only in keys no shared monitor reads) leave as ONE summary entry, the rule
    of ``ops/runrecord/nodesummary.py`` over the relay's ranks."""
    _one_window(monkeypatch)
    server = ChannelServer()
    cfg = json.dumps({"every": 10, "read": ["loss"]})
    try:
        with (
            _relay(server, **{SUMMARY_ENV: cfg}) as relay,
            _nodes(relay, server, {"n1": [0, 1, 2], "n2": [3, 4, 5]}) as cs,
        ):
            _drain(server)
            for r, c in cs.items():
                rec = {"step": 3, "rank": r, "loss": 2.5, "step_s": 1.0 + r / 10}
                c.send({"t": "metrics", "rec": rec})
            items = []
            _until(lambda: items.extend(_batched(server)) or any(x[2] is SUMMED for x in items))
            (summary,) = [m for _, m, like in items if like is SUMMED]
            summed = sorted(vp.rank for vp in summary["ranks"])
            whole = sorted(vp.rank for vp, m, like in items if like is not SUMMED)
            # rank 0 always whole (status and resume read it), and the group's leader: the first
            # record the relay got, of whichever node's frame came first
            assert 0 in whole and len(whole) <= 2 and sorted(whole + summed) == list(range(6))
            assert {1, 2} & set(summed) and {4, 5} & set(summed)  # over both nodes: one entry
            assert summary["entry"]["keys"]["step_s"][3:] == [1.5, 5]  # the max and its rank
    finally:
        server.close()


def _record_frames(server: ChannelServer) -> list[list[tuple[int, int]]]:
    """Each relay frame that reached the supervisor: its records' (rank, step), in order."""
    return [
        [(vp.rank, m["rec"]["step"]) for vp, m, _ in batch_items(msg) if m.get("t") == "metrics"]
        for _, msg, _ in _drain(server)
        if msg.get("t") == "_batch"
    ]


def test_a_step_that_comes_in_pieces_leaves_the_relay_as_one_group_in_one_order(monkeypatch):
    """A real job's agents' frames reach their relay over tens of ms, so a step comes in pieces that
    differ from step to step. The relay holds a step until it has the ranks its step before had
    and sends its ranks in one order, the lowest number leading: the supervisor then sees the same
    list every step (its cohorts: one update a relay-step, not one a rank). Its liveness frame,
    due many times during the hold here, does not cut the step either."""
    monkeypatch.setattr(relay_mod, "ALIVE_S", 0.05)
    server = ChannelServer()
    nodes = {f"n{i}": list(range(6 * i, 6 * i + 6)) for i in range(3)}
    try:
        with _relay(server, PTOPS_RELAY_HOLD_S="5") as relay, _nodes(relay, server, nodes) as cs:
            _drain(server)
            rng = random.Random(11)
            orders = []
            for step in (1, 2, 3, 4):
                ranks = list(cs)
                rng.shuffle(ranks)
                for i, r in enumerate(ranks):  # three pieces, each past the agents' batch time
                    if i % 6 == 0:
                        time.sleep(0.06)
                    rec = {"step": step, "rank": r, "loss": 2.5, "step_s": 1.0 + r / 100}
                    cs[r].send({"t": "metrics", "rec": rec})
                frames: list = []
                _until(lambda: frames.extend(_record_frames(server)) or sum(map(len, frames)) >= 18)
                frames = [f for f in frames if f]
                assert all(st == step for f in frames for _, st in f)
                if step > 1:  # (the first step has no step before it to wait for)
                    assert len(frames) == 1, [len(f) for f in frames]
                    assert sorted(r for r, _ in frames[0]) == list(range(18))
                    orders.append([r for r, _ in frames[0]])
            assert orders[0] == orders[1] == orders[2]
    finally:
        server.close()


def test_a_held_step_leaves_when_its_ranks_are_in_or_when_the_hold_ends():
    """The hold's two ends, on the relay's ``Batcher``: a step short of its step before's ranks
    waits (up to ``hold_s`` from its oldest line), a complete one leaves after ``BATCH_S`` as any
    batch; a step after a rank is gone waits for the ranks its step before had, not forever."""
    from ptops.ops.rank.channel import BATCH_S, Batcher

    def rec(r: int, step: int) -> dict:
        return {"t": "metrics", "rec": {"step": step, "rank": r, "loss": 1.0}}

    b = Batcher(hold_s=0.25)
    for r in range(4):
        b.add(r + 1, None, 0.0, rec(r, 1), 50)
    assert b.due(2 * BATCH_S)  # the first step: nothing to wait for
    b.frame()
    for r in (2, 0, 1):  # step 2: three of four
        b.add(r + 1, None, 10.0, rec(r, 2), 50)
    assert not b.due(10.0 + 2 * BATCH_S) and not b.due(10.24)
    assert b.wait_s(10.1, 1.0) == pytest.approx(0.15)
    assert b.due(10.26)  # the hold's end: rank 3 stays behind
    b.frame()
    b.add(4, None, 10.3, rec(3, 2), 50)  # it comes late: its own frame, after BATCH_S
    assert b.due(10.3 + 2 * BATCH_S)
    b.frame()
    for r in (3, 1, 2):  # step 3 without rank 0: held, then leaves; step 4 waits for none
        b.add(r + 1, None, 20.0, rec(r, 3), 50)
    assert not b.due(20.1) and b.due(20.26)
    frame = json.loads(b.frame())
    assert frame["c"] == [2, 3, 4]  # the lowest number leads, the others in order
    for r in (2, 3, 1):
        b.add(r + 1, None, 30.0, rec(r, 4), 50)
    assert b.due(30.0 + 2 * BATCH_S)


def test_commands_goodbyes_and_liveness_find_their_rank_through_two_numberings(monkeypatch):
    monkeypatch.setattr(relay_mod, "ALIVE_S", 3600.0)  # its ``a`` frame when the test says
    server = ChannelServer()
    try:
        with _relay(server) as relay, _nodes(relay, server, {"n1": [0, 1], "n2": [2, 3]}) as cs:
            (link,) = server.nodes()
            by_rank = {vp.rank: vp for vp in link.subs.values()}
            server.send(by_rank[2], {"cmd": "stop", "why": "test"})
            _until(lambda: cs.got[2])
            assert cs.got[2] == [{"cmd": "stop", "why": "test"}]
            assert not cs.got[0] and not cs.got[1] and not cs.got[3]
            # liveness: a ping stays in the agent, the relay names the rank in its ``a`` frame;
            # rank 2, whose beat went up meanwhile (a sign of life itself), it does not name
            _drain(server)
            cs[3].send({"t": "ping", "step": 1})
            cs[2].send({"t": "ping", "step": 1})
            agent = cs.agents["n2"]
            _until(lambda: len(agent._heard) == 2)
            agent.up.send(agent.alive_frame())  # what its ``run`` sends every second
            cs[2].send({"t": "beat", "step": 1, "phase": "step", "stage": "begin"})
            two = next(sub for sub, vp in link.subs.items() if vp.rank == 2)
            _until(lambda: two in relay._stepped and len(relay._heard) == 2)
            relay._alive(time.monotonic())  # what its loop does every ALIVE_S
            seen: list = []
            _until(
                lambda: (
                    seen.extend(
                        vp.rank
                        for _, m, _ in _drain(server)
                        if m["t"] == "_alive"
                        for vp, _ in m["seen"]
                    )
                    or 3 in seen
                )
            )
            assert seen == [3]
            # a rank's connection closing is its ``_eof``, and only its
            cs[1].close()
            eofs: list = []
            _until(
                lambda: (
                    eofs.extend(p.rank for p, m, _ in _drain(server) if m["t"] == "_eof") or eofs
                )
            )
            assert eofs == [1]
    finally:
        server.close()


def test_a_relays_link_closing_ends_its_ranks_and_the_blame_goes_to_the_relays_host():
    """A relay's death ends the ranks of all its nodes at once: each one's ``_eof`` says its link
    closed (``LINK_CLOSED``, which no rank's line can carry), so the crash is blamed on the relay's
    host, not on whichever node's rank the supervisor happened to read first (a strike against an
    innocent node). A rank's own end before it (its ``g``) stays its own."""
    from types import SimpleNamespace

    from ptops.ops.supervisor.blame import Blame
    from ptops.ops.supervisor.channel import LINK_CLOSED
    from ptops.ops.supervisor.messages import MessagesMixin, RankInfo

    server = ChannelServer()
    try:
        with _relay(server) as relay, _nodes(relay, server, {"n1": [0, 1], "n2": [2, 3]}) as cs:
            _drain(server)
            got: list = []

            def eofs(n: int) -> bool:
                got.extend(
                    x for x in _drain(server) if x[1]["t"] == "_eof" and x[0].rank is not None
                )
                return len(got) >= n

            cs[3].close()
            _until(lambda: eofs(1))
            relay.stop("its host went down")
            _until(lambda: eofs(4))
        assert [(vp.rank, m.get("link") is LINK_CLOSED) for vp, m, _ in got[:1]] == [(3, False)]
        assert sorted(vp.rank for vp, _, _ in got[1:]) == [0, 1, 2]
        assert all(m.get("link") is LINK_CLOSED for _, m, _ in got[1:])

        def supervisor(blame: Blame) -> SimpleNamespace:
            ranks = {r: RankInfo(r, 1000 + r, f"n{1 + r // 2}") for r in range(4)}
            return SimpleNamespace(ranks=ranks, ranks_changed=0, blame=blame,
                                   monitor=SimpleNamespace(observe=lambda e: None))  # fmt: skip

        both, links = supervisor(Blame()), supervisor(Blame())
        for vp, m, ts in got:
            MessagesMixin._on_eof(both, vp, m, ts)
            if m.get("link") is LINK_CLOSED:
                MessagesMixin._on_eof(links, vp, m, ts)
        assert both.blame.first.rank == 3 and both.blame.link_of(3) is None
        first = links.blame.first.rank
        assert (
            links.blame.link_of(first) == "relay-host" and links.ranks[first].host != "relay-host"
        )
    finally:
        server.close()


def test_a_dump_reaches_each_agent_under_its_numbers_and_a_silent_one_is_answered_for(
    monkeypatch,
):
    monkeypatch.setattr(relay_mod, "STALE_S", 1.0)
    server = ChannelServer()
    try:
        with _relay(server) as relay, _nodes(relay, server, {"n1": [0, 1]}) as cs:
            # a second agent that said hello for one rank and then nothing (a frozen host)
            host, port = relay.address.rsplit(":", 1)
            frozen = socket.create_connection((host, int(port)))
            hello = {"t": "hello", "token": server.token, "role": "node", "node": "n9"}
            rank_hello = {"t": "hello", "role": "rank", "rank": 7, "pid": 1007, "node": "n9"}
            frozen.sendall(
                b"".join(encode(m) for m in (hello, {"t": "r", "c": 1, "m": rank_hello}))
            )
            (link,) = server.nodes()
            _until(lambda: len(link.subs) == 3)
            time.sleep(1.3)  # past STALE_S for the frozen one
            # the live agent's keepalive (its ``run``'s), seen by the relay before the dump
            (live,) = [a for a in relay._agents.values() if a.hello and a.hello["node"] != "n9"]
            t_ka = time.monotonic()
            cs.agents["n1"].up.send({"t": "ka"})
            _until(lambda: live.last_rx >= t_ka)
            ranks = {
                str(vp.rank): {"c": vp.sub, "pid": 1000 + vp.rank, "ask": True}
                for vp in link.subs.values()
            }
            ranks["99"] = {"c": [1], "pid": 1, "ask": True}  # malformed: skipped, not fatal
            server.send(link, {"cmd": "dump", "id": 3, "timeout_s": 0.2, "ranks": ranks})
            replies = {}
            deadline = time.monotonic() + 30
            while len(replies) < 3 and time.monotonic() < deadline:
                try:
                    _, msg, _ = server.replies.get(timeout=0.2)
                except queue.Empty:
                    continue
                replies.update(msg["stacks"])
            assert sorted(replies) == ["0", "1", "7"]
            assert "behind relay relay-host" in replies["7"]["note"]
            assert replies["7"]["text"] is None
            # the live agent was asked under ITS numbers: each rank got its own ``stacks`` request
            assert cs.got[0] == [{"cmd": "stacks", "id": 0}]
            assert cs.got[1] == [{"cmd": "stacks", "id": 1}]
            assert "behind relay" not in replies["0"]["note"]
            frozen.close()
    finally:
        server.close()


@pytest.mark.parametrize("line", [b'{"t":"hello","token":"wrong","role":"node"}', b"[1,2]"])
def test_an_agent_without_the_token_is_dropped(line):
    server = ChannelServer()
    try:
        with _relay(server) as relay:
            host, port = relay.address.rsplit(":", 1)
            s = socket.create_connection((host, int(port)))
            s.sendall(line + b"\n" + b'{"t":"r","c":1,"m":{"t":"hello","rank":5}}\n')
            s.settimeout(5)
            assert s.recv(100) == b""  # closed, nothing said
            time.sleep(0.3)
            assert not relay._down
            s.close()
    finally:
        server.close()


def test_an_agent_that_stops_reading_is_cut_off_not_waited_for(monkeypatch):
    """A frozen host's agent takes no more bytes: the relay's send to it gives up after
    ``SEND_TIMEOUT_S`` and drops it (its ranks go as at its EOF), so commands for the other nodes,
    and behind them the supervisor's sends to the relay, never wait on it for long."""
    monkeypatch.setattr(relay_mod, "SEND_TIMEOUT_S", 0.3)
    server = ChannelServer()
    try:
        with _relay(server) as relay:
            host, port = relay.address.rsplit(":", 1)
            frozen = socket.create_connection((host, int(port)))
            frozen.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hello = {"t": "hello", "token": server.token, "role": "node", "node": "n9"}
            rank_hello = {"t": "hello", "role": "rank", "rank": 7, "pid": 1007, "node": "n9"}
            frozen.sendall(
                b"".join(encode(m) for m in (hello, {"t": "r", "c": 1, "m": rank_hello}))
            )
            _until(lambda: relay._down)
            (mine,) = relay._down
            (agent,) = relay._agents.values()
            big = {"t": "r", "c": mine, "m": {"cmd": "noise", "pad": "x" * (1 << 20)}}
            t0 = time.monotonic()
            for _ in range(64):  # far past any socket buffer, were the relay to wait on it
                relay._from_supervisor(big)
                if agent.broken:
                    break
            assert agent.broken and time.monotonic() - t0 < 10
            eofs: list = []
            _until(
                lambda: (
                    eofs.extend(p.rank for p, m, _ in _drain(server) if m["t"] == "_eof") or eofs
                )
            )
            assert eofs == [7] and not relay._down
            frozen.close()
    finally:
        server.close()


def test_the_supervisor_asks_each_link_once_and_notes_a_link_that_took_no_dump():
    """Nodes behind one relay share a link: ONE ``dump`` goes to it with all their ranks (the relay
    splits it), not one a node (each send waits up to the socket's timeout on a relay that does not
    read). A link whose send fails is not waited for: its ranks are noted unreachable at once."""
    from types import SimpleNamespace

    from ptops.ops.supervisor.hangs import HangMixin

    sent: list = []

    class Server:
        replies: queue.Queue = queue.Queue()

        def send(self, peer, msg):
            sent.append((peer.cid, msg))
            return peer.cid != 2  # link 2 takes nothing

    now = time.monotonic()
    relay = SimpleNamespace(cid=1, last_rx=now)
    stuck = SimpleNamespace(cid=2, last_rx=now)
    h = SimpleNamespace(
        server=Server(),
        attempt=3,
        cfg=SimpleNamespace(stack_timeout_s=5.0, hang=SimpleNamespace(ping_stale_s=5.0)),
    )
    entry = {"c": 1, "pid": 9, "ask": True}
    by_node = {
        (1, "n1"): (relay, {"0": entry, "1": entry}),
        (1, "n2"): (relay, {"2": entry}),
        (2, "n3"): (stuck, {"3": entry}),
    }
    HangMixin._ask_node_agents(h, by_node)
    assert [(cid, sorted(m["ranks"])) for cid, m in sent] == [(1, ["0", "1", "2"]), (2, ["3"])]
    assert sorted(h.node_stacks) == [3]
    assert h.node_stacks[3]["node"] == "n3" and "took no dump" in h.node_stacks[3]["note"]


@pytest.mark.parametrize(
    "raw, node_rank, want",
    [
        ({"every": 2, "port": 9, "nodes": ["a", "b", "c"]}, 0, ("a", 9, True)),
        ({"every": 2, "port": 9, "nodes": ["a", "b", "c"]}, 1, ("a", 9, False)),
        ({"every": 2, "port": 9, "nodes": ["a", "b", "c"]}, 2, ("c", 9, True)),  # a group of one
        ({"every": 2, "port": 9, "nodes": ["a", "b", "c"]}, 3, None),  # not a node of the job
        ({"every": 0, "port": 9, "nodes": ["a"]}, 0, None),
        ({"every": 2, "port": 70000, "nodes": ["a"]}, 0, None),
        ({"every": 2, "port": 9, "nodes": [1, 2]}, 1, None),
        ({"every": 2}, 0, None),
        (None, 0, None),
    ],
)
def test_each_node_finds_its_groups_relay(raw, node_rank, want):
    """``[slurm] relay_every``: the first node of every group relays it; anything malformed
    leaves the agent straight to the supervisor (the path that always works)."""
    from ptops.ops.rank.channel import relay_group

    assert relay_group(json.dumps(raw) if raw is not None else None, node_rank) == want
