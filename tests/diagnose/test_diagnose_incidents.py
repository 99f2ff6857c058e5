"""``ptops diagnose`` incidents on real faulted runs (tests/faulted.py), flight-recorder dumps from
real gloo ranks, --attempt/--since, copied and live run directories, and --baseline on real
titan-tiny runs."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_ptops

from ptops.diagnostics import baseline, crash, flightrec, stacks
from ptops.diagnostics.diagnose import DiagnoseError, parse_since

INCIDENT_KEYS = {
    "id",
    "kind",
    "title",
    "severity",
    "ts",
    "ts_end",
    "attempt",
    "step",
    "rank",
    "ranks",
    "ranks_text",
    "host",
    "evidence",
    "runbook",
    "action",
    "details",
}


def _json(run: Path, *args: str) -> dict:
    p = run_ptops("diagnose", str(run), "--json", *args, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert {
        "run_dir",
        "findings",
        "events_summary",
        "timeline",
        "notes",
        "incidents",
        "filters",
    } <= set(rep)
    for i in rep["incidents"]:
        assert set(i) == INCIDENT_KEYS, sorted(i)
        assert i["severity"] in ("critical", "warning", "info") and isinstance(i["evidence"], list)
    assert [i["id"] for i in rep["incidents"]] == list(range(1, len(rep["incidents"]) + 1))
    return rep


def _one(rep: dict, kind: str, **where) -> dict:
    got = [
        i
        for i in rep["incidents"]
        if i["kind"] == kind and all(i[k] == v for k, v in where.items())
    ]
    assert len(got) == 1, (kind, where, [(i["kind"], i["title"]) for i in rep["incidents"]])
    return got[0]


# --- real faulted runs ----------------------------------------------------------------------------


def test_crash_in_words_with_the_dead_rank_log(faulted_runs):
    run = faulted_runs.get("crash").run
    rep = _json(run)
    inc = _one(rep, "crash")
    assert inc["rank"] == 1 and inc["attempt"] == 1 and inc["runbook"] == "TrainingCrashLoop"
    assert "SIGKILL" in inc["title"] and inc["details"]["signal"] == 9
    # the fault_injected event tells this SIGKILL apart from the OOM killer's
    assert "injected fault" in inc["details"]["cause"] and "crash:rank=1" in inc["details"]["cause"]
    assert inc["action"] == "restarted as attempt 2 from step 10"
    assert 1 <= len(inc["details"]["last_lines"]) <= 10 and any(
        "crash" in ln for ln in inc["details"]["last_lines"]
    )
    human = run_ptops("diagnose", str(run))
    assert human.returncode == 0 and human.stdout.index("incident(s)") < human.stdout.index(
        "finding"
    )
    # goodput: the same account as ptops status (ops/runrecord/goodput.py), the crash's cost named
    good = rep["goodput"]
    assert (
        0 < good["ratio"] < 1 and good["lost_s"]["detection"] > 0 and good["lost_s"]["restart"] > 0
    )
    assert "goodput:" in human.stdout


def test_sigstop_hang_odd_rank_named_from_its_stack(faulted_runs):
    run = faulted_runs.get("hang").run
    rep = _json(run)
    a1, a2 = _one(rep, "hang", attempt=1), _one(rep, "hang", attempt=2)
    # attempt 1: rank 0 hangs in Python (the _hang injector); rank 1 waits in the collective
    assert (
        a1["rank"] == 0
        and "stuck in sleep (faultinject/inject.py:" in a1["title"]
        and " in _hang, from " in a1["title"]
        and a1["runbook"] == "TrainingHang"
    )
    groups = {tuple(g["ranks"]): g for g in a1["details"]["stacks"]["groups"]}
    assert groups[(1,)]["in_collective"] and not groups[(0,)]["in_collective"]
    assert groups[(1,)]["place"] == "collective" and groups[(0,)]["place"] == "sleep"
    assert "while the others wait in a collective" in a1["title"]
    # attempt 2: rank 1 SIGSTOPped while held, read by py-spy from outside
    assert a2["rank"] == 1 and "(faultinject/inject.py:" in a2["title"]
    assert " in _hold, from " in a2["title"]
    assert any(
        "py-spy" in s
        for g in a2["details"]["stacks"]["groups"]
        for s in g["sources"]
        if 1 in g["ranks"]
    )
    assert a1["action"].startswith("restarted as attempt 2") and a2["action"].startswith(
        "restarted as attempt 3"
    )
    # gloo's flight recorder (TORCH_FR_BUFFER_SIZE set by the supervisor), analysed by torch's
    # tooling: both ranks answered in attempt 1, rank 0 never joined the collective rank 1 waits in
    fr = a1["details"]["flight_recorder"]
    assert fr is not None and fr["ranks"] == [0, 1] and "error" not in fr, fr
    assert any(m["missing_ranks"] == [0] for m in fr["mismatches"]), fr
    assert any("flight recorder" in e and "rank(s) 0 never joined" in e for e in a1["evidence"])
    only2 = _json(run, "--attempt", "2")
    assert [i["attempt"] for i in only2["incidents"]] == [2] and only2["filters"]["attempt"] == 2
    assert all(f["attempt"] == 2 for f in only2["findings"])


def test_nan_numeric_incident_with_context_and_rollback(faulted_runs):
    rep = _json(faulted_runs.get("nan").run)
    inc = _one(rep, "numeric")
    assert inc["step"] == 12 and inc["runbook"] == "TrainingNaN" and inc["attempt"] == 1
    assert (
        inc["action"].startswith("rolled back from step 12 to step 10")
        and "lr x0.5" in inc["action"]
    )
    ctx = {c["step"]: c for c in inc["details"]["context"]}
    assert (
        11 in ctx and isinstance(ctx[11]["loss"], float) and isinstance(ctx[11]["grad_norm"], float)
    )
    assert ctx[12]["loss"] == "nan"


def test_straggler_incident(faulted_runs):
    rep = _json(faulted_runs.get("straggler").run)
    inc = _one(rep, "straggler")
    assert (
        inc["rank"] == 1
        and inc["runbook"] == "StragglerRank"
        and inc["severity"] in ("warning", "critical")
    )
    assert inc["action"] and "exclude" in inc["action"]


def test_corrupt_checkpoint_then_crash(faulted_runs):
    rep = _json(faulted_runs.get("corrupt").run)
    ck = _one(rep, "checkpoint")
    assert ck["step"] == 8 and ck["runbook"] == "CheckpointCorrupt" and ck["severity"] == "critical"
    assert "from step 4" in (ck["action"] or ""), ck
    cr = _one(rep, "crash")
    assert cr["rank"] == 1 and cr["runbook"] == "TrainingCrashLoop"


def test_copied_run_dir_reads_the_copy(faulted_runs, tmp_path):
    """A run directory copied elsewhere: everything is read relative to it (the hang event's
    absolute ``stacks`` path points at the original, which must not be used)."""
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(faulted_runs.get("hang").run, copy)
    (copy / "stacks" / "attempt-2" / "rank-1.txt").write_text(
        "# no stack: rank unreachable (pid 1 on far)\n"
    )
    rep = _json(copy)
    a2 = _one(rep, "hang", attempt=2)
    assert any(
        "rank unreachable" in (g["note"] or "") for g in a2["details"]["stacks"]["groups"]
    ), a2
    assert "_hang" in _one(rep, "hang", attempt=1)["title"]


def test_live_run_incidents_so_far(faulted_runs, tmp_path):
    """A run still going (no end event, status running): the crash is an incident; no action yet."""
    live = tmp_path / "live"
    shutil.copytree(faulted_runs.get("crash").run, live)
    events = [json.loads(x) for x in (live / "events.jsonl").read_text().splitlines() if x.strip()]
    cut = next(n for n, e in enumerate(events) if e["kind"] == "crash") + 1
    (live / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events[:cut]))
    st = json.loads((live / "status.json").read_text())
    (live / "status.json").write_text(json.dumps(dict(st, state="running")))
    rep = _json(live)
    inc = _one(rep, "crash")
    assert inc["rank"] == 1 and inc["action"] is None
    assert any("still going" in n for n in rep["notes"])


def test_a_supervisor_behind_its_inbox_is_noted_with_its_worst_lag(faulted_runs, tmp_path):
    """The hang run, its supervisor made to have fallen behind twice (the second episode still
    open at the end, one field garbled as a copied run directory may have it): diagnose says so
    in a note (how often, the worst lag, the longest episode) and lists the episodes in the
    timeline with the runbook; the hang incident itself is unchanged."""
    run = tmp_path / "run"
    shutil.copytree(faulted_runs.get("hang").run, run)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    at = next(n for n, e in enumerate(events) if e["kind"] == "launch") + 1
    ts = events[at - 1]["ts"]
    extra = [
        {"ts": ts + 1, "kind": "inbox_behind", "attempt": 1, "lag_s": 1.4, "queued": 300},
        {"ts": ts + 4, "kind": "inbox_caught_up", "attempt": 1, "behind_s": 3.0,
         "max_lag_s": 2.6, "max_queued": 900, "why": "drained"},
        {"ts": ts + 5, "kind": "inbox_behind", "attempt": 1, "lag_s": "nan?", "queued": 2},
    ]  # fmt: skip
    events[at:at] = extra
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rep = _json(run)
    (note,) = [n for n in rep["notes"] if "fell behind" in n]
    assert "2 time(s)" in note and "worst lag 2.6 s" in note and "longest 3.0 s" in note
    assert "1 not closed" in note and "SupervisorBehind" in note
    rows = [t for t in rep["timeline"] if t["kind"].startswith("inbox_")]
    assert [t["kind"] for t in rows] == ["inbox_behind", "inbox_caught_up", "inbox_behind"]
    assert {t["runbook"] for t in rows} == {"SupervisorBehind"}
    before = _json(faulted_runs.get("hang").run)["incidents"]
    assert [(i["kind"], i["title"]) for i in rep["incidents"]] == [
        (i["kind"], i["title"]) for i in before
    ]


def test_since_filters_and_bad_values(faulted_runs):
    run = faulted_runs.get("hang").run
    rep = _json(run)
    t2 = _one(rep, "hang", attempt=2)["ts"]
    later = _json(run, "--since", str(t2 - 0.001))
    assert [i["attempt"] for i in later["incidents"]] == [2]
    assert all(t["ts"] >= t2 - 0.001 for t in later["timeline"])
    for args in (("--since", "yesterday"), ("--attempt", "9"), ("--attempt", "0")):
        p = run_ptops("diagnose", str(run), *args)
        assert (
            p.returncode == 2
            and p.stdout == ""
            and p.stderr.startswith("error: ")
            and p.stderr.count("\n") == 1
        ), (args, p.stderr)


# --- units on real artefacts ----------------------------------------------------------------------


def test_parse_since():
    assert parse_since("10m", now=1000.0) == 400.0 and parse_since("2h", now=10_000.0) == 2800.0
    assert parse_since("2026-11-30T13:00:00+00:00") == 1796043600.0
    with pytest.raises(DiagnoseError):
        parse_since("soon")


def test_signal_words_and_python_oom(tmp_path):
    assert (
        crash.signal_words(-9)[0].startswith("killed by SIGKILL")
        and crash.signal_words(137)[1] == 9
    )
    assert crash.signal_words(1) == ("exited with code 1", None)
    log = tmp_path / "logs" / "attempt-1" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        'step 3\nTraceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB\n"
    )
    info = crash.explain(tmp_path, {"attempt": 1, "rank": 0, "exit_code": 1}, [], same_host=False)
    assert (
        info["exception"]["type"] == "torch.OutOfMemoryError"
        and "GPU memory exhausted (CUDA OOM)" in info["patterns"]
    )
    assert info["cause"].startswith("out of memory in Python")
    # a SIGKILL nobody can explain from a copied run dir is said to be unknown
    unk = crash.explain(tmp_path, {"attempt": 1, "rank": 5, "exit_code": -9}, [], same_host=False)
    assert unk["cause"].startswith("cause unknown") and unk["checked"]


def test_stack_formats_group_the_same_place():
    chan = textwrap.dedent("""\
        # source: channel (the rank's own dump)
        Thread 0x7f "MainThread" (most recent call last):
          File "/a/site-packages/torchtitan/trainer.py", line 1039, in train
            self.train_step(data_iterator)
          File "/w/x/faultinject/inject.py", line 212, in _hold
            cond.wait(timeout)
          File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 331, in wait
            gotit = waiter.acquire(True, timeout)
        """)
    spy = textwrap.dedent("""\
        # source: py-spy dump --nonblocking
        Process 1: python
        Thread 27059 (idle): "MainThread"
            Condition.wait (threading.py:327)
                Arguments:
                    self: <Condition at 0x7fa>
            Injector._hold (faultinject/inject.py:210)
            train (torchtitan/trainer.py:1039)
        Thread 27060 (idle): "other"
            run (threading.py:1)
        """)
    a, b = stacks.parse(chan, 0), stacks.parse(spy, 1)
    assert (
        a.key == b.key and str(a.top) == "_hold (faultinject/inject.py:212)" and b.state == "idle"
    )


def test_flight_recorder_from_real_gloo_ranks(tmp_path):
    """Two real gloo ranks with TORCH_FR_BUFFER_SIZE; rank 0 issues one more all_reduce than rank 1:
    torch's analyser (through diagnostics.flightrec) names rank 1 as missing from collective #4."""
    script = tmp_path / "fr.py"
    script.write_text(
        textwrap.dedent(f'''\
        import os, sys, time
        import torch, torch.distributed as dist
        from ptops.ops.rank.probe import flight_recorder_dump
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=rank, world_size=2)
        t = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(t)
        if rank == 0:
            dist.all_reduce(t, async_op=True)
        data = flight_recorder_dump()
        open("{tmp_path}/rank-%d.flight_recorder" % rank, "wb").write(data)
        time.sleep(1.5)
        os._exit(0)
        ''')  # noqa: E501
    )
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r)], env=env, cwd=REPO) for r in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    out = flightrec.analyse(tmp_path)
    assert out["ranks"] == [0, 1] and "error" not in out, out
    assert out["mismatches"][0]["missing_ranks"] == [1] and out["mismatches"][0]["seq"] == 4
    assert out["last"]["0"]["seq"] == 4 and out["last"]["1"]["seq"] == 3
    assert "collective #4 gloo:all_reduce: rank(s) 1 never joined" in out["summary"]


def test_flight_recorder_dump_locations_and_no_code_from_pickles(tmp_path):
    import pickle
    import time

    stacks_dir, traces = tmp_path / "stacks" / "attempt-2", tmp_path / "titan" / "comm_traces"
    stacks_dir.mkdir(parents=True)
    traces.mkdir(parents=True)
    (traces / "rank_0").write_bytes(b"old")
    os.utime(traces / "rank_0", (1000, 1000))  # written by an earlier attempt
    (traces / "rank_1").write_bytes(b"new")
    assert {
        r: p.name for r, p in flightrec.dumps(stacks_dir, traces, after_ts=time.time() - 60).items()
    } == {1: "rank_1"}
    (stacks_dir / "rank-0.flight_recorder").write_bytes(
        pickle.dumps({"entries": [], "where": Path("/x")})
    )
    assert set(flightrec.dumps(stacks_dir, traces)) == {0}  # the stack folder's dumps win
    out = flightrec.analyse(stacks_dir, world=2)
    assert "refused" in out["error"] and "pathlib" in out["error"]


# --- baseline -------------------------------------------------------------------------------------


def _synth(seed: int, steps: int = 60, lr_scale: float = 1.0, ranks: int = 2) -> list[dict]:
    rng = random.Random(seed)
    off = rng.gauss(0, 0.01)
    out = []
    for s in range(1, steps + 1):
        base = 2.0 + 4.0 * math.exp(-0.05 * s * lr_scale) + off
        for r in range(ranks):
            out.append(
                {
                    "step": s,
                    "rank": r,
                    "loss": base + rng.gauss(0, 0.03),
                    "grad_norm": 0.5 + rng.gauss(0, 0.02),
                    "lr": 1e-3 * lr_scale,
                }
            )
    return out


def test_baseline_synthetic_seed_noise_vs_lr_change():
    ref = _synth(1)
    same = baseline.compare(_synth(2), {"ref": ref})
    assert same["compared"] == ["loss", "grad_norm"] and not same["diverged"], same
    fast = baseline.compare(_synth(3, lr_scale=2.0), {"ref": ref})
    assert fast["diverged"] and fast["per_metric"]["loss"]["diverged"]
    assert (
        1 <= fast["first_divergent_step"] <= 15 and not fast["per_metric"]["grad_norm"]["diverged"]
    )
    # several baselines: their spread is the noise
    multi = baseline.compare(_synth(4), {"a": ref, "b": _synth(5), "c": _synth(6)})
    assert not multi["diverged"] and multi["per_metric"]["loss"]["noise_method"].startswith(
        "spread of 3"
    )


def test_baseline_edge_cases():
    ref = _synth(1, steps=4)
    short = baseline.compare(_synth(2, steps=4), {"ref": ref})
    assert not short["diverged"] and "too few" in short["per_metric"]["loss"]["note"]
    rl = [{"step": s, "rank": 0, "reward": 0.1 * s} for s in range(1, 30)]
    assert baseline.compare(_synth(2), {"ref": rl})["compared"] == []
    # non-finite values and a resumed run's redone steps: the last record of a step counts, NaN is
    # skipped
    run = _synth(2) + [
        {"step": 10, "rank": 0, "loss": "nan"},
        {"step": 10, "rank": 1, "loss": float("nan")},
    ]
    c = baseline.curves(run)
    assert 10 not in c["loss"] and 11 in c["loss"]
    # a late divergence is found at its step, not before; one baseline allows 15 % of its movement
    # for seed drift (a +0.5 shift after a 3.5 drop is within it), three baselines measure the noise
    # (it is not)
    late = [dict(r, loss=r["loss"] + (0.0 if r["step"] < 40 else 0.5)) for r in _synth(2)]
    one = baseline.compare(late, {"ref": _synth(1)})
    assert not one["diverged"] and "15%" in one["per_metric"]["loss"]["noise_method"]
    three = baseline.compare(late, {"a": _synth(1), "b": _synth(5), "c": _synth(6)})
    assert three["diverged"] and three["first_divergent_step"] == 40, three["per_metric"]["loss"]
    big = [dict(r, loss=r["loss"] + (0.0 if r["step"] < 40 else 3.0)) for r in _synth(2)]
    res = baseline.compare(big, {"ref": _synth(1)})
    assert res["diverged"] and res["first_divergent_step"] == 40


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory, faulted_runs):
    """titan-tiny, 16 steps: the reference (the faulted runs' uninterrupted one: seed 42; its
    supervision and checkpoint interval change no loss), a second seed, a 5x learning rate."""
    root = tmp_path_factory.mktemp("baseline")
    runs = {"ref": faulted_runs.get("reference").run}
    for name, key in (("seed", "train.seed=7"), ("lr", "titan.lr=0.015")):
        p = run_ptops(
            "launch",
            "titan-tiny",
            "--run-dir",
            str(root / name),
            "--set",
            "train.steps=16",
            "--set",
            key,
            "--no-mlflow",
            "--json",
            timeout=900,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        runs[name] = root / name
    return runs


def test_baseline_lr_change_diverges_second_seed_does_not(seed_runs):
    lr = _json(seed_runs["lr"], "--baseline", str(seed_runs["ref"]))
    b = lr["baseline"]
    assert (
        b["run_dir"] == str(seed_runs["ref"])
        and "loss" in b["compared"]
        and "grad_norm" in b["compared"]
    )
    assert b["diverged"] is True and isinstance(b["first_divergent_step"], int), b
    seed = _json(seed_runs["seed"], "--baseline", str(seed_runs["ref"]))["baseline"]
    assert seed["diverged"] is False and seed["first_divergent_step"] is None, seed
    human = run_ptops("diagnose", str(seed_runs["lr"]), "--baseline", str(seed_runs["ref"]))
    assert human.returncode == 0 and "DIVERGES from step" in human.stdout
    bad = run_ptops("diagnose", str(seed_runs["lr"]), "--baseline", str(seed_runs["ref"] / "nope"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


# --- synthetic run directories: every incident kind, one incident per episode ---------------------


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_synthetic_kinds_and_episodes(tmp_path):
    import synth

    T0 = 1_800_000_000.0
    a1 = [
        dict(r, ts=T0 + r["step"], attempt=1)
        for r in synth.grpo(steps=120, seed=3, inject="entropy_collapse", at=40)
    ]
    for r in a1:
        if r["step"] in (20, 21):
            r["loss"] = "nan"
    _write(tmp_path / "metrics.jsonl", a1)
    _write(
        tmp_path / "events.jsonl",
        [
            {"ts": T0, "kind": "launch", "attempt": 1, "nproc": 2},
            {
                "ts": T0 + 21.5,
                "kind": "rollback",
                "from_step": 21,
                "to_step": 15,
                "reason": "nan",
                "lr_scale": 0.5,
            },
            {
                "ts": T0 + 60,
                "kind": "checkpoint_failed",
                "step": 60,
                "path": "checkpoints/step-60",
                "error": "ENOSPC",
                "final": False,
            },
            {
                "ts": T0 + 121,
                "kind": "fault_injected",
                "fault": "preempt:step=120",
                "rank": 0,
                "step": 120,
                "attempt": 1,
            },
            {
                "ts": T0 + 122,
                "kind": "stopped",
                "attempt": 1,
                "signal": 15,
                "step": 120,
                "reason": "interrupted by SIGTERM",
            },
            {"ts": T0 + 130, "kind": "launch", "attempt": 2, "nproc": 2},
            {"ts": T0 + 140, "kind": "early_exit", "attempt": 2, "step": 125},
            {"ts": T0 + 141, "kind": "failed", "reason": "early exit"},
        ],
    )
    rep = _json(tmp_path)
    kinds = [i["kind"] for i in rep["incidents"]]
    num = _one(rep, "numeric")  # NaN at 20 and 21: one episode
    assert (
        num["step"] == 20
        and num["details"]["last_step"] in (20, 21)
        and num["action"].startswith("rolled back from step 21 to step 15")
    )
    rl = [i for i in rep["incidents"] if i["kind"] == "rl"]
    assert rl and all(
        i["runbook"] == "EntropyCollapse"
        for i in rl
        if i["details"]["monitor"] == "entropy_collapse"
    )
    assert len([i for i in rl if i["details"]["monitor"] == "entropy_collapse"]) == 1
    ck = _one(rep, "checkpoint")
    assert (
        ck["severity"] == "warning"
        and ck["runbook"] == "CheckpointSaveFailing"
        and ck["step"] == 60
    )
    pre = _one(rep, "preempt")
    assert pre["attempt"] == 1 and "SIGTERM" in pre["evidence"][0]
    ee = _one(rep, "crash", attempt=2)
    assert "before the last step" in ee["title"] and ee["runbook"] == "TrainingCrashLoop"
    assert "failed" not in kinds  # the failure ends attempt 2, already told as its early exit
    ts = [i["ts"] for i in rep["incidents"]]
    assert ts == sorted(ts)
    only1 = _json(tmp_path, "--attempt", "1")
    assert {i["attempt"] for i in only1["incidents"]} == {1}
