"""``[supervisor] metrics_lines = "node"``: a node agent's batch of step records as ONE line of
``metrics.jsonl`` (each rank's keys that differ from its step's first record), read back by every
reader as the records a line each would hold: the same records, in the same order, re-encoded
byte for byte; a hostile node line loses its bad entries, never its neighbours."""

from __future__ import annotations

import io
import json
import math
import random

import pytest
from conftest import REPO, supervisor_without_ranks

from ptops.ops.rank.channel import Batcher, encode, unbatch
from ptops.ops.runrecord.metrics import (
    MetricsTail,
    MetricsWriter,
    iter_metrics,
    live_rank0,
    rank0_records,
    records_of_line,
    segments,
    tail_records,
)
from ptops.ops.runrecord.rundir import read_jsonl

TITAN = REPO / "tests" / "data" / "obs-titan"
PER_NODE = 8


def _step_records(steps: int, nodes: int, seed: int = 0) -> list[dict]:
    """Real titan records, 8 ranks a node; what differs between ranks is what differs in a real
    run (the step time, the clock, memory), and now and then a rank with a key of its own or a
    non-finite loss (such a record does not join its step's group: it is written whole)."""
    rnd = random.Random(seed)
    base = [r for r in read_jsonl(TITAN / "metrics.jsonl") if r["rank"] == 0][0]
    out = []
    for step in range(1, steps + 1):
        for rank in range(nodes * PER_NODE):
            rec = {
                **base,
                "step": step,
                "rank": rank,
                "loss": 6.0 / step,
                "ts": 1796007405.0 + step + rnd.random() * 0.01,
                "step_s": round(0.8 + rnd.random() * 0.05, 4),
            }
            if rnd.random() < 0.05:
                rec["mem_rss_mb"] = 900.0 + rnd.random()
            if rnd.random() < 0.02:
                rec["loss"] = math.nan
            out.append(rec)
    return out


def _batches(records: list[dict]) -> list[tuple[str, list]]:
    """The records as the supervisor gets them from each node's agent: a ``b`` frame a node a
    step, opened by ``unbatch`` with its certificates (``like``)."""
    out = []
    by_step: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        by_step.setdefault((r["step"], r["rank"] // PER_NODE), []).append(r)
    for (_, node), recs in by_step.items():
        b = Batcher()
        for r in recs:
            b.add(r["rank"], encode({"t": "metrics", "rec": r}).rstrip(b"\n"), 0.0)
        likes: list = []
        pairs = unbatch(json.loads(b.frame()), likes)
        out.append((f"node{node}", [(m["rec"], like) for (_, m), like in zip(pairs, likes)]))
    return out


def _enc(records) -> bytes:
    """Records as the rank file's lines (NaN != NaN: compared as bytes)."""
    return b"".join(
        (json.dumps(r, separators=(",", ":"), allow_nan=True) + "\n").encode() for r in records
    )


def _write(path, batches, node_lines: bool, rotate_bytes: int = 0) -> MetricsWriter:
    w = MetricsWriter(path, rotate_bytes=rotate_bytes)
    for name, items in batches:
        with w.held(), w.node(name) if node_lines else io.StringIO():
            for rec, like in items:
                w.append(rec, like)
    w.close()
    return w


@pytest.fixture(scope="module")
def sent():
    return _step_records(steps=12, nodes=4)


def test_a_node_line_reads_back_as_the_line_a_rank_file(tmp_path, sent):
    ranks, nodes = tmp_path / "ranks", tmp_path / "nodes"
    ranks.mkdir(), nodes.mkdir()
    batches = _batches(sent)
    _write(ranks, batches, node_lines=False)
    _write(nodes, batches, node_lines=True)
    lines = (nodes / "metrics.jsonl").read_bytes().splitlines()
    assert len(lines) == len(batches)  # one line a node batch
    back = list(iter_metrics(nodes))
    assert len(back) == len(sent)
    # every reader's records, re-encoded, are the rank file's lines byte for byte (NaN included)
    assert _enc(back) == (ranks / "metrics.jsonl").read_bytes() == _enc(sent)
    # the followers went as their differing keys: the file is a fraction of the rank file
    size, rank_size = (
        (nodes / "metrics.jsonl").stat().st_size,
        (ranks / "metrics.jsonl").stat().st_size,
    )
    assert size < 0.35 * rank_size, (size, rank_size)
    diffs = [e for line in lines for e in json.loads(line)[2] if isinstance(e, list)]
    assert len(diffs) > 0.8 * len(sent) * (PER_NODE - 1) / PER_NODE
    # the other readers: the rank-0 prefilter, the live follower, the tail window
    assert _enc(rank0_records(nodes)) == _enc(rank0_records(ranks))
    (recs, n), (recs2, n2) = live_rank0(nodes), live_rank0(ranks)
    assert _enc(recs) == _enc(recs2) and n == n2 == len(sent)
    assert _enc(MetricsTail(nodes).read()) == _enc(back)
    assert _enc(tail_records(nodes, 10**9)) == _enc(back)


def test_rotated_node_lines_keep_the_index_account(tmp_path, sent):
    ranks, nodes = tmp_path / "ranks", tmp_path / "nodes"
    ranks.mkdir(), nodes.mkdir()
    batches = _batches(sent)
    _write(ranks, batches, node_lines=False, rotate_bytes=20_000)
    w = _write(nodes, batches, node_lines=True, rotate_bytes=6_000)
    assert w.rotations >= 3
    assert _enc(iter_metrics(nodes)) == _enc(iter_metrics(ranks)) == _enc(sent)
    # the index counts records (a node line holds many), and carries rank 0's
    assert sum(s.info["lines"] for s in segments(nodes)) + live_rank0(nodes)[1] == len(sent)
    assert _enc(rank0_records(nodes)) == _enc(rank0_records(ranks))
    cut = list(tail_records(nodes, 9_000))  # a window: from a step boundary, whole steps
    assert cut and _enc(cut) == _enc(sent[-len(cut) :]) and cut[0]["rank"] == 0


def test_a_record_the_certificate_does_not_rebuild_is_written_whole(tmp_path):
    """``like`` names the leader's rank; the diff is taken against that rank's whole record of
    the same step (two steps in one batch: two leaders of one rank) and checked: a claim that
    does not give the record back is written whole."""
    a0 = {"step": 1, "rank": 0, "loss": 1.0}
    b0 = {"step": 2, "rank": 0, "loss": 0.5}
    a1 = {"step": 1, "rank": 1, "loss": 1.0}  # certified like rank 0 but for "rank"
    b1 = {"step": 2, "rank": 1, "loss": 0.7}  # a wrong claim: "loss" differs too
    c1 = {"step": 3, "rank": 1, "loss": 0.1}  # no leader of step 3 in the line
    w = MetricsWriter(tmp_path)
    rank_only = (0, frozenset({"rank"}))
    with w.node("n"):
        for rec, like in (
            (a0, None),
            (b0, None),
            (a1, rank_only),
            (b1, rank_only),
            (c1, rank_only),
        ):
            w.append(rec, like)
    w.close()
    (line,) = (tmp_path / "metrics.jsonl").read_bytes().splitlines()
    assert json.loads(line)[2] == [a0, b0, [0, {"rank": 1}], b1, c1]
    assert list(iter_metrics(tmp_path)) == [a0, b0, a1, b1, c1]


@pytest.mark.parametrize(
    "entries, kept",
    [
        ([{"rank": 0}, [0, {"rank": 1}]], [{"rank": 0}, {"rank": 1}]),
        ([[0, {"rank": 1}], {"rank": 0}], [{"rank": 0}]),  # refers forward
        (
            [{"rank": 0}, [0, {"rank": 1}], [1, {"rank": 2}]],
            [{"rank": 0}, {"rank": 1}],
        ),  # to a diff
        ([{"rank": 0}, [5, {"rank": 1}], {"rank": 2}], [{"rank": 0}, {"rank": 2}]),  # out of range
        ([{"rank": 0}, [True, {"rank": 1}]], [{"rank": 0}]),  # not an int
        ([{"rank": 0}, [0, [1]], [0, {"rank": 3}, 9]], [{"rank": 0}]),  # not a dict, 3 long
        ([{"rank": 0}, "x", 7, None, {"rank": 4}], [{"rank": 0}, {"rank": 4}]),
    ],
)
def test_a_hostile_node_line_loses_its_bad_entries_not_its_neighbours(entries, kept):
    assert records_of_line(json.dumps(["node", "n", entries]).encode()) == kept


@pytest.mark.parametrize(
    "raw",
    [
        b'["nodes", "n", [{"rank": 0}]]',
        b'["node", "n"]',
        b'["node", "n", {"rank": 0}]',
        b"[1, 2",
        b"[]",
    ],
)
def test_an_array_that_is_no_node_line_is_garbage(raw):
    assert records_of_line(raw) == []


def test_a_node_line_cannot_expand_quadratically():
    """One wide record and thousands of one-key diffs of it (a hostile copy): the rebuilt keys stay
    within NODE_LINE_KEYS_PER_BYTE of the line's bytes; the whole record itself is kept."""
    from ptops.ops.runrecord.metrics import NODE_LINE_KEYS_PER_BYTE

    wide = {f"k{i}": 0 for i in range(20_000)}
    raw = json.dumps(["node", "n", [wide] + [[0, {"r": i}] for i in range(5_000)]]).encode()
    got = records_of_line(raw)
    assert got[0] == wide and 1 < len(got) < 5_001
    assert sum(map(len, got[1:])) <= NODE_LINE_KEYS_PER_BYTE * len(raw)
    # a real line (the module's records) is far inside the bound: every entry rebuilds
    # (test_a_node_line_reads_back_as_the_line_a_rank_file)


def test_a_ranks_record_cannot_pass_for_a_node_line():
    """The supervisor writes a rank's record as an object: whatever keys a rank chooses, its line
    is one record (a node line is a top-level array only the writer makes)."""
    rec = {"node": "n", "0": ["node", "n", [{"rank": 0, "loss": -1}]], "rank": 3, "_k": 0}
    w_line = json.dumps(rec).encode()
    assert records_of_line(w_line) == [rec]


def _supervised(tmp_path, sent, *sets):
    """``sent`` through the supervisor's own path: node batches through ``_on_node_batch`` (the
    certificates as the channel server passes them)."""
    from ptops.ops.supervisor.channel import Peer

    world = 4 * PER_NODE
    sup, run = supervisor_without_ranks(
        tmp_path, [f"launch.nproc={world}", "supervisor.metrics_lines=node", *sets], world
    )
    nodes = {
        f"node{n}": Peer(
            cid=100 + n, sock=None, hello={"role": "node", "node": f"node{n}", "attempt": 1}
        )
        for n in range(4)
    }
    peers = {}
    for r in range(world):
        node = nodes[f"node{r // PER_NODE}"]
        peers[r] = Peer(
            cid=r, sock=None, hello={"role": "rank", "rank": r, "attempt": 1, "pid": 1}, via=node
        )
        sup.handle(peers[r], {"t": "_hello"}, 1.0)
    for i, (name, items) in enumerate(_batches(sent)):
        batch = [(peers[rec_["rank"]], {"t": "metrics", "rec": rec_}, like) for rec_, like in items]
        sup.handle(nodes[name], {"t": "_batch", "items": batch}, 2.0 + i)
    sup.metrics_out.close()
    return sup, run


def test_the_supervisor_writes_node_lines_from_its_node_batches(tmp_path, sent):
    """With ``supervisor.metrics_lines=node``: read back as sent, and the resume point reads
    across them."""
    from ptops.ops.supervisor import launcher

    sup, run = _supervised(tmp_path, sent)
    raw = run.metrics.read_bytes()
    assert raw.startswith(b'["node","node0",') and raw.count(b"\n") == len(_batches(sent))
    assert _enc(run.read_metrics()) == _enc(sent)
    assert len(raw) < 0.35 * len(_enc(sent))  # the certified followers went as their keys
    assert launcher.completed_step(run) == 12


def test_the_supervisor_samples_rank_detail_and_its_monitors_still_read_every_record(
    tmp_path, sent
):
    """``supervisor.metrics_rank_detail_every=4``: the file keeps rank 0 every step (the resume
    point reads it) and sums up routine ranks between samples, while the live monitors saw every
    record: the same findings as the full file's supervisor, a straggler among them whose records
    the file mostly sums up."""
    from ptops.ops.supervisor import launcher

    slow = [{**r, "step_s": 0.2} if r["rank"] == 13 else r for r in sent]  # the others wait on 13
    _, full_run = _supervised(tmp_path / "a", slow)
    _, run = _supervised(tmp_path / "b", slow, "supervisor.metrics_rank_detail_every=4")
    assert launcher.completed_step(run) == 12
    back = run.read_metrics()
    assert len(back) < 0.5 * len(sent) and {r["step"] for r in back if r["rank"] == 0} == set(
        range(1, 13)
    )
    summed = [s["step"] for s in _summaries(run.metrics) if 13 in s["ranks"]]
    assert len(summed) >= 5 and len([r for r in back if r["rank"] == 13]) == 12 - len(summed)
    # the summary names it as its group's fastest (min step_s) wherever it is summed up
    assert all(s["keys"]["step_s"][1] == 13 for s in _summaries(run.metrics) if 13 in s["ranks"])

    def findings(run):
        return [
            {k: v for k, v in e.items() if k != "ts"}
            for e in run.read_events()
            if e.get("kind") in ("anomaly", "straggler")
        ]

    got = findings(run)
    assert any(e["kind"] == "straggler" and e["rank"] == 13 for e in got)
    assert got == findings(full_run)
    # diagnose reads the sampled file and says what its replay could judge
    from ptops.diagnostics.diagnose import diagnose
    from ptops.recipes.schema import dump_json, load

    for path, sets in ((run.path, ["supervisor.metrics_rank_detail_every=4"]), (full_run.path, [])):
        rec, _ = load("titan-tiny", ["supervisor.metrics_lines=node", *sets])
        (path / "recipe.json").write_text(dump_json(rec))
    said = [n for n in diagnose(run.path)["notes"] if "metrics_rank_detail_every" in n]
    assert len(said) == 1 and "every 4 steps" in said[0]
    assert not [n for n in diagnose(full_run.path)["notes"] if "rank_detail" in n]


def test_metrics_lines_is_a_checked_recipe_key():
    from ptops.recipes.schema import RecipeError, load

    assert load("titan-tiny", [])[0].supervisor.metrics_lines == "rank"
    with pytest.raises(RecipeError, match="metrics_lines"):
        load("titan-tiny", ["supervisor.metrics_lines=nodes"])


def _write_sampled(path, batches, every: int) -> MetricsWriter:
    w = MetricsWriter(path, detail_every=every)
    for name, items in batches:
        with w.held(), w.node(name):
            for rec, like in items:
                w.append(rec, like)
    w.close()
    return w


def _summaries(path) -> list[dict]:
    from ptops.ops.runrecord.metrics import node_summaries_of_line

    return [s for raw in path.read_bytes().splitlines() for s in node_summaries_of_line(raw)]


def test_rank_detail_every_k_steps_keeps_rank_0_the_odd_ones_and_sums_up_the_rest(tmp_path, sent):
    """``metrics_rank_detail_every = 4``: steps 4, 8, 12 whole; on the others a node line keeps
    rank 0 and every record that is not routine (a key of its own, a NaN loss, a record the
    certificate did not rebuild and the leader it needs) and sums up the rest: each record sent is
    kept as sent or named in exactly one summary of its step, whose spread is exact. Rank 0's
    readers see every step; with clean records, the unsampled steps keep rank 0 alone."""
    full, sampled = tmp_path / "full", tmp_path / "sampled"
    full.mkdir(), sampled.mkdir()
    batches = _batches(sent)
    _write_sampled(full, batches, 1)
    _write_sampled(sampled, batches, 4)
    back = list(iter_metrics(sampled))
    kept = [(r["step"], r["rank"]) for r in back]
    assert _enc(back) == _enc(r for r in sent if (r["step"], r["rank"]) in set(kept))
    assert {k for k in kept if k[0] % 4 == 0} == {
        (r["step"], r["rank"]) for r in sent if r["step"] % 4 == 0
    }
    odd = {(r["step"], r["rank"]) for r in sent if "mem_rss_mb" in r or r["loss"] != r["loss"]}
    assert odd <= set(kept) and {(s, 0) for s in range(1, 13)} <= set(kept)
    assert _enc(rank0_records(sampled)) == _enc(rank0_records(full))
    assert live_rank0(sampled)[1] == len(kept)  # the index account counts what the file holds
    by = {(r["step"], r["rank"]): r for r in sent}
    summaries = _summaries(sampled / "metrics.jsonl")
    named = [(s["step"], r) for s in summaries for r in s["ranks"]]
    assert sorted(named + kept) == sorted(by)  # a partition: nothing lost, nothing twice
    assert all(s["step"] % 4 for s in summaries)
    for s in summaries:
        for key in ("step_s", "ts"):
            vals = sorted((by[(s["step"], r)][key], r) for r in s["ranks"])
            lo, mid, hi = vals[0], vals[(len(vals) - 1) // 2], vals[-1]
            assert s["keys"][key] == [lo[0], lo[1], mid[0], hi[0], hi[1]]
    assert all("keys" not in r for r in back)  # a summary is never read as a record
    assert (sampled / "metrics.jsonl").stat().st_size < 0.8 * (
        full / "metrics.jsonl"
    ).stat().st_size
    # clean records: on the unsampled steps rank 0 alone is kept, every other node summed up
    clean = [r for r in sent if (r["step"], r["rank"]) not in odd]
    sparse = tmp_path / "clean"
    sparse.mkdir()
    _write_sampled(sparse, _batches(clean), 10)
    kept = {(r["step"], r["rank"]) for r in iter_metrics(sparse)}
    zeros = {(r["step"], 0) for r in clean if r["rank"] == 0 and r["step"] != 10}
    assert {k for k in kept if k[0] != 10} == zeros and len(zeros) >= 9
    # every 1: the node lines of before, byte for byte
    again = tmp_path / "again"
    again.mkdir()
    _write(again, batches, node_lines=True)
    assert (again / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()


def test_a_summary_reads_a_rank_its_leaders_value_and_rank_0_keeps_its_leader(tmp_path):
    """Rank 0 as a follower is kept, so is the leader its diff needs; a follower whose step time
    equals its leader's (not in its diff) is summed up with the leader's value; step 4 (a multiple
    of 2) keeps everyone."""
    from ptops.ops.runrecord.metrics import node_summaries_of_line

    def rec(step, rank, step_s, ts):
        return {"step": step, "rank": rank, "loss": 1.5, "step_s": step_s, "ts": ts}

    w = MetricsWriter(tmp_path, detail_every=2)
    for step in (3, 4):
        lead = rec(step, 1, 0.5, 10.0)
        with w.node("n"):
            w.append(lead)
            for r, step_s, ts in ((0, 0.7, 10.1), (2, 0.5, 10.2), (3, 0.9, 10.3)):
                other = rec(step, r, step_s, ts)
                w.append(other, (1, frozenset(k for k in other if other[k] != lead[k])))
    w.close()
    line3, line4 = (tmp_path / "metrics.jsonl").read_bytes().splitlines()
    assert [(r["step"], r["rank"]) for r in records_of_line(line3)] == [(3, 1), (3, 0)]
    assert node_summaries_of_line(line3) == [
        {
            "step": 3,
            "ranks": [2, 3],
            "keys": {"step_s": [0.5, 2, 0.5, 0.9, 3], "ts": [10.2, 2, 10.2, 10.3, 3]},
        }
    ]
    assert [r["rank"] for r in records_of_line(line4)] == [1, 0, 2, 3]
    assert node_summaries_of_line(line4) == []


@pytest.mark.parametrize(
    "entry",
    [
        ["summary", {"step": "3", "ranks": [1], "keys": {}}],
        ["summary", {"step": 3, "ranks": "1", "keys": {}}],
        ["summary", {"step": 3, "ranks": [1.0], "keys": {}}],
        ["summary", {"step": 3, "ranks": [1], "keys": []}],
        ["summary", []],
        ["summary", {"step": 3, "ranks": [1], "keys": {}}, 9],
        ["summaries", {"step": 3, "ranks": [1], "keys": {}}],
    ],
)
def test_a_hostile_summary_entry_is_no_summary_and_no_record(entry):
    from ptops.ops.runrecord.metrics import node_summaries_of_line

    raw = json.dumps(["node", "n", [{"step": 3, "rank": 0}, [0, {"rank": 1}], entry]]).encode()
    assert node_summaries_of_line(raw) == []
    assert records_of_line(raw) == [{"step": 3, "rank": 0}, {"step": 3, "rank": 1}]
    keys = {"a": [1, 2, 1, 1, 2], "b": [1, 2, "x", 1, 2], "c": [1, 2.0, 1, 1, 2], "d": [1e999] * 5}
    raw = json.dumps(["node", "n", [["summary", {"step": 3, "ranks": [2], "keys": keys}]]])
    assert node_summaries_of_line(raw.encode()) == [
        {"step": 3, "ranks": [2], "keys": {"a": [1, 2, 1, 1, 2]}}
    ]


def test_rank_detail_every_is_a_checked_recipe_key():
    from ptops.recipes.schema import RecipeError, load

    assert load("titan-tiny", [])[0].supervisor.metrics_rank_detail_every == 1
    with pytest.raises(RecipeError) as e:
        load("titan-tiny", ["supervisor.metrics_rank_detail_every=4"])
    assert "supervisor.metrics_rank_detail_every" in str(e.value) and "metrics_lines" in str(
        e.value
    )
    assert "\n" not in str(e.value)
    sup = load(
        "titan-tiny",
        ["supervisor.metrics_rank_detail_every=4", "supervisor.metrics_lines=node"],
    )[0].supervisor
    assert sup.metrics_rank_detail_every == 4
    with pytest.raises(RecipeError, match="metrics_rank_detail_every"):
        load("titan-tiny", ["supervisor.metrics_rank_detail_every=0"])
