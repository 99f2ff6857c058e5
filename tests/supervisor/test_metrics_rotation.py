"""``metrics.jsonl`` rotated into ``metrics/NNNNNN.jsonl`` segments with an index
(ops/runrecord/metrics.py): the writer, the one reader, the live follower across rotations, a
hostile copied index, ``ptops status`` on a rotated run directory, and ranks as ranges."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_ptops, supervisor_without_ranks

from ptops.ops.runrecord.follow import replay
from ptops.ops.runrecord.metrics import (
    INDEX,
    MetricsIndexError,
    MetricsTail,
    MetricsWriter,
    iter_metrics,
    maybe_rank0,
    rank0_records,
    rank0_slim,
    read_index,
    segments,
)
from ptops.ops.runrecord.ranks import compact, rank_list
from ptops.ops.runrecord.rundir import RunDir, read_jsonl

TITAN = REPO / "tests" / "data" / "obs-titan"


def _records(n_steps: int = 30, ranks: int = 4, attempts: int = 2) -> list[dict]:
    """Real titan records (tests/data/obs-titan), repeated over steps, ranks and attempts."""
    base = [r for r in read_jsonl(TITAN / "metrics.jsonl") if r["rank"] == 0][0]
    out = []
    ts = 1796007405.0
    for att in range(1, attempts + 1):
        for step in range(1, n_steps + 1):
            ts += 0.87
            for rank in range(ranks):
                out.append(
                    {
                        **base,
                        "step": step,
                        "rank": rank,
                        "attempt": att,
                        "loss": 6.0 / step,
                        "ts": ts,
                    }
                )
    return out


def _write(run: Path, records: list[dict], rotate_bytes: int) -> MetricsWriter:
    w = MetricsWriter(run, rotate_bytes=rotate_bytes)
    for r in records:
        w.append(r)
    w.close()
    return w


def test_rotation_at_a_tiny_limit_reads_back_every_record_byte_for_byte(tmp_path):
    recs = _records()
    plain, rotated = tmp_path / "plain", tmp_path / "rotated"
    plain.mkdir(), rotated.mkdir()
    _write(plain, recs, 0)
    w = _write(rotated, recs, 4096)  # a record is ~700 B: a segment every ~6 records
    segs = segments(rotated)
    assert w.rotations == len(segs) > 10
    assert [s.number for s in segs] == list(range(1, len(segs) + 1))
    assert sorted(os.listdir(rotated / "metrics")) == [*(s.path.name for s in segs), INDEX]
    # the segments then the live file are the unrotated file, byte for byte
    joined = b"".join(s.path.read_bytes() for s in segs) + (rotated / "metrics.jsonl").read_bytes()
    assert joined == (plain / "metrics.jsonl").read_bytes()
    assert list(iter_metrics(rotated)) == recs == RunDir(rotated).read_metrics()
    assert not (plain / "metrics").exists()  # no limit: no folder, as before
    # the index describes each segment exactly
    for s in segs:
        lines = [json.loads(x) for x in s.path.read_text().splitlines()]
        info = s.info
        assert info["file"] == s.path.name and info["lines"] == len(lines)
        assert info["bytes"] == s.path.stat().st_size >= 4096
        assert info["first_step"] == lines[0]["step"] and info["last_step"] == lines[-1]["step"]
        assert info["max_step"] == max(r["step"] for r in lines)
        assert info["attempts"] == sorted({r["attempt"] for r in lines})
        assert info["first_ts"] == lines[0]["ts"] and info["last_ts"] == lines[-1]["ts"]
        assert info["rank0"] == [rank0_slim(r) for r in lines if r["rank"] == 0]
    # rank 0's records: the index's for the segments, the live file's read
    assert list(rank0_records(rotated)) == [rank0_slim(r) for r in recs if r["rank"] == 0]
    assert list(rank0_records(plain)) == list(rank0_records(rotated))
    assert oct((rotated / "metrics").stat().st_mode & 0o777) == "0o700"
    assert oct(segs[0].path.stat().st_mode & 0o777) == "0o600"


def test_a_held_batch_is_one_write_and_reads_back_as_if_written_alone(tmp_path, monkeypatch):
    """A node's batch goes out in one ``write`` at its end, rotations inside it included; the
    files are byte for byte the ones a record-at-a-time writer makes, and a handler that raises
    mid-batch loses none of the records appended before it."""
    recs = _records(n_steps=12)
    plain, held = tmp_path / "plain", tmp_path / "held"
    plain.mkdir(), held.mkdir()
    _write(plain, recs, 4096)
    writes: list[int] = []
    real_write = os.write
    monkeypatch.setattr(
        "ptops.ops.runrecord.metrics.os.write",
        lambda fd, data: writes.append(len(data)) or real_write(fd, data),
    )
    w = MetricsWriter(held, rotate_bytes=4096)
    batches = [recs[i : i + 16] for i in range(0, len(recs), 16)]
    for i, batch in enumerate(batches):
        with pytest.raises(RuntimeError) if i == 3 else contextlib.nullcontext():
            with w.held():
                rotations, n = w.rotations, len(writes)
                for r in batch:
                    w.append(r)
                    with w.held():  # nested: still the outer batch's
                        pass
                if w.rotations == rotations:  # nothing written before the batch's end
                    assert len(writes) == n
                if i == 3:
                    raise RuntimeError("a handler's bug")
    w.close()
    assert w.rotations == len(segments(held)) > 5
    assert [s.path.read_bytes() for s in segments(held)] == [
        s.path.read_bytes() for s in segments(plain)
    ]
    assert (held / "metrics.jsonl").read_bytes() == (plain / "metrics.jsonl").read_bytes()
    assert list(iter_metrics(held)) == recs
    # a write a batch, plus per rotation inside one what was held before it and the index line
    assert len(writes) <= len(batches) + 2 * w.rotations < len(recs) / 2


def test_a_new_writer_continues_the_numbering_and_the_live_files_account(tmp_path):
    recs = _records()
    half = len(recs) // 2 + 3
    _write(tmp_path, recs[:half], 4096)
    before = segments(tmp_path)
    assert (tmp_path / "metrics.jsonl").stat().st_size > 0  # a part segment left live
    _write(tmp_path, recs[half:], 4096)  # a resumed run: a new supervisor, the same run directory
    segs = segments(tmp_path)
    assert [s.number for s in segs] == list(range(1, len(segs) + 1)) and len(segs) > len(before)
    assert list(iter_metrics(tmp_path)) == recs
    # the segment that holds lines of both writers is described whole
    for s in segs:
        assert s.info["lines"] == len(s.path.read_text().splitlines())
    assert list(rank0_records(tmp_path)) == [rank0_slim(r) for r in recs if r["rank"] == 0]


def test_a_rotation_cut_short_before_its_index_line(tmp_path):
    """A supervisor killed between the rename and the index line: the segment is still read, and
    the next supervisor describes it (after ending the torn index line)."""
    recs = _records(10)
    _write(tmp_path, recs, 4096)
    index = tmp_path / "metrics" / INDEX
    lines = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])  # the last line torn
    segs = segments(tmp_path)
    assert segs[-1].info is None and all(s.info for s in segs[:-1])
    assert list(iter_metrics(tmp_path)) == recs
    assert list(rank0_records(tmp_path)) == [rank0_slim(r) for r in recs if r["rank"] == 0]
    w = MetricsWriter(tmp_path, rotate_bytes=4096)
    w.append(recs[0])
    w.close()
    segs = segments(tmp_path)
    assert all(s.info for s in segs)
    assert list(iter_metrics(tmp_path)) == recs + [recs[0]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_live_follower_crosses_rotations_without_losing_or_repeating_a_line(tmp_path, seed):
    rng = random.Random(seed)
    recs = _records(40)
    w = MetricsWriter(tmp_path, rotate_bytes=rng.choice([1500, 4096, 9000]))
    tail = MetricsTail(tmp_path)
    late = MetricsTail(tmp_path, from_end=True)  # an exporter started mid-run
    got, got_late = [], []
    start_late = None
    for i, r in enumerate(recs):
        w.append(r)
        if rng.random() < 0.15:  # reads at random points: zero, one or several rotations between
            got += tail.read()
        if i == len(recs) // 3:
            late = MetricsTail(tmp_path, from_end=True)
            start_late = i + 1
        elif start_late is not None and rng.random() < 0.1:
            got_late += late.read()
    # a torn line mid-write is not read, then read once whole
    line = (json.dumps(recs[0], separators=(",", ":")) + "\n").encode()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line[:50])
    got += tail.read()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(line[50:])
    got += tail.read()
    got_late += late.read()
    w.close()
    assert w.rotations > 5
    assert got == recs + [recs[0]]
    assert got_late == recs[start_late:] + [recs[0]]
    tail.close(), late.close()


def test_a_rotation_between_the_listing_and_the_read_is_not_lost(tmp_path, monkeypatch):
    """The writer renames the live file after the follower listed the segments: the follower
    notices the new file at the path and reads the rest of the old one first."""
    import ptops.ops.runrecord.metrics as m

    recs = _records(10)
    w = MetricsWriter(tmp_path, rotate_bytes=10**9)
    tail = MetricsTail(tmp_path)
    for r in recs[:5]:
        w.append(r)
    assert tail.read() == recs[:5]
    for r in recs[5:12]:
        w.append(r)
    listing = m._listing

    def listing_then_rotate(run_path):
        out = listing(run_path)
        if not w.rotations:
            w.rotate()
            for r in recs[12:]:
                w.append(r)
        return out

    monkeypatch.setattr(m, "_listing", listing_then_rotate)
    assert tail.read() == recs[5:]
    monkeypatch.setattr(m, "_listing", listing)
    assert tail.read() == [] and w.rotations == 1
    w.append(recs[0])
    assert tail.read() == [recs[0]]
    w.close()


def test_the_exporters_replay_reads_a_rotated_run_in_order(tmp_path):
    recs = _records(8)
    _write(tmp_path, recs, 3000)

    class Sink:
        def __init__(self):
            self.metrics, self.events = [], []

        def observe_metric(self, r):
            self.metrics.append(r)

        def observe_event(self, e):
            self.events.append(e)

    s = Sink()
    assert replay(tmp_path, s) == len(recs)
    assert s.metrics == recs


# ---------------------------------------------------------------- a hostile copy


def _rotated(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(TITAN / "events.jsonl", run / "events.jsonl")
    shutil.copy(TITAN / "recipe.json", run / "recipe.json")
    _write(run, list(read_jsonl(TITAN / "metrics.jsonl")), 2000)
    assert len(segments(run)) >= 3
    return run


def _entry(file="000001.jsonl", **kw):
    return json.dumps({"file": file, "lines": 1, "bytes": 2, **kw}) + "\n"


@pytest.mark.parametrize(
    "index, words",
    [
        (_entry("../../../etc/passwd"), "line 1: key 'file'"),
        (_entry("/etc/passwd"), "line 1: key 'file'"),
        (_entry("000001.jsonl/../../x"), "line 1: key 'file'"),
        (_entry() + _entry("000001.jsonl"), "line 2: key 'file'"),
        (_entry(lines=-3), "line 1: key 'lines'"),
        (_entry(first_step="x"), "line 1: key 'first_step'"),
        (_entry(rank0="all"), "line 1: key 'rank0'"),
        (_entry(attempts=7), "line 1: key 'attempts'"),
        ("[1, 2]\n", "line 1: expected a JSON object"),
        ("{not json\n", "line 1: not JSON"),
        (_entry("000099.jsonl"), "000099.jsonl: listed in"),
    ],
)
def test_a_malformed_index_is_one_error_naming_the_file_and_key(tmp_path, index, words):
    run = _rotated(tmp_path)
    (run / "metrics" / INDEX).write_text(index)
    with pytest.raises(MetricsIndexError) as e:
        list(rank0_records(run))
    assert words in str(e.value) and str(run / "metrics") in str(e.value)
    assert "\n" not in str(e.value)
    from ptops.ops.runrecord.status import collect

    with pytest.raises(MetricsIndexError):
        collect(run)
    with pytest.raises(MetricsIndexError):  # the supervisor resuming on it: before any write
        MetricsWriter(run, rotate_bytes=2000).append({"step": 1, "rank": 0})


def test_no_read_leaves_the_run_directory(tmp_path):
    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps({"step": 1, "rank": 0, "loss": 123.0}) + "\n")
    run = _rotated(tmp_path)
    seg = run / "metrics" / "000001.jsonl"
    seg.unlink()
    seg.symlink_to(outside)  # a segment that is a link out of the run directory
    for read in (lambda: list(iter_metrics(run)), lambda: list(rank0_records(run))):
        with pytest.raises(MetricsIndexError, match="000001.jsonl: not a regular file"):
            read()
    seg.unlink()
    os.mkfifo(seg)  # a FIFO would block a reader forever
    with pytest.raises(MetricsIndexError, match="000001.jsonl: not a regular file"):
        list(iter_metrics(run))
    seg.unlink()
    # the whole folder a link elsewhere
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(run / "metrics"), elsewhere)
    (run / "metrics").symlink_to(elsewhere)
    with pytest.raises(MetricsIndexError, match="metrics: not a folder"):
        list(iter_metrics(run))
    with pytest.raises(MetricsIndexError, match="metrics: not a folder"):
        read_index(run)


def test_status_and_diagnose_say_one_line_and_exit_2_on_a_hostile_index(tmp_path):
    run = _rotated(tmp_path)
    (run / "metrics" / INDEX).write_text(_entry("../../x.jsonl"))
    for cmd in (["status", str(run)], ["diagnose", str(run), "--json"]):
        p = run_ptops(*cmd, timeout=120)
        assert p.returncode == 2, (cmd, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and "key 'file'" in p.stderr and INDEX in p.stderr


def test_launching_on_a_run_directory_with_a_hostile_index_is_one_line_before_any_attempt(
    tmp_path,
):
    """Resuming a copied run directory whose index is hostile: a recipe-style error naming the
    index file and key (``ptops launch`` prints it and exits 2), before a supervisor starts."""
    from ptops.ops.supervisor.launcher import prepare_run
    from ptops.recipes.schema import RecipeError, load, resolve_path

    rec, _ = load("titan-tiny", [])
    run = prepare_run(rec, resolve_path("titan-tiny"), tmp_path / "run").path
    (run / "metrics").mkdir()
    (run / "metrics" / INDEX).write_text(_entry("../../x.jsonl"))
    with pytest.raises(RecipeError) as e:
        prepare_run(rec, resolve_path("titan-tiny"), run)
    assert "key 'file'" in str(e.value) and INDEX in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- status on a rotated run


def test_status_of_a_rotated_run_is_the_unrotated_runs(tmp_path):
    from ptops.ops.runrecord.status import collect

    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("events.jsonl", "recipe.json", "metrics.jsonl"):
        shutil.copy(TITAN / f, plain / f)
    run = _rotated(tmp_path)
    a, b = collect(plain), collect(run)
    a.pop("run_dir"), b.pop("run_dir")
    a.pop("hint", None), b.pop("hint", None)
    assert a == b and a["step"] > 0 and a["goodput"]["ratio"] is not None


def test_the_rank0_prefilter_never_skips_a_rank_0_line():
    assert maybe_rank0(b'{"step":1,"rank":0,"loss":1}\n')
    assert maybe_rank0(b'{"step": 1, "rank": 0}\n')
    assert maybe_rank0(b'{"step":1,"rank":0.0}\n')
    assert maybe_rank0(b'{"step":1}\n')  # no rank: counts as rank 0 for the goodput account
    assert maybe_rank0(b'{"rank":3,"inner":{"rank":0}}\n')  # unsure: parsed
    assert not maybe_rank0(b'{"rank":"0"}\n')  # "0" is not 0 (the goodput account's rule)
    assert not maybe_rank0(b'{"step":1,"rank":3,"loss":1}\n')
    assert not maybe_rank0(b'{"step": 1, "rank": 10}\n')


def test_rank0_read_in_blocks_is_the_line_by_line_read(tmp_path):
    from ptops.ops.runrecord.metrics import _rank0_of

    recs = _records(12, ranks=3)
    _write(tmp_path, recs, 0)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step":99,"rank":0,"lo')  # torn: left out
    want = [rank0_slim(r) for r in recs if r["rank"] == 0]
    for block in (1, 7, 100, 701, 1 << 20):
        with open(tmp_path / "metrics.jsonl", "rb") as f:
            assert list(_rank0_of(f, block)) == want, block


def test_metrics_rotate_mb_is_a_checked_recipe_key(tmp_path):
    from ptops.recipes.schema import RecipeError, load

    r = REPO / "recipes" / "titan-tiny.toml"
    rec, _ = load(r)
    assert rec.supervisor.metrics_rotate_mb == 256.0
    rec, _ = load(r, ["supervisor.metrics_rotate_mb=0.5"])
    assert rec.supervisor.metrics_rotate_mb == 0.5
    with pytest.raises(RecipeError) as e:
        load(r, ["supervisor.metrics_rotate_mb=-1"])
    assert "supervisor.metrics_rotate_mb" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- ranks as ranges


def test_ranks_as_ranges():
    assert rank_list([3]) == "[3]" and rank_list([3], bare=True) == "3"
    assert rank_list([5, 0, 1, 2, 3], bare=True) == "0-3,5"
    many = [*range(8), 9, *range(12, 4096)]
    assert rank_list(many, bare=True) == "0-7,9,12-4095 (4093 ranks)"
    assert rank_list(many) == "[0-7, 9, 12-4095] (4093 ranks)"
    assert rank_list(["a", "b"], bare=True) == "a,b"  # not rank numbers: as given
    assert compact("ranks", many) == "0-7,9,12-4095 (4093 ranks)"
    assert compact("pids", many) is many and compact("ranks", [1, 2]) == [1, 2]
    assert compact("stalled", many) == "0-7,9,12-4095 (4093 ranks)"
    sources = {str(r): "own dump" if r != 9 else "py-spy" for r in many}
    assert compact("stack_sources", sources) == ("own dump: 0-7,12-4095 (4092 ranks); py-spy: 9")
    # a copied run directory's keys: "²" is a digit to str.isdigit, not a number to int()
    odd = {**sources, "\u00b2": "py-spy"}
    assert compact("stack_sources", odd) is odd


def test_status_and_diagnose_print_a_hang_of_thousands_of_ranks_as_ranges(tmp_path):
    from ptops.diagnostics.diagnose import diagnose
    from ptops.ops.cli.status_view import render
    from ptops.ops.runrecord.status import collect

    run = RunDir(tmp_path / "run").create()
    ranks = [r for r in range(4096) if r not in (8, 10, 11)]
    run.event("launch", attempt=1, nproc=4096)
    hang = run.event(
        "hang",
        attempt=1,
        ranks=ranks,
        step=7,
        silent_s=60.0,
        ranks_text=rank_list(ranks, bare=True),
        stalled=ranks,
        stack_sources={str(r): "own dump" for r in ranks},
    )
    run.event("failed", reason="hang", attempt=1)
    text = render({**collect(run.path), "open_findings": [hang]})
    assert "0-7,9,12-4095 (4093 ranks)" in text and "4095," not in text and len(text) < 2000
    rep = diagnose(run.path)
    inc = next(i for i in rep["incidents"] if i["kind"] == "hang")
    assert inc["ranks"] == ranks and inc["ranks_text"] == "0-7,9,12-4095 (4093 ranks)"
    assert "0-7,9,12-4095 (4093 ranks)" in inc["title"]
    what = next(t["what"] for t in rep["timeline"] if t["kind"] == "hang")
    assert "ranks=0-7,9,12-4095 (4093 ranks)" in what and len(what) < 500


def test_the_tail_window_starts_at_a_step_boundary(tmp_path):
    from ptops.ops.runrecord.metrics import tail_records

    recs = _records(20, ranks=4, attempts=1)
    _write(tmp_path, recs, 3000)
    total = sum(s.path.stat().st_size for s in segments(tmp_path))
    total += (tmp_path / "metrics.jsonl").stat().st_size
    assert list(tail_records(tmp_path, total)) == recs == list(tail_records(tmp_path, 10**9))
    for nbytes in (1, 700, 2500, 5000, 9000, total - 1):
        got = list(tail_records(tmp_path, nbytes))
        assert got == recs[len(recs) - len(got) :]  # the run's end, in order
        if len(got) >= 4:
            assert len(got) % 4 == 0  # whole steps of the 4 ranks
            assert got[0]["rank"] == 0
    assert list(tail_records(tmp_path, 1)) == []  # no whole line in one byte


def test_the_supervisor_rotates_at_its_recipe_limit(tmp_path):
    """The supervisor's own path: rank messages through ``messages._on_metrics`` into its writer,
    rotated at ``supervisor.metrics_rotate_mb``; the resume point reads across the segments."""
    from ptops.ops.supervisor import launcher
    from ptops.ops.supervisor.channel import Peer

    sets = ["launch.nproc=2", "supervisor.metrics_rotate_mb=0.004"]
    sup, run = supervisor_without_ranks(tmp_path, sets, 2)
    peers = [
        Peer(cid=r, sock=None, hello={"role": "rank", "rank": r, "attempt": 1, "pid": 100 + r})
        for r in (0, 1)
    ]
    sent = _records(25, ranks=2, attempts=1)
    for p in peers:
        sup.handle(p, {"t": "_hello"}, 1.0)
    for i, r in enumerate(sent):
        sup.handle(peers[r["rank"]], {"t": "metrics", "rec": r}, 2.0 + i)
    sup.metrics_out.close()
    assert sup.metrics_out.rotations >= 5 and len(segments(run.path)) == sup.metrics_out.rotations
    assert run.read_metrics() == sent
    assert launcher.completed_step(run) == 25
