"""The scale load generator against the real supervisor, at a small size (issue 11, point 5).

``bench/scale_load.py`` runs the real :class:`Supervisor` (channel server, node relay, handlers,
hang and metric monitors, run directory) with the attempt's process replaced by simulated node
agents. Here: 64 ranks on 8 simulated nodes, 4 steps each, then every rank waits (pinging, as in a
collective) except one that goes silent. No timing in the assertions: the run ends by itself when
the supervisor declares the hang; the subprocess timeout only guards against a bug.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from ptops.diagnostics.stacks import read_attempt

RANKS, PER_NODE, STEPS, VICTIM = 64, 8, 4, 37


@pytest.mark.parametrize("tier", [0, 4], ids=["agents", "relays"])
def test_simulated_nodes_reach_the_real_supervisor(tmp_path: Path, tier: int) -> None:
    """``tier`` 4: two real relays (``ops/node/relay.py``) between the 8 agents and the supervisor,
    both named after this host: each rank's stacks must still be asked for under its own relay's
    numbers and land in its own node's file."""
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "scale_load.py"),
            "--ranks",
            str(RANKS),
            "--per-node",
            str(PER_NODE),
            "--step-s",
            "0.5",
            "--steps",
            str(STEPS),
            "--victim",
            str(VICTIM),
            "--victim-step",
            str(STEPS),
            "--peers",
            "block",
            "--work",
            str(tmp_path),
            "--json",
            str(out),
            "--timeout",
            "240",
            "--relay-tier",
            str(tier),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    run = tmp_path / "run"

    # one connection per simulated node (or relay), every rank seen through it
    links = RANKS // PER_NODE // (tier or 1)
    assert res["node_agents"] == links and res["connections"] == links

    # every simulated rank's every step reached metrics.jsonl, once
    steps: dict[int, list[int]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["rank"], []).append(rec["step"])
    assert sorted(steps) == list(range(RANKS))
    assert all(sorted(s) == list(range(1, STEPS + 1)) for s in steps.values()), steps

    # the silent rank is the hang's culprit; its stacks came from its node agent, the others' over
    # the channel
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    hang = next(e for e in events if e["kind"] == "hang")
    assert hang["ranks"] == [VICTIM] and hang["why"] == "unresponsive"
    assert hang["stack_sources"][str(VICTIM)].startswith("node agent sim")
    assert sum(1 for r, how in hang["stack_sources"].items() if how == "channel") == RANKS - 1
    # one file a node (the agents gathered their ranks' stacks), read back a rank at a time
    stack_dir = run / "stacks" / "attempt-1"
    assert len(list(stack_dir.glob("node-*.txt"))) == RANKS // PER_NODE
    assert not list(stack_dir.glob("rank-*.txt"))
    stacks = read_attempt(stack_dir)
    assert sorted(stacks) == list(range(RANKS))
    assert stacks[VICTIM].source.startswith(f"node agent sim{VICTIM // PER_NODE:05d}: py-spy")
    assert stacks[0].source.startswith("channel") and stacks[0].frames
    assert res["hang"]["found_ranks"] == [VICTIM]
    assert events[-1]["kind"] == "failed"  # a plain (temporary) launch ends on the hang


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_load", REPO / "bench" / "scale_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _lines(bench, ranks: list[int], step: int, nan_at: int = -1) -> list[tuple]:
    """A node's lines of a step as the generator makes them under ``--template`` (records that
    vary with the place ``c`` on the node); the record at ``nan_at`` has a NaN loss."""
    out = []
    for c, rank in enumerate(ranks, 1):
        msg = bench._metrics_msg(rank, 1, step, 1.0, 1764860000.25, c)
        if c == nan_at:
            msg["rec"]["loss"] = float("nan")
        out.append((c, bench._line(msg), msg))
        out.append((c, b'{"t":"beat","step":%d,"phase":"step","stage":"begin"}' % (step + 1)))
    return out


def test_a_template_frame_with_a_nodes_ranks_put_in_is_what_its_agent_sends(monkeypatch) -> None:
    """``--template`` (131,072 simulated ranks from a fraction of a core) makes one frame a tick
    and puts each node's ranks in: it must be, byte for byte, the frame the agent's own ``Batcher``
    makes of those ranks' records, with node summaries (a sample step and one between) and
    without, and with a rank whose record is not routine (a NaN loss: sent whole)."""
    from ptops.ops.rank.channel import SUMMARY_ENV

    bench = _bench()
    stand_ins, ranks = bench._stand_ins(8), list(range(8 * 2041, 8 * 2042))
    checked = 0
    for env in (None, json.dumps({"every": 8, "read": ["loss", "grad_norm"]})):
        if env is None:
            monkeypatch.delenv(SUMMARY_ENV, raising=False)
        else:
            monkeypatch.setenv(SUMMARY_ENV, env)
        for step, nan_at in ((16, -1), (17, -1), (17, 3)):
            (template,) = bench._frames("batch", _lines(bench, stand_ins, step, nan_at))
            (own,) = bench._frames("batch", _lines(bench, ranks, step, nan_at))
            assert bench._placed(template, ranks) == own, (env, step, nan_at)
            assert str(bench._STAND_IN)[:5].encode() not in own
            checked += b'"s":' in own
    assert checked == 2  # summed up between samples (NaN or not), never on the sample step


def test_a_templated_relays_bytes_with_its_ranks_put_in_are_what_a_real_relay_sends(
    monkeypatch,
) -> None:
    """``--template --relay-tier N``: a group of N nodes without a real relay process is ONE link
    sending what its relay would: the relay's hello, its ranks' hellos under its numbers, then a
    tick's frame made once for all such groups of stand-in ranks by the relay's own batching and
    each group's ranks put in. Compared byte for byte with a REAL ``Relay`` (its upstream a bare
    socket, no supervisor) fed the same agents' hellos and frames: with node summaries on, a
    sample step and one between (summed up over the group), a NaN in one node's record."""
    import socket

    from ptops.ops.node import relay as relay_mod
    from ptops.ops.rank.channel import (
        ENV_ADDRESS,
        ENV_TOKEN,
        SUMMARY_ENV,
        Batcher,
        summary_settings,
    )

    bench = _bench()
    per, n, g, pid, world = 8, 64, 3, os.getpid(), 4096
    group = [(i, list(range(i * per, (i + 1) * per))) for i in range(g * n, (g + 1) * n)]
    summary = json.dumps({"every": 60, "read": ["loss", "grad_norm"]})
    monkeypatch.delenv(SUMMARY_ENV, raising=False)  # the agents behind a relay do not sum up
    monkeypatch.setenv("PTOPS_ATTEMPT", "2")
    upstream = socket.create_server(("127.0.0.1", 0))
    env = {ENV_ADDRESS: "127.0.0.1:%d" % upstream.getsockname()[1], ENV_TOKEN: "tok"}
    relay = relay_mod.Relay({**env, SUMMARY_ENV: summary, "PTOPS_ATTEMPT": "2"}, f"relay{g:05d}")
    conn, _ = upstream.accept()
    got = bytearray()  # read as it comes: 512 hellos need not fit the socket's buffers

    def drain() -> None:
        with contextlib.suppress(OSError):
            while chunk := conn.recv(1 << 16):
                got.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    agents = []
    try:
        for i, ranks in group:  # each agent's hello and its ranks', node by node
            agents.append(relay_mod._Agent(socket.socket(), 0.0))
            hello = {"t": "hello", "token": "tok", "role": "node", "node": f"sim{i:05d}"}
            assert relay._line(agents[-1], json.dumps(hello).encode(), 0.0)
            for c, rank in enumerate(ranks, 1):
                m = bench._rank_hello(rank, i, pid, 2, world)
                assert relay._line(agents[-1], bench._frame(c, m)[:-1], 0.0)
        want = b"".join(bench._relay_hellos(g, "tok", pid, 2, group, world))
        deadline = time.monotonic() + 30  # (the relay sent them before ``_line`` returned)
        while len(got) < len(want) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bytes(got) == want

        stand_ins = bench._stand_ins(n * per)
        ranks = [r for _, rs in group for r in rs]
        checked = 0
        for step, nan_at in ((59, -1), (60, -1), (59, 3)):
            nan = [nan_at if j == 1 else -1 for j in range(n)]  # in node 1's only
            frames = [
                bench._frames("batch", _lines(bench, stand_ins[j * per : (j + 1) * per], step, x))
                for j, x in enumerate(nan)
            ]
            template, _ = bench._relay_frame(frames, per, Batcher(*summary_settings(summary)))
            for agent, (_, rs), x in zip(agents, group, nan):
                for f in bench._frames("batch", _lines(bench, rs, step, x)):
                    relay._line(agent, f[:-1], 0.0)
            own = relay.batch.frame()
            assert bench._Template(template, n * per).put(ranks) == own, (step, nan_at)
            assert str(bench._STAND_IN)[:5].encode() not in own
            checked += b'"s":' in own
        assert checked == 2  # summed up over the group between samples, never on the sample
    finally:
        relay.up.close()
        relay._listen.close()
        for a in agents:
            a.sock.close()
        conn.close()
        upstream.close()

    # a stand-in is put in only where it is a whole number of its own
    s0, s1 = bench._stand_ins(2)
    odd = b"[%d,%d1,1e%d,%d.5,%d]" % (s1, s1, s1, s1, s0)
    assert bench._Template(odd, 2).put([7, 8]) == b"[8,%d1,1e%d,%d.5,7]" % (s1, s1, s1)


def test_starve_pins_the_supervisor_beside_a_busy_loop_and_frees_the_other_cpus() -> None:
    """``--starve`` (issue 24 point 6: no false hang with the supervisor on half a core): the
    process and a busy loop share one CPU, the generators get the rest; in a child process, so
    this one keeps its CPUs."""
    code = f"""
import os, sys
sys.path.insert(0, {str(REPO / "bench")!r})
import scale_load
before = sorted(os.sched_getaffinity(0))
busy, rest = scale_load._starve()
try:
    assert busy.poll() is None, "the busy loop is running"
    assert os.sched_getaffinity(0) == {{before[0]}}, os.sched_getaffinity(0)
    assert os.sched_getaffinity(busy.pid) == {{before[0]}}
    assert rest == ",".join(str(c) for c in before[1:]), rest
finally:
    busy.kill()
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if len(os.sched_getaffinity(0)) < 2:
        assert p.returncode != 0 and "needs two CPUs" in p.stderr
    else:
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_rendezvous_memo_follows_every_change() -> None:
    """The hang monitor remembers when every live rank reached the rendezvous (it was O(ranks) per
    question, O(ranks^2) per start-up); the memo must change whenever a rank enters, exits or
    appears."""
    from ptops.monitors.hang import HangConfig, HangMonitor

    def truth(m: HangMonitor) -> float | None:
        return m._all_in_rendezvous_now()

    m = HangMonitor(50, 0.0, HangConfig())
    seen = []
    for r in range(50):
        m.observe(
            {
                "kind": "beat",
                "rank": r,
                "step": 0,
                "phase": "startup",
                "section": "import",
                "ts": 1.0,
            }
        )
    for r in range(50):
        m.observe(
            {
                "kind": "beat",
                "rank": r,
                "step": 0,
                "phase": "startup",
                "section": "rendezvous",
                "ts": 2.0 + r,
            }
        )
        seen.append(m._all_in_rendezvous())
        assert seen[-1] == truth(m)
    assert seen[:49] == [None] * 49 and seen[49] == 51.0
    m.observe(
        {"kind": "beat", "rank": 50, "step": 0, "phase": "startup", "section": "import", "ts": 60.0}
    )  # a rank appears
    assert m._all_in_rendezvous() is None and truth(m) is None
    m.observe({"kind": "exit", "rank": 50, "ts": 61.0})  # ... and leaves
    assert m._all_in_rendezvous() == truth(m) == 51.0
    m.observe(
        {"kind": "exit", "rank": 49, "ts": 62.0}
    )  # the last to arrive leaves: the latest is now rank 48's
    assert m._all_in_rendezvous() == truth(m) == 50.0
    # the per-check budget memo gives the same finding as computing every budget per rank
    for r in range(49):
        m.observe(
            {"kind": "beat", "rank": r, "step": 1, "phase": "step", "stage": "begin", "ts": 70.0}
        )
        m.observe({"kind": "metrics", "rank": r, "step": 1, "step_s": 1.0, "ts": 71.0})
    m.observe({"kind": "beat", "rank": 3, "step": 2, "phase": "step", "stage": "begin", "ts": 72.0})
    for now in (72.0, 200.0, 400.0, 800.0):
        assert m.check(now) == m._check(now)
    assert m.check(800.0) is not None


def test_rendezvous_waits_without_a_walk_while_nodes_come_in_one_by_one() -> None:
    """Nodes reach the rendezvous one by one (a node's batch: its ranks enter and leave it), each a
    change; the question "when was everyone in?" must not walk the ranks while a live rank is still
    waited for (it did: 2,048 walks of up to 16,384 ranks, 3.4 s of CPU). And on random
    streams (ranks appearing, also as a str, entering twice, exiting) the answer is the walk's."""
    import random

    from ptops.monitors.hang import HangConfig, HangMonitor

    per_node, nodes = 8, 256
    m = HangMonitor(per_node * nodes, 0.0, HangConfig())
    walks = []
    walk = m._all_in_rendezvous_now
    m._all_in_rendezvous_now = lambda: walks.append(1) or walk()  # type: ignore[method-assign]
    for n in range(nodes):
        for section, ts in (("rendezvous", 10.0 + n), ("build", 11.0 + n)):
            for r in range(n * per_node, (n + 1) * per_node):
                m.observe(
                    {"kind": "beat", "rank": r, "step": 0, "phase": "startup",
                     "section": section, "ts": ts}
                )  # fmt: skip
        m.check(12.0 + n)
    assert m._all_in_rendezvous() == walk() == 10.0 + nodes - 1
    assert len(walks) <= 2, len(walks)  # once everyone is in (and its memo), not once a node

    reopened = 0  # everyone was in, and then a rank was waited for again
    for seed in range(60):
        rnd = random.Random(seed)
        world = rnd.choice([1, 3, 6])
        m = HangMonitor(world, 0.0, HangConfig())
        for i in range(80):
            r = rnd.randrange(world + 3)
            kind = rnd.choice(["enter", "enter", "enter", "import", "exit", "appear"])
            rank = str(r) if kind == "appear" and rnd.random() < 0.5 else r
            before = m._all_in_rendezvous_now()
            if kind == "exit":
                m.observe({"kind": "exit", "rank": rank, "ts": float(i)})
            else:
                section = "rendezvous" if kind == "enter" else "import"
                m.observe(
                    {"kind": "beat", "rank": rank, "step": 0, "phase": "startup",
                     "section": section, "ts": float(i)}
                )  # fmt: skip
            assert m._all_in_rendezvous() == m._all_in_rendezvous_now(), (seed, i)
            reopened += before is not None and m._all_in_rendezvous_now() is None
    assert reopened >= 10, reopened


def test_straggler_bookkeeping_matches_a_full_recount() -> None:
    """The straggler monitor keeps the newest step and the expected ranks as records come (they were
    recomputed over every rank for every record); after any stream, restarts and resets included,
    they equal a full recount."""
    import random

    from ptops.monitors.config import StragglerConfig
    from ptops.monitors.straggler import StragglerMonitor

    for seed in range(50):
        rnd = random.Random(seed)
        m = StragglerMonitor(StragglerConfig(window=3, lag_steps=2))
        n, step = rnd.choice([2, 5, 9]), 1
        for _ in range(300):
            if rnd.random() < 0.03:
                step = max(1, step - rnd.randrange(4))  # a restart redoes steps
            elif rnd.random() < 0.3:
                step += 1
            rec = {
                "step": step,
                "rank": rnd.randrange(n + 1),
                "step_s": rnd.choice([1.0, 1.2, 0.3]),
                "attempt": 1,
            }
            if rnd.random() < 0.1:
                rec["world_size"] = n
            m.feed(rec)
            if rnd.random() < 0.005:
                m.reset()
            if m._last:
                assert m._newest == max(m._last.values())
            want = (set(range(m._world)) | m._known) if m._world is not None else m._known
            assert m._expected() == want
