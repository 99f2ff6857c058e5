"""A node agent sums up its ranks' liveness (issue 24): the ranks' ``ping`` lines stay on the node,
one ``a`` frame a second names the ranks heard from and how long ago, and the supervisor turns it
into the same ``last_seen`` a ping a rank gave. Real agent relay, real channel server, a real rank
client on the agent's loopback listener (no torchrun: the ranks are this test)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from ptops.monitors.hang import HangConfig, HangMonitor
from ptops.ops.node.agent import Agent
from ptops.ops.rank.channel import ENV_ADDRESS, ENV_TOKEN, ChannelClient
from ptops.ops.supervisor.channel import ChannelServer


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
        for vp, m in msg.get("items") or () if msg.get("t") == "_batch" else ():
            if m.get("t") == t:
                return vp, m, ts
    pytest.fail(f"no {t!r} message")


@pytest.fixture
def relay():
    server = ChannelServer()
    env = {ENV_ADDRESS: server.address(), ENV_TOKEN: server.token, "PTOPS_NODE_RANK": "0"}
    agent = Agent(env)
    thread = threading.Thread(target=agent.relay_loop, daemon=True)
    thread.start()
    local = f"127.0.0.1:{agent._listen.getsockname()[1]}"
    try:
        yield server, agent, local
    finally:
        agent.stop("test over")
        agent.up.close()
        thread.join(timeout=3)
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
    frame = agent.alive_frame()
    assert frame is not None and len(frame["c"]) == 2 and all(150 <= a < 5000 for a in frame["ms"])
    assert agent.alive_frame() is None  # nothing heard since
    agent.up.send(frame)
    node, alive, recv = _next(server, "_alive")
    assert node.role == "node"
    seen = {vp.rank: at for vp, at in alive["seen"]}
    assert set(seen) == {4, 5} and all(recv - 5 < at <= recv - 0.15 for at in seen.values())
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
