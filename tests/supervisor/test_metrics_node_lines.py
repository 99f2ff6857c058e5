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


def test_the_supervisor_writes_node_lines_from_its_node_batches(tmp_path, sent):
    """The supervisor's own path: node batches through ``_on_node_batch`` (the certificates as
    the channel server passes them) with ``supervisor.metrics_lines=node``; read back as sent,
    and the resume point reads across them."""
    from ptops.ops.supervisor import launcher
    from ptops.ops.supervisor.channel import Peer

    world = 4 * PER_NODE
    sup, run = supervisor_without_ranks(
        tmp_path, [f"launch.nproc={world}", "supervisor.metrics_lines=node"], world
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
    raw = run.metrics.read_bytes()
    assert raw.startswith(b'["node","node0",') and raw.count(b"\n") == len(_batches(sent))
    assert _enc(run.read_metrics()) == _enc(sent)
    assert len(raw) < 0.35 * len(_enc(sent))  # the certified followers went as their keys
    assert launcher.completed_step(run) == 12


def test_metrics_lines_is_a_checked_recipe_key():
    from ptops.recipes.schema import RecipeError, load

    assert load("titan-tiny", [])[0].supervisor.metrics_lines == "rank"
    with pytest.raises(RecipeError, match="metrics_lines"):
        load("titan-tiny", ["supervisor.metrics_lines=nodes"])
