"""``[supervisor] node_summaries``: the node agent sums up its routine ranks between samples on the
wire (``Batcher(every, read)``), so the supervisor's work a step grows with nodes. The file is the
one the supervisor-side sampling writes, byte for byte, while the ranks differ only in keys the
shared monitors do not read; every rank's progress still reaches the hang monitor, the shared
monitors move the summed-up ranks on with their leader (no rank forks a state of its own), and the
findings are those of the supervisor that read every record."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import REPO, supervisor_without_ranks

from ptops.ops.rank.channel import Batcher, encode, summary_settings
from ptops.ops.runrecord.metrics import node_summaries_of_line
from ptops.ops.runrecord.rundir import read_jsonl

TITAN = REPO / "tests" / "data" / "obs-titan"
PER_NODE, NODES, STEPS, EVERY = 8, 4, 23, 4  # the last step between samples
WORLD = PER_NODE * NODES
SPIKE = 22  # between samples


def _records(seed: int = 0, loss_of_its_own: int | None = None) -> list[dict]:
    """Real titan records; what differs between ranks is what differs in a real run (the step
    time, the clock, memory), a rank now and then with a key of its own or a NaN loss, a loss
    spike on every rank at step ``SPIKE`` (between samples) and, with ``loss_of_its_own``, one rank
    whose loss is its own (a key the shared monitors read)."""
    rnd = random.Random(seed)
    base = [r for r in read_jsonl(TITAN / "metrics.jsonl") if r["rank"] == 0][0]
    out = []
    for step in range(1, STEPS + 1):
        for rank in range(WORLD):
            rec = {
                **base,
                "step": step,
                "rank": rank,
                "loss": 60.0 if step == SPIKE else 6.0 / step,
                "ts": 1796007405.0 + step + rnd.random() * 0.01,
                "step_s": round(0.8 + rnd.random() * 0.05, 4),
                "memory_max_active_gib": round(1.0 + rnd.random(), 3),
            }
            if rnd.random() < 0.05:
                rec["mem_rss_mb"] = 900.0 + rnd.random()
            if rnd.random() < 0.02:
                rec["loss"] = math.nan
            if rank == loss_of_its_own:
                rec["loss"] += 0.5
            out.append(rec)
    return out


def _frames(records: list[dict], every: int = 1, read=None) -> list[tuple[int, bytes]]:
    """(node, its agent's ``b`` frame) a node a step, made by the agent's own ``Batcher``."""
    by: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        by.setdefault((r["step"], r["rank"] // PER_NODE), []).append(r)
    out = []
    for (_, node), recs in by.items():
        b = Batcher(every, read)
        for r in recs:
            b.add(r["rank"] % PER_NODE + 1, encode({"t": "metrics", "rec": r}).rstrip(b"\n"), 0.0)
        out.append((node, b.frame()))
    return out


def _nodes(sup, n: int) -> list:
    """``n`` node agents' peers, each with its ranks' virtual peers said hello to ``sup`` (rank r
    is connection ``r % PER_NODE + 1`` of node ``r // PER_NODE``)."""
    from ptops.ops.supervisor.channel import Peer

    nodes = [
        Peer(cid=100 + i, sock=None, hello={"role": "node", "node": f"n{i}", "attempt": 1})
        for i in range(n)
    ]
    for r in range(n * PER_NODE):
        node = nodes[r // PER_NODE]
        vp = Peer(
            cid=r,
            sock=None,
            hello={"role": "rank", "rank": r, "attempt": 1, "pid": 1},
            authed=True,
            via=node,
            sub=r % PER_NODE + 1,
        )
        node.subs[vp.sub] = vp
        sup.handle(vp, {"t": "_hello"}, 1.0)
    return nodes


@pytest.fixture()
def supervised(tmp_path):
    """A run's frames through the supervisor's own path: the channel server's ``_batch`` (the
    summaries put where they stood), then ``handle``, as its main thread does."""
    from ptops.ops.supervisor.channel import ChannelServer

    servers = []

    def run(name: str, records: list[dict], *sets: str, wire: bool = False, read=None):
        sup, rd = supervisor_without_ranks(
            tmp_path / name,
            [f"launch.nproc={WORLD}", "supervisor.metrics_lines=node", *sets],
            WORLD,
        )
        server = ChannelServer()
        servers.append(server)
        nodes = _nodes(sup, NODES)
        if read is None:
            read = sup.feed.read_keys() if wire else None
        frames = _frames(records, EVERY if wire else 1, read)
        for i, (n, frame) in enumerate(frames):
            server._batch(nodes[n], json.loads(frame), 2.0 + i)
            peer, msg, ts = server.inbox.get_nowait()
            sup.handle(peer, msg, ts)
        sup.metrics_out.close()
        return sup, rd, frames

    yield run
    for s in servers:
        s.close()


def _findings(run) -> list[dict]:
    return [
        {k: v for k, v in e.items() if k != "ts"}
        for e in run.read_events()
        if e.get("kind") in ("anomaly", "straggler")
    ]


def test_the_agents_summaries_write_the_file_the_supervisor_would_and_keep_every_finding(
    supervised,
):
    """The same records, sampled every 4 steps, once by the supervisor (it received every rank)
    and once by the agents (``node_summaries``): the same ``metrics.jsonl`` byte for byte, the
    same findings (the loss spike between samples, on every rank; the NaN losses), every rank's
    progress at the last step, and no summed-up rank left behind or forked by a shared
    monitor; with a fraction of the messages."""
    sent = _records()
    sampled = f"supervisor.metrics_rank_detail_every={EVERY}"
    sup_a, run_a, frames_a = supervised("a", sent, sampled)
    sup_b, run_b, frames_b = supervised(
        "b", sent, sampled, "supervisor.node_summaries=true", wire=True
    )
    summaries = [
        s for raw in run_b.metrics.read_bytes().splitlines() for s in node_summaries_of_line(raw)
    ]
    assert len(summaries) >= NODES * (STEPS - STEPS // EVERY) - 4
    assert run_b.metrics.read_bytes() == run_a.metrics.read_bytes()
    got = _findings(run_b)
    assert any(e["kind"] == "anomaly" and e.get("step") == SPIKE for e in got)
    assert got == _findings(run_a)
    for r in range(WORLD):
        assert sup_b.rank_step(sup_b.ranks[r]) == STEPS and sup_b.monitor.ranks[r].step == STEPS
    assert sup_b.feed.unmoved == {}
    for m_a, m_b in zip(sup_a.feed.monitors, sup_b.feed.monitors):
        members = getattr(m_b, "_members", None)
        if members:  # the shared monitors' ranks: as many states as when every record came
            groups = {id(g) for g, _ in members.values()}
            assert len(groups) == len({id(g) for g, _ in m_a._members.values()})
            assert len(members) == WORLD
    # the supervisor's messages: a routine rank's record between samples is not one of them
    # diagnose says the straggler and memory monitors saw routine ranks on sample steps only
    from ptops.diagnostics.diagnose import diagnose
    from ptops.recipes.schema import dump_json, load

    sets = ["supervisor.metrics_lines=node", sampled, "supervisor.node_summaries=true"]
    (run_b.path / "recipe.json").write_text(dump_json(load("titan-tiny", sets)[0]))
    said = [n for n in diagnose(run_b.path)["notes"] if "every 4 steps" in n]
    assert len(said) == 1 and "node_summaries" in said[0]
    msgs_a, msgs_b = ([m for _, f in fs for m in json.loads(f)["m"]] for fs in (frames_a, frames_b))
    assert len(msgs_a) == WORLD * STEPS and len(msgs_b) < 0.5 * len(msgs_a)
    assert sum(map(len, (f for _, f in frames_b))) < sum(map(len, (f for _, f in frames_a)))


def test_a_rank_that_differs_in_a_key_a_monitor_reads_is_sent_whole(supervised):
    """Rank 13's loss is its own (the loss monitors read it): its agent sends it whole every
    step, where the supervisor-side sampling would have summed it up; the monitors read it."""
    sent = _records(loss_of_its_own=13)
    sets = (f"supervisor.metrics_rank_detail_every={EVERY}", "supervisor.node_summaries=true")
    sup, run, frames = supervised("b", sent, *sets, wire=True)
    back = run.read_metrics()
    assert {r["step"] for r in back if r["rank"] == 13} == set(range(1, STEPS + 1))
    assert {r["step"] for r in back if r["rank"] == 12} < set(range(1, STEPS + 1))
    assert sup.feed.unmoved == {}


def test_ranks_summed_up_in_a_key_a_monitor_reads_are_left_where_they_were_and_said(supervised):
    """An agent told nothing about what is read (``read`` empty: an agent of another version)
    sums up rank 13 whose loss is its own: the loss monitors cannot move it on from its leader's
    record, so they leave it (it rejoins at its next whole record), count it and say so once a
    monitor; the run's progress is unaffected."""
    sent = _records(loss_of_its_own=13)
    sets = (f"supervisor.metrics_rank_detail_every={EVERY}", "supervisor.node_summaries=true")
    sup, run, _ = supervised("b", sent, *sets, wire=True, read=frozenset())
    assert {"loss_spike", "nan"} <= set(sup.feed.unmoved)
    said = [ln for ln in sup.out.getvalue().splitlines() if "summed-up ranks differ in" in ln]
    assert len(said) == len(sup.feed.unmoved) and "loss" in said[0]
    assert sup.rank_step(sup.ranks[13]) == STEPS and sup.monitor.ranks[13].step == STEPS


def test_a_summary_is_the_agents_alone_and_a_bad_one_loses_nothing_else(supervised, tmp_path):
    """A rank's own line that looks like a summary is an unknown message (a rank cannot speak
    for other ranks); a malformed summary in a frame is dropped, the frame's records are not."""
    from ptops.ops.supervisor.channel import ChannelServer

    sup, run = supervisor_without_ranks(
        tmp_path / "h",
        [f"launch.nproc={WORLD}", "supervisor.metrics_lines=node",
         f"supervisor.metrics_rank_detail_every={EVERY}", "supervisor.node_summaries=true"],
        WORLD,
    )  # fmt: skip
    (node,) = _nodes(sup, 1)
    recs = [r for r in _records() if r["rank"] < PER_NODE and r["step"] == 2]
    forged = {"t": "_summary", "entry": {"step": 2, "ranks": [5], "keys": {}}, "ranks": [5],
              "lead_out": True, "names": []}  # fmt: skip
    ((_, frame),) = _frames(recs, EVERY, sup.feed.read_keys())
    good = json.loads(frame)
    assert len(good["s"]) == 1
    summed = [c - 1 for c in good["s"][0][2]]
    bad = dict(good, s=[good["s"][0][:5], ["x"], [1, 0, [2], {"step": 3, "ranks": [], "keys": {}},
                                                  False, []]])  # fmt: skip
    bad["c"] = good["c"] + [3]
    bad["m"] = good["m"] + [forged]
    server = ChannelServer()
    try:
        server._batch(node, bad, 2.0)
        peer, msg, ts = server.inbox.get_nowait()
    finally:
        server.close()
    assert len(msg["items"]) == len(good["m"]) + 1  # the records and the rank's line, no summary
    sup.handle(peer, msg, ts)
    sup.metrics_out.close()
    assert sup.unknown_messages == {"rank:_summary": 1}
    raw = run.metrics.read_bytes()
    assert b'"summary"' not in raw and len(run.read_metrics()) == len(good["m"])
    assert summed and all(sup.rank_step(sup.ranks[r]) == 0 for r in summed)  # nobody said so


def test_an_agent_without_its_settings_sends_every_rank_whole():
    assert summary_settings(None) == (1, None)
    assert summary_settings("{bad") == (1, None)
    assert summary_settings('{"every": 4, "read": null}') == (1, None)  # every key read
    assert summary_settings('{"every": 4, "read": ["loss"]}') == (4, frozenset({"loss"}))
    sent = [r for r in _records() if r["rank"] < PER_NODE and r["step"] == 2]
    for every, read in ((4, None), (1, frozenset())):
        ((_, frame),) = _frames(sent, every, read)
        assert "s" not in json.loads(frame)


def test_the_supervisor_tells_its_agents_what_they_may_sum_up(tmp_path):
    """Each attempt's environment carries K and the keys the shared monitors read (what the
    agent's ``Batcher`` is built with); none without ``node_summaries``."""
    from ptops.ops.rank.channel import SUMMARY_ENV

    on = [f"supervisor.metrics_rank_detail_every={EVERY}", "supervisor.node_summaries=true"]
    sup, _ = supervisor_without_ranks(
        tmp_path / "on", ["supervisor.metrics_lines=node", *on], PER_NODE
    )
    every, read = summary_settings(sup.summary_env()[SUMMARY_ENV])
    assert every == EVERY and {"loss", "grad_norm", "reward", "kl"} <= read
    assert not read & {"step_s", "ts", "memory_max_active_gib", "tokens_per_s"}
    off, _ = supervisor_without_ranks(tmp_path / "off", ["supervisor.metrics_lines=node"], 8)
    assert off.summary_env() == {}


def test_a_real_run_with_node_summaries_loses_no_rank_step(tmp_path):
    """titan-tiny, 2 ranks through the real node agent, K = 4: the run completes with no finding,
    and each step of rank 1 is in the file, whole or in a summary (which of the two depends on
    whether both ranks' records left the agent in one batch: not asserted, it is timing); on the
    sample steps and for rank 0 always whole."""
    from conftest import run_ptops

    from ptops.ops.runrecord.rundir import RunDir

    run_dir = tmp_path / "run"
    run_ptops(
        "launch", "titan-tiny", "--supervise", "--run-dir", str(run_dir),
        "--set", "train.steps=12", "--set", "supervisor.metrics_lines=node",
        "--set", f"supervisor.metrics_rank_detail_every={EVERY}",
        "--set", "supervisor.node_summaries=true",
        check=True,
    )  # fmt: skip
    run = RunDir(run_dir)
    recs = run.read_metrics()
    summed = {
        s["step"]
        for raw in run.metrics.read_bytes().splitlines()
        for s in node_summaries_of_line(raw)
        if 1 in s["ranks"]
    }
    whole = {r["step"] for r in recs if r["rank"] == 1}
    assert whole | summed == set(range(1, 13)) and not whole & summed
    assert {4, 8, 12} <= whole
    assert {r["step"] for r in recs if r["rank"] == 0} == set(range(1, 13))
    assert not [e for e in run.read_events() if e.get("kind") in ("hang", "anomaly", "straggler")]


def test_node_summaries_is_a_checked_recipe_key():
    from ptops.recipes.schema import RecipeError, load

    assert load("titan-tiny", [])[0].supervisor.node_summaries is False
    with pytest.raises(RecipeError) as e:
        load("titan-tiny", ["supervisor.metrics_lines=node", "supervisor.node_summaries=true"])
    assert "supervisor.node_summaries" in str(e.value) and "metrics_rank_detail_every" in str(
        e.value
    )


@pytest.mark.parametrize(
    "values, kept",
    [
        ([1.5, 2.5, 0.5], [0.5, 3, 1.5, 2.5, 2]),
        ([1e308, 1e308, 1.0], [1.0, 3, 1e308, 1e308, 2]),  # a sum that overflows: still finite
        ([10**400, 1, 2], [1, 2, 2, 10**400, 1]),  # an int too large for a float: a number
        ([1.0, math.nan, 2.0], None),  # NaN or inf: no spread for the key
        ([1.0, -math.inf, 2.0], None),
        ([1.0, True, 2.0], None),  # a bool is not a number here
        ([1.0, "x", 2.0], None),
    ],
)
def test_a_keys_spread_is_over_finite_numbers_only(values, kept):
    """``spread`` (the summary entry's ``keys``): [min, its rank, low median, max, its rank] over
    the ranks left out, only when every value is an int or a finite float (the checks run on a
    whole key at once, with a per-value look when the sum is not finite)."""
    from ptops.ops.runrecord.nodesummary import spread

    lead = {"step": 3, "rank": 1, "v": values[0]}
    diffs = {2: {"rank": 2, "v": values[1]}, 3: {"rank": 3, "v": values[2]}}
    got = spread(lead, [1, 2, 3], diffs)["keys"]
    assert got.get("v") == kept
