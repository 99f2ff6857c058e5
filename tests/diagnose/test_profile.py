"""``ptops profile`` without a run: the trace analysis on small synthetic Chrome traces, the
supervisor's start step and refusals, the rank-side capture with the real torch profiler, and
the command's errors. The live run is ``tests/diagnose/test_profile_live.py``."""

from __future__ import annotations

import json
import os
import stat
from types import SimpleNamespace

import pytest
from conftest import run_ptops

from ptops.diagnostics.profile import (
    TraceError,
    analyse,
    collective_kind,
    load_trace,
    rank_steps,
    render,
)
from ptops.ops.supervisor.channel import Peer
from ptops.ops.supervisor.messages import MessagesMixin, RankInfo, profile_start
from ptops.ops.supervisor.reached import Reached

MAIN, WORKER = 100, 200
MS = 1000.0  # trace times are microseconds


class Trace:
    """A rank's trace built step by step: times in ms from the start of the trace."""

    def __init__(self):
        self.events: list[dict] = [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": MAIN, "args": {}}
        ]

    def x(self, name: str, t0: float, dur: float, tid: int = MAIN, cat: str = "cpu_op") -> "Trace":
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 1,
                "tid": tid,
                "ts": t0 * MS,
                "dur": dur * MS,
            }
        )
        return self

    def step(self, step: int, t0: float, dur: float) -> "Trace":
        return self.x(f"ptops/step#{step}", t0, dur, cat="user_annotation")

    def dict(self) -> dict:
        return {"schemaVersion": 1, "traceEvents": self.events}


def _step(
    tr: Trace,
    step: int,
    t0: float,
    *,
    sleep: float = 0.0,
    data: float = 2.0,
    wait: float = 0.0,
    compute: float = 50.0,
    comm: float = 10.0,
    blocking: bool = False,
) -> float:
    """One ptops step: [sleep] data, [wait in an all_reduce], compute, an all_gather; returns its
    end."""
    t = t0 + sleep
    tr.x("ptops/data", t, data, cat="user_annotation")
    tr.x("enumerate(DataLoader)", t + 0.1, data - 0.2)
    t += data
    coll = wait + 1.0  # the all_reduce of the valid-token count: it ends when the late peer joins
    if (
        blocking
    ):  # a blocking work.wait(): no op on the training thread, only the worker's collective
        tr.x("c10d::allreduce_", t, 0.2)
    else:
        tr.x("_c10d_functional::wait_tensor", t, coll)
        tr.x("PythonSubclass", t + 0.05, coll - 0.1)
    tr.x("gloo:all_reduce", t + 0.1, coll - 0.1, tid=WORKER, cat="user_annotation")
    t += coll
    tr.x("aten::mm", t, compute)
    tr.x(
        "gloo:all_gather", t + 1.0, comm / 2, tid=WORKER, cat="user_annotation"
    )  # overlapped: compute
    t += compute
    tr.x("FSDP::pre_backward (layers.0)", t, comm, cat="user_annotation")
    tr.x(
        "gloo:all_gather", t + 0.1, comm - 0.2, tid=WORKER, cat="user_annotation"
    )  # exposed: collectives
    t += comm
    tr.step(step, t0, t - t0)
    return t


def _pair(
    slow_sleep: float = 0.0, slow_data: float = 2.0, steps=(5, 6, 7), **kw
) -> dict[int, dict]:
    """Two ranks in lockstep: rank 1 sleeps ``slow_sleep`` ms (or loads data for ``slow_data``)
    before each step's first collective, so rank 0 waits that long inside it."""
    fast, slow = Trace(), Trace()
    t = 0.0
    for s in steps:
        late = slow_sleep + slow_data - 2.0
        end0 = _step(fast, s, t, wait=late, **kw)
        end1 = _step(slow, s, t, sleep=slow_sleep, data=slow_data, **kw)
        assert abs(end0 - end1) < 1e-6
        t = end0 + 0.5
    return {0: fast.dict(), 1: slow.dict()}


def test_a_late_rank_is_named_and_its_peers_wait_in_all_reduce():
    r = analyse(_pair(slow_sleep=300.0))
    assert r["steps"] == [5, 6, 7] and r["ranks"] == [0, 1]
    fast, slow = r["per_rank"]
    assert (
        r["slow_rank"] == 1 and r["slow_part"] == "compute" and r["peers_wait_in"] == "all_reduce"
    )
    assert r["excess_s"] == pytest.approx(0.300, abs=0.002)
    assert fast["waiting_s"] == pytest.approx(0.300, abs=0.002) and slow[
        "waiting_s"
    ] == pytest.approx(0.0, abs=1e-6)
    assert fast["collectives"]["all_reduce"]["waiting_s"] == pytest.approx(0.300, abs=0.002)
    assert slow["compute_s"] - fast["compute_s"] == pytest.approx(0.300, abs=0.002)
    # every instant of a step is in exactly one part
    for row in r["per_rank"]:
        parts = row["compute_s"] + row["communication_s"] + row["waiting_s"] + row["data_s"]
        assert parts == pytest.approx(row["step_s"], abs=1e-5)
    assert r["verdict"].startswith(
        "rank 1 is the slow rank: +0.30 s/step outside collectives, in compute"
    )
    assert "its peers wait in all_reduce" in r["verdict"]
    text = render({**r, "id": "x"})
    assert r["verdict"] in text and "waiting" in text.splitlines()[1]


def test_parts_of_a_step():
    steps = rank_steps(_pair()[0])
    st = steps[5]
    # data 2 ms; collectives: the all_reduce's wait_tensor (1 ms) + the all_gather in flight while
    # the training thread is in no operator (9.8 ms); compute: aten::mm (50 ms, the all_gather it
    # overlaps included) and the FSDP range's 0.2 ms before and after its all_gather
    assert st["data_s"] == pytest.approx(0.002, abs=1e-6)
    assert st["collectives_s"] == pytest.approx(0.0108, abs=1e-6)
    assert st["compute_s"] == pytest.approx(0.0502, abs=1e-6)
    assert st["by_kind"]["all_reduce"] == pytest.approx(0.0009, abs=1e-6)
    assert st["by_kind"]["all_gather"] == pytest.approx(0.0098, abs=1e-6)
    assert st["by_kind"]["other"] == pytest.approx(
        0.0001, abs=1e-6
    )  # wait_tensor before the worker began
    assert st["wall_s"] == pytest.approx(0.063, abs=1e-6)


def test_a_blocking_wait_without_an_op_counts_as_collective():
    r = analyse(_pair(slow_sleep=200.0, blocking=True))
    assert r["slow_rank"] == 1 and r["peers_wait_in"] == "all_reduce"
    assert r["per_rank"][0]["waiting_s"] == pytest.approx(0.200, abs=0.002)


def test_slow_data_loading_is_named():
    r = analyse(_pair(slow_data=150.0))
    assert r["slow_rank"] == 1 and r["slow_part"] == "data loading"
    assert r["per_rank"][1]["data_s"] == pytest.approx(0.150, abs=1e-4)


def test_balanced_ranks_have_no_slow_rank():
    r = analyse(_pair(compute=80.0))
    assert r["slow_rank"] is None and r["slow_part"] is None
    assert r["biggest_part"] == "compute" and r["verdict"].startswith("no slow rank")
    one = analyse({0: _pair()[0]})
    assert one["slow_rank"] is None and one["verdict"].startswith("one rank")


def test_only_the_steps_every_rank_traced_count():
    a, b = _pair(steps=(5, 6, 7))[0], _pair(steps=(6, 7, 8))[1]
    assert analyse({0: a, 1: b})["steps"] == [6, 7]
    with pytest.raises(TraceError, match="no step in common"):
        analyse({0: _pair(steps=(1, 2))[0], 1: _pair(steps=(3, 4))[1]})


def test_bad_traces(tmp_path):
    with pytest.raises(TraceError, match="rank 0: no ptops/step#N ranges"):
        analyse({0: Trace().x("aten::mm", 0, 1).dict()})
    with pytest.raises(TraceError, match="no traceEvents"):
        rank_steps({"foo": 1})
    bad = tmp_path / "rank-0.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="rank-0.json: not JSON"):
        load_trace(bad)


def test_collective_kinds():
    assert [
        collective_kind(n)
        for n in (
            "gloo:all_reduce",
            "c10d::allreduce_",
            "nccl:all_gather",
            "c10d::_reduce_scatter_base_",
            "gloo:broadcast",
            "nccl:send",
            "wait",
        )
    ] == [
        "all_reduce",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "send_recv",
        "other",
    ]


# ---------------------------------------------------------------- the supervisor's part


def test_start_step_is_past_the_furthest_rank_by_a_second_of_steps():
    assert profile_start([7, 9], 0.1) == 9 + 11  # fast steps: ~1 s of lead
    assert profile_start([7, 9], 0.5) == 9 + 3
    assert profile_start([7, 9], 5.0) == 9 + 2  # at least two steps
    assert profile_start([3], None) == 5 and profile_start([], None) == 2


class FakeServer:
    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, peer, msg) -> bool:
        self.sent.append((peer, msg))
        return True


class FakeSupervisor(MessagesMixin):
    def __init__(self, steps=(10, 12), total=40, state="running"):
        self.state, self.attempt, self.world = state, 1, len(steps)
        self.ranks = {
            r: RankInfo(r, 1000 + r, "h", peer=f"peer{r}", step=s, step_s=0.5)
            for r, s in enumerate(steps)
        }
        self.recipe = SimpleNamespace(train=SimpleNamespace(steps=total))
        self.server, self.events, self.profiling = FakeServer(), [], None
        self.monitor = None  # (the hang monitor: the steps a relay summed up, ``rank_step``)
        self.reached = Reached()  # a script's own saves (rank events pass through it)

    def event(self, kind, **fields):
        self.events.append({"kind": kind, **fields})

    def say(self, msg):
        pass

    def ask(self, **msg) -> dict:
        self.handle(Peer(cid=1, sock=None, hello={"role": "control"}), {"t": "profile", **msg}, 0.0)
        return self.server.sent[-1][1]


def test_the_start_step_counts_the_steps_a_relay_summed_up():
    """A rank whose steps came only in its relay's summaries and folded beats (``RankInfo.step``
    not written: ``rank_step`` reads the hang monitor): the start is past its step too."""
    from ptops.monitors.hang import HangMonitor

    sup = FakeSupervisor(steps=(10, 0))
    sup.monitor = HangMonitor(2, 0.0)
    sup.monitor.observe({"kind": "metrics", "rank": 1, "step": 20, "step_s": 0.5, "ts": 1.0})
    answer = sup.ask(steps=4)
    assert answer["ok"] and answer["start_step"] == 20 + 3


def test_supervisor_forwards_one_start_step_to_every_rank():
    sup = FakeSupervisor()
    answer = sup.ask(steps=4)
    assert answer["ok"] and answer["start_step"] == 12 + 3 and answer["ranks"] == [0, 1]
    cmds = [(p, m) for p, m in sup.server.sent if m.get("cmd") == "profile"]
    assert [p for p, _ in cmds] == ["peer0", "peer1"]
    assert all(
        m == {"cmd": "profile", "id": answer["id"], "start_step": 15, "steps": 4} for _, m in cmds
    )
    assert sup.events == [
        {
            "kind": "profile_requested",
            "id": answer["id"],
            "attempt": 1,
            "start_step": 15,
            "steps": 4,
            "ranks": [0, 1],
            "dir": f"profiles/{answer['id']}",
        }
    ]
    # a second request while the first is being captured is refused; once every rank reported,
    # accepted
    again = sup.ask(steps=2)
    assert not again["ok"] and "still being captured by ranks [0, 1]" in again["error"]
    for r in (0, 1):
        sup.handle(
            Peer(cid=10 + r, sock=None, hello={"attempt": 1, "rank": r}),
            {"t": "event", "kind": "profile_captured", "fields": {"id": answer["id"], "rank": r}},
            0.0,
        )
    assert sup.ask(steps=2)["ok"]


@pytest.mark.parametrize(
    "sup, msg, words",
    [
        (FakeSupervisor(), {"steps": 0}, "steps: expected 1..100"),
        (FakeSupervisor(), {"steps": "x"}, "steps: expected a whole number"),
        (
            FakeSupervisor(state="restarting"),
            {"steps": 3},
            "no live attempt to profile (state restarting)",
        ),
        (
            FakeSupervisor(steps=(30, 34)),
            {"steps": 4},
            "the run is at step 34 of 40: too few steps left",
        ),
    ],
)
def test_supervisor_refusals(sup, msg, words):
    answer = sup.ask(**msg)
    assert not answer["ok"] and words in answer["error"], answer
    assert not sup.events


def test_supervisor_refuses_while_ranks_are_missing():
    sup = FakeSupervisor()
    sup.ranks[1].gone_ts = 1.0
    answer = sup.ask(steps=2)
    assert not answer["ok"] and "only 1 of 2 ranks" in answer["error"]


# ------------------------------------------------------------ the rank's part (real torch profiler)


def _train(capture, steps, *, mark=True):
    import torch

    from ptops.ops.rank.profiler import NULL as _NULL

    w = torch.ones(64, 64)
    for s in steps:
        capture.at_step(s)
        with capture.mark("data") if mark else _NULL:
            x = torch.randn(8, 64)
        (x @ w).sum()


def test_capture_traces_whole_steps_into_a_private_file(tmp_path):
    from ptops.ops.rank.profiler import Capture

    reports = []
    cap = Capture(
        "p1",
        start_step=3,
        steps=2,
        run_dir=tmp_path,
        rank=1,
        report=lambda k, **f: reports.append((k, f)),
    )
    _train(cap, range(1, 7))
    assert cap.done and [k for k, _ in reports] == ["profile_captured"]
    f = reports[0][1]
    assert (f["id"], f["first_step"], f["steps"], f["path"], f["partial"]) == (
        "p1",
        3,
        2,
        "profiles/p1/rank-1.json",
        False,
    )
    path = tmp_path / f["path"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "profiles").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not [
        p for p in path.parent.iterdir() if p.name.startswith(".")
    ]  # no temporary left behind
    steps = rank_steps(json.loads(path.read_text()))
    assert sorted(steps) == [3, 4] and all(
        s["data_s"] > 0 and s["compute_s"] > 0 for s in steps.values()
    )


def test_capture_late_start_partial_and_missed(tmp_path):
    from ptops.ops.rank.profiler import Capture

    reports = []

    def report(kind, **f):
        reports.append((kind, f))

    late = Capture("p2", start_step=2, steps=3, run_dir=tmp_path, rank=0, report=report)
    _train(late, [5, 6])  # the request came after step 2 had begun: starts at the next step
    late.close(6)  # the rank leaves before the window ends: what it has, marked partial
    assert reports[-1][0] == "profile_captured"
    assert (reports[-1][1]["first_step"], reports[-1][1]["steps"], reports[-1][1]["partial"]) == (
        5,
        2,
        True,
    )
    missed = Capture("p3", start_step=50, steps=3, run_dir=tmp_path, rank=0, report=report)
    _train(missed, [7])
    missed.close(7)
    assert (
        reports[-1][0] == "profile_failed"
        and "before the profile's first step 50" in reports[-1][1]["error"]
    )


def test_probe_marks_are_free_without_a_capture(tmp_path):
    from ptops.ops.rank.probe import Probe
    from ptops.ops.rank.profiler import NULL as _NULL

    probe = Probe(tmp_path, rank=0, attempt=1)
    prof = probe.profile
    assert not prof.running and prof.mark("data") is _NULL
    probe._on_command({"cmd": "profile", "id": "p4", "start_step": 2, "steps": 1})
    prof.at_step(1)
    assert not prof.running
    prof.at_step(2)
    assert prof.running and prof.mark("data") is not _NULL
    prof.at_step(3)
    assert not prof.running and prof.capture is None
    ev = [e for e in probe.run.read_events() if e["kind"] == "profile_captured"]
    assert len(ev) == 1 and ev[0]["first_step"] == 2 and ev[0]["rank"] == 0


# ---------------------------------------------------------------- the command's errors


def test_cli_errors(tmp_path):
    p = run_ptops("profile", str(tmp_path / "nope"))
    assert (
        p.returncode == 2
        and p.stderr.strip() == f"error: {tmp_path / 'nope'}: no such run directory"
    )
    run = tmp_path / "run"
    run.mkdir()
    p = run_ptops("profile", str(run))
    assert p.returncode == 2 and "not a ptops run directory" in p.stderr
    (run / "events.jsonl").write_text(json.dumps({"ts": 1, "kind": "launch", "attempt": 1}) + "\n")
    p = run_ptops("profile", str(run), "--steps", "3")
    assert (
        p.returncode == 2
        and "no live supervisor" in p.stderr
        and len(p.stderr.strip().splitlines()) == 1
    )
    p = run_ptops("profile", str(run), "--id", "x")
    assert p.returncode == 2 and "no profile 'x' in events.jsonl (profiles: none)" in p.stderr
    p = run_ptops("profile", str(run), "--steps", "0")
    assert p.returncode == 2


def test_cli_analyses_a_stored_capture_again(tmp_path):
    """``--id``: the traces of a capture, in a run directory copied from elsewhere (no live run)."""
    run = tmp_path / "run"
    folder = run / "profiles" / "p9"
    folder.mkdir(parents=True)
    events = [
        {
            "ts": 1,
            "kind": "profile_requested",
            "id": "p9",
            "attempt": 1,
            "start_step": 5,
            "steps": 3,
            "ranks": [0, 1],
        }
    ]
    for rank, trace in _pair(slow_sleep=300.0).items():
        (folder / f"rank-{rank}.json").write_text(json.dumps(trace))
        events.append(
            {
                "ts": 2,
                "kind": "profile_captured",
                "id": "p9",
                "rank": rank,
                "attempt": 1,
                "first_step": 5,
                "steps": 3,
                "path": f"profiles/p9/rank-{rank}.json",
            }
        )
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    p = run_ptops("profile", str(run), "--id", "p9", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert (
        r["slow_rank"] == 1
        and r["peers_wait_in"] == "all_reduce"
        and r["summary"] == "profiles/p9/summary.json"
    )
    assert json.loads((folder / "summary.json").read_text())["verdict"] == r["verdict"]
    assert stat.S_IMODE((folder / "summary.json").stat().st_mode) == 0o600
    p = run_ptops("profile", str(run), "--id", "p9")
    assert p.returncode == 0 and "rank 1 is the slow rank: +0.30 s/step" in p.stdout
    os.chmod(folder / "rank-1.json", 0o600)
    (folder / "rank-1.json").write_text("{}")
    p = run_ptops("profile", str(run), "--id", "p9")
    assert p.returncode == 2 and "rank-1.json: not a Chrome trace" in p.stderr
