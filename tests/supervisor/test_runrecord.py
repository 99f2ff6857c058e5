"""The run-record layer: the JSONL tail reader, the event vocabulary and the events -> state
reducer."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from conftest import REPO

from ptops.ops.runrecord import events as ev
from ptops.ops.runrecord.events import EventKind, RunState, missing_fields, next_state, reduce
from ptops.ops.runrecord.jsonl import JsonlTail, append_jsonl, read_jsonl
from ptops.ops.runrecord.rundir import RunDir

# ---------------------------------------------------------------- the tail reader


def test_tail_reads_growth_between_reads(tmp_path):
    p = tmp_path / "m.jsonl"
    tail = JsonlTail(p)
    assert tail.read() == []  # no file yet: empty, not an error
    append_jsonl(p, {"step": 1})
    append_jsonl(p, {"step": 2})
    assert [r["step"] for r in tail.read()] == [1, 2]
    assert tail.read() == []
    append_jsonl(p, {"step": 3})
    assert [r["step"] for r in tail.read()] == [3]
    assert tail.offset == p.stat().st_size


def test_tail_leaves_a_torn_line_for_next_time(tmp_path):
    p = tmp_path / "m.jsonl"
    tail = JsonlTail(p)
    with open(p, "wb") as f:
        f.write(b'{"step":1}\n{"step":2,"lo')
    assert [r["step"] for r in tail.read()] == [1]
    assert tail.offset == len(b'{"step":1}\n')
    with open(p, "ab") as f:
        f.write(b'ss":0.5}\n')
    assert tail.read() == [{"step": 2, "loss": 0.5}]


def test_tail_skips_garbage_lines(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_bytes(b'{"kind":"launch"}\nnot json\n[1,2]\n"str"\n\n\xff\xfe\n{"kind":"completed"}\n')
    tail = JsonlTail(p)
    assert [r["kind"] for r in tail.read()] == ["launch", "completed"]
    assert tail.offset == p.stat().st_size  # garbage is consumed, not re-read forever
    assert [r["kind"] for r in read_jsonl(p)] == ["launch", "completed"]


def test_tail_restarts_on_a_truncated_file(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"a":1}\n{"a":2}\n')
    tail = JsonlTail(p)
    assert len(tail.read()) == 2
    p.write_text('{"a":3}\n')
    assert tail.read() == [{"a": 3}]


def test_tail_from_end_and_from_offset(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"a":1}\n{"a":2}\n')
    assert JsonlTail(p, from_end=True).read() == []
    assert JsonlTail(p, offset=len('{"a":1}\n')).read() == [{"a": 2}]


def test_progress_follow_uses_offsets(tmp_path):
    """The launch progress line: rank-0 records only, offset past whole lines only."""
    import io

    from ptops.ops.cli.progress import Progress

    p = tmp_path / "metrics.jsonl"
    prog = Progress(total=4, stream=io.StringIO(), live=False, plain_every_s=0)
    p.write_text(
        '{"rank":1,"step":1,"loss":9}\n{"rank":0,"step":1,"loss":2.5}\ngarbage\n{"rank":0,"step":2'
    )
    off = prog.follow(p, 0)
    assert prog.step == 1 and prog.loss == 2.5
    assert off == len(p.read_bytes()) - len('{"rank":0,"step":2')
    with open(p, "a") as f:
        f.write(',"loss":1.5}\n')
    assert prog.follow(p, off) == p.stat().st_size
    assert prog.step == 2 and prog.loss == 1.5


# ---------------------------------------------------------------- the vocabulary


def test_every_kind_has_a_spec_and_values_are_the_design_strings():
    assert set(ev.SPECS) == set(EventKind)
    design = {
        "launch": ["attempt"],
        "checkpoint": ["step", "path", "blocking_s", "total_s"],
        "checkpoint_invalid": ["path", "reason"],
        "fault_injected": ["fault", "rank", "step"],
        "crash": ["attempt", "rank", "exit_code"],
        "hang": ["attempt", "ranks", "step", "silent_s"],
        "straggler": ["rank", "ratio"],
        "anomaly": ["monitor", "step", "value", "detail"],
        "restart": ["attempt", "from_step", "reason"],
        "rollback": ["from_step", "to_step", "reason"],
        "completed": ["step"],
        "failed": ["reason"],
    }
    for kind, fields in design.items():
        assert list(ev.SPECS[EventKind(kind)].required) == fields, kind
    assert {str(k) for k in ev.END_KINDS} == {"completed", "failed", "stopped"}
    assert {str(s) for s in ev.END_KINDS} <= {str(s) for s in ev.TERMINAL_STATES}
    # kinds nobody writes are gone
    for dead in (
        "checkpoint_saved",
        "checkpoint_committed",
        "checkpoint_save_failed",
        "interrupted",
    ):
        assert dead not in {str(k) for k in EventKind}


def test_missing_fields():
    assert missing_fields({"ts": 1, "kind": "crash", "attempt": 1, "rank": 0, "exit_code": 1}) == []
    assert missing_fields({"ts": 1, "kind": "crash", "attempt": 1}) == ["rank", "exit_code"]
    assert missing_fields({"ts": 1, "kind": "checkpoint_saved"}) == ["kind"]


def _literal_event_kinds() -> set[str]:
    """Kinds written anywhere in the source tree: ``X.event("kind", ...)`` (a literal) or
    ``X.event(EventKind.NAME, ...)`` (a name that must exist: a misspelt one is reported as
    ``EventKind.NAME``)."""
    out = set()
    for root in ("ops", "recipes", "faultinject", "diagnostics", "ckpt", "monitors"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "event"
                    and node.args
                ):
                    continue
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
                elif (
                    isinstance(arg, ast.Attribute)
                    and isinstance(arg.value, ast.Name)
                    and arg.value.id == "EventKind"
                ):
                    member = EventKind.__members__.get(arg.attr)
                    out.add(str(member) if member is not None else f"EventKind.{arg.attr}")
    return out


def test_every_kind_written_in_the_tree_is_in_the_vocabulary():
    written = _literal_event_kinds()
    assert {"launch", "crash", "checkpoint", "completed"} <= written  # the scan finds the writers
    assert written <= {str(k) for k in EventKind}, written - {str(k) for k in EventKind}


def test_monitor_findings_are_events_of_the_vocabulary():
    """The supervisor writes ``Finding.to_event()`` as is: its kind and fields must be the
    vocabulary's."""
    from ptops.monitors import Finding

    for f in (
        Finding("straggler", 7, 1.6, "rank 1 slow", rank=1),
        Finding("nan", 3, float("nan"), "loss nan", "critical", 0),
    ):
        rec = {"ts": 1.0, **f.to_event()}
        assert missing_fields(rec) == [], rec
        assert ev.kind_of(rec) in ev.MONITOR_FINDING_KINDS


# ---------------------------------------------------------------- the reducer


def _e(kind: str, ts: float, **f) -> dict:
    return {"ts": ts, "kind": kind, **f}


CRASH_RESTART_COMPLETE = [
    _e("launch", 1, attempt=1, supervised=True),
    _e("checkpoint", 2, step=2, path="/r/checkpoints/step-2", blocking_s=0.1, total_s=0.2),
    _e("fault_injected", 3, fault="crash:rank=1,step=3", rank=1, step=3, attempt=1),
    _e("crash", 4, attempt=1, rank=1, exit_code=1, step=3),
    _e("restart", 5, attempt=2, from_step=2, reason="crash: rank 1 exited 1"),
    _e("launch", 6, attempt=2, supervised=True, from_step=2),
    _e("anomaly", 7, monitor="loss_spike", step=3, value=9.0, detail="spike"),
    _e("checkpoint", 8, step=4, path="/r/checkpoints/step-4", blocking_s=0.1, total_s=0.2),
    _e("completed", 9, step=4, attempt=2),
]


def test_reduce_crash_restart_complete():
    v = reduce(CRASH_RESTART_COMPLETE)
    assert v.state == RunState.COMPLETED and v.ended
    assert (v.attempt, v.launches, v.restarts) == (2, 2, 1)
    assert v.end["kind"] == "completed" and v.reason is None
    assert [f["kind"] for f in v.open_findings] == ["anomaly"]  # the crash belonged to attempt 1
    assert v.last_checkpoint["step"] == 4
    assert v.counts["launch"] == 2 and v.counts["crash"] == 1
    assert (v.first_ts, v.last_ts) == (1, 9)
    assert v.event_state == RunState.COMPLETED


def test_reduce_mid_run_and_after_a_crash():
    v = reduce(CRASH_RESTART_COMPLETE[:4])
    assert v.state == RunState.RUNNING and not v.ended and v.attempt == 1
    assert [f["kind"] for f in v.open_findings] == ["crash"]
    assert v.event_state == RunState.CRASHED
    assert reduce(CRASH_RESTART_COMPLETE[:5]).event_state == RunState.RESTARTING
    assert reduce(CRASH_RESTART_COMPLETE[:6]).event_state == RunState.RUNNING


def test_reduce_failed_then_resumed_is_running_again():
    events = [
        _e("launch", 1, attempt=1),
        _e("failed", 2, reason="crash loop"),
        _e("launch", 3, attempt=2),
    ]
    v = reduce(events)
    assert v.state == RunState.RUNNING and v.end is None and v.reason is None
    assert reduce(events[:2]).state == RunState.FAILED and reduce(events[:2]).reason == "crash loop"


def test_reduce_empty_garbage_and_unknown_kinds():
    assert reduce([]).state == RunState.NEW
    v = reduce(
        [
            {"kind": "launch", "attempt": "x"},
            "junk",
            {"no": "kind"},
            {"kind": "whatever", "ts": "nan"},
        ]
    )
    assert v.launches == 1 and v.attempt == 0 and v.state == RunState.RUNNING
    assert v.counts == {"launch": 1, "unknown": 1, "whatever": 1}
    # an end event without a launch (a supervisor that failed before launching) still ends the run
    assert reduce([_e("failed", 1, reason="bad recipe")]).state == RunState.FAILED


def test_next_state_never_reopens_an_ended_run():
    assert next_state(RunState.COMPLETED, {"kind": "crash"}) == RunState.COMPLETED
    assert next_state(RunState.COMPLETED, {"kind": "launch"}) == RunState.RUNNING
    assert next_state("running", {"kind": "checkpoint"}) == "running"
    assert next_state("running", {"kind": "stopped"}) == RunState.STOPPED


# ---------------------------------------------------------------- status on the reducer


def _run(tmp_path: Path, events: list[dict], status: dict | None = None) -> Path:
    run = RunDir(tmp_path / "run").create()
    for e in events:
        append_jsonl(run.events, e)
    append_jsonl(run.metrics, {"step": 4, "rank": 0, "loss": 1.25})
    if status is not None:
        from ptops.ops.runrecord.status import write_status

        write_status(run, status)
    return run.path


def test_status_of_a_completed_run(tmp_path):
    from ptops.ops.runrecord.status import collect

    s = collect(_run(tmp_path, CRASH_RESTART_COMPLETE))
    assert s["state"] == "completed" and s["attempt"] == 2 and s["restarts"] == 1
    assert [f["kind"] for f in s["open_findings"]] == ["anomaly"]
    assert s["step"] == 4 and s["loss"] == 1.25 and s["supervisor_pid"] is None and s["ranks"] == []


def test_status_of_a_dead_supervisor(tmp_path):
    """status.json says running, but no process holds the lock: dead, with the resume hint."""
    from ptops.ops.runrecord.status import collect

    st = {
        "state": "running",
        "attempt": 1,
        "supervisor_pid": 999999,
        "ranks": [{"rank": 0, "pid": 1, "host": "h"}],
    }
    s = collect(_run(tmp_path, CRASH_RESTART_COMPLETE[:4], st))
    assert s["state"] == "dead" and not s["supervisor_alive"] and s["supervisor_pid"] is None
    assert s["ranks"] == [] and "ptops launch --supervise" in s["hint"]
    assert [f["kind"] for f in s["open_findings"]] == ["crash"]
    json.dumps(s)  # `ptops status --json`


def test_status_of_an_unsupervised_run_without_status_json(tmp_path):
    from ptops.ops.runrecord.status import collect

    s = collect(_run(tmp_path, CRASH_RESTART_COMPLETE[:2]))
    assert s["state"].startswith("unknown")
    fresh = RunDir(tmp_path / "fresh").create()
    fresh.recipe_json.write_text(json.dumps({"name": "t", "train": {"steps": 8}}))
    s = collect(fresh.path)
    assert s["state"] == "new" and s["total_steps"] == 8 and s["open_findings"] == []


def test_status_text_is_rendered_by_the_cli(tmp_path):
    from ptops.ops.cli.status_view import render
    from ptops.ops.runrecord.status import collect

    text = render(collect(_run(tmp_path, CRASH_RESTART_COMPLETE)))
    assert (
        ": completed" in text and "restarts 1" in text and "finding" in text and "anomaly" in text
    )


def test_runrecord_imports_nothing_of_ptops():
    """The bottom layer: its own modules (relative, or ptops.ops.runrecord.*) and the stdlib
    only."""
    for path in (REPO / "ops" / "runrecord").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                mod = node.module or ""
            elif isinstance(node, ast.Import):
                mod = node.names[0].name
            else:
                continue
            assert not mod.startswith("ptops") or mod.startswith("ptops.ops.runrecord"), (
                f"{path.name} imports {mod}"
            )


def test_the_exporter_state_is_the_reducers_at_every_event():
    """Prometheus' ``ptops_run_state`` follows the vocabulary's transitions, event by event."""
    from prometheus_client.parser import text_string_to_metric_families

    from ptops.ops.obs.prometheus import PrometheusExporter

    exp = PrometheusExporter("r", nvml=False)
    seen = []
    for i, e in enumerate(CRASH_RESTART_COMPLETE):
        exp.observe_event(e)
        fam = next(
            f for f in text_string_to_metric_families(exp.text()) if f.name == "ptops_run_state"
        )
        on = [smp.labels["state"] for smp in fam.samples if smp.value == 1.0]
        assert on == [reduce(CRASH_RESTART_COMPLETE[: i + 1]).event_state], e
        seen.append(on[0])
    assert {"running", "crashed", "restarting", "completed"} <= set(seen)


def test_goodput_accounts_for_every_second_of_a_crash_and_restart():
    """Goodput = productive / wall, and where the rest went, from events and rank-0 records
    alone."""
    from ptops.ops.runrecord.goodput import account

    t = 1000.0
    events = [
        {"ts": t, "kind": "launch", "attempt": 1},
        {
            "ts": t + 10.5,
            "kind": "checkpoint",
            "rank": 0,
            "attempt": 1,
            "step": 2,
            "blocking_s": 0.5,
        },
        {"ts": t + 14.0, "kind": "crash", "attempt": 1, "rank": 1},  # last step ended at t+13
        {"ts": t + 16.0, "kind": "launch", "attempt": 2},
        {"ts": t + 30.0, "kind": "completed", "attempt": 2},
    ]
    rec = lambda step, att, end, dur=1.0: {  # noqa: E731
        "step": step,
        "rank": 0,
        "attempt": att,
        "ts": t + end,
        "step_s": dur,
    }
    records = [
        rec(1, 1, 10),
        rec(2, 1, 11),
        rec(3, 1, 13),  # startup 9 s; 1 s gap (the 0.5 s save + 0.5 s other)
        {**rec(1, 1, 10), "rank": 1},  # other ranks do not count
        rec(3, 2, 25),
        rec(4, 2, 26),
    ]  # attempt 2: startup 8 s; step 3 done again
    g = account(events, records)
    assert g["wall_s"] == 30.0 and g["productive_s"] == 4.0 and g["ratio"] == round(4 / 30, 4)
    lost = g["lost_s"]
    assert lost["startup"] == 9.0 + 8.0
    assert lost["detection"] == 1.0  # the last step's end -> the crash event
    assert lost["restart"] == 2.0  # the crash event -> the next launch
    assert lost["recomputed"] == 1.0  # step 3's first execution
    assert lost["checkpoint_blocking"] == 0.5
    assert lost["shutdown"] == 4.0  # the last step -> completed
    assert lost["other"] == 0.5
    assert g["productive_s"] + sum(lost.values()) == g["wall_s"]
    # the exporter follows the two files separately: any interleaving gives the same account
    import pytest

    from ptops.ops.runrecord.goodput import Goodput

    live = Goodput()
    for r in records:
        live.record(r)
    for e in events:
        live.event(e)
    assert live.summary()["lost_s"] == pytest.approx(lost) and live.summary()[
        "ratio"
    ] == pytest.approx(4 / 30)


def test_goodput_of_a_live_run_runs_to_now_and_an_empty_run_has_none():
    from ptops.ops.runrecord.goodput import account

    assert account([], [])["ratio"] is None
    g = account(
        [{"ts": 0.0, "kind": "launch", "attempt": 1}],
        [{"step": 1, "rank": 0, "attempt": 1, "ts": 5.0, "step_s": 1.0}],
        now=10.0,
    )
    assert g["wall_s"] == 10.0 and g["lost_s"]["startup"] == 4.0 and g["lost_s"]["other"] == 5.0


def test_the_reducer_kept_open_gives_reduce_at_every_prefix():
    """The exporter adds events one at a time: at each point its view is ``reduce`` of the prefix
    (pure: same events, same view)."""
    r = ev.Reducer()
    for i, e in enumerate(CRASH_RESTART_COMPLETE):
        r.add(e)
        assert r.view == reduce(CRASH_RESTART_COMPLETE[: i + 1])


def test_status_says_a_live_supervisor_is_behind_its_ranks(tmp_path):
    """An open inbox_behind episode of a live supervisor (it holds the lock) shows in ``ptops
    status`` and its --json; closed by inbox_caught_up, or the supervisor gone, it does not."""
    from ptops.ops.cli.status_view import render
    from ptops.ops.runrecord.lock import acquire, release
    from ptops.ops.runrecord.status import collect

    behind = {"ts": 5.0, "kind": "inbox_behind", "attempt": 1, "lag_s": 1.3, "queued": 2503}
    st = {"state": "running", "attempt": 1, "supervisor_pid": os.getpid(), "ranks": []}
    path = _run(tmp_path, [{"ts": 1.0, "kind": "launch", "attempt": 1}, behind], st)
    assert collect(path)["supervisor_behind"] is None  # no supervisor holds the run: dead
    fd = acquire(path)
    try:
        s = collect(path)
        assert s["supervisor_behind"] == {"ts": 5.0, "attempt": 1, "lag_s": 1.3, "queued": 2503}
        line = next(x for x in render(s).splitlines() if x.startswith("  supervisor:"))
        assert "behind its ranks' messages since" in line and "2503 queued" in line
        assert "SupervisorBehind" in line
        json.dumps(s)
        append_jsonl(
            RunDir(path).events,
            {"ts": 9.0, "kind": "inbox_caught_up", "attempt": 1, "behind_s": 4.0,
             "max_lag_s": 2.0, "max_queued": 9000, "why": "drained"},
        )  # fmt: skip
        s = collect(path)
        assert s["supervisor_behind"] is None and "behind" not in render(s)
    finally:
        release(fd)
