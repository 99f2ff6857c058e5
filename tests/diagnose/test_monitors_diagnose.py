"""``ptops diagnose`` on synthetic run directories: expected findings, runbooks, timeline, exit
codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import synth  # tests/data/traces (pytest's pythonpath)
from conftest import REPO, TESTS

from ptops.diagnostics.diagnose import RUNBOOKS, diagnose

TRACES = TESTS / "data" / "traces"

T0 = 1_800_000_000.0


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(tmp_path: Path, recipe: dict | None = None, live_nan: bool = True) -> Path:
    """Attempt 1: NaN at step 30 (the live supervisor saw it too) and rank 1 straggling from step
    50, crash of rank 1 at step 60; attempt 2 resumes from step 40 and completes 80 steps."""
    run = tmp_path / "run"
    run.mkdir()
    a1 = [dict(r) for r in synth.pretrain(steps=60, seed=5, inject="straggler_wait", at=50)]
    for r in a1:
        r["ts"] = T0 + r["step"]
        if r["step"] == 30:
            r["loss"] = "nan"
    a2 = [
        dict(r, attempt=2, ts=T0 + 100 + r["step"])
        for r in synth.pretrain(steps=80, seed=6)
        if r["step"] > 40
    ]
    _write(run / "metrics.jsonl", a1 + a2)
    ev = [
        {"ts": T0, "kind": "launch", "attempt": 1},
        {
            "ts": T0 + 20.5,
            "kind": "checkpoint",
            "step": 20,
            "path": "checkpoints/step-20",
            "blocking_s": 0.1,
            "total_s": 0.4,
        },
        {
            "ts": T0 + 40.5,
            "kind": "checkpoint",
            "step": 40,
            "path": "checkpoints/step-40",
            "blocking_s": 0.1,
            "total_s": 0.4,
        },
        {"ts": T0 + 60.5, "kind": "crash", "attempt": 1, "rank": 1, "exit_code": -9},
        {
            "ts": T0 + 61,
            "kind": "checkpoint_invalid",
            "path": "checkpoints/step-60",
            "reason": "missing __1_0.distcp",
        },
        {"ts": T0 + 62, "kind": "restart", "attempt": 2, "from_step": 40, "reason": "crash"},
        {"ts": T0 + 100, "kind": "launch", "attempt": 2},
        {"ts": T0 + 181, "kind": "completed", "step": 80},
    ]
    if live_nan:
        ev.insert(
            2,
            {
                "ts": T0 + 30.1,
                "kind": "anomaly",
                "monitor": "nan",
                "step": 30,
                "value": "nan",
                "detail": "loss is nan",
            },
        )
    ev.sort(key=lambda e: e["ts"])
    _write(run / "events.jsonl", ev)
    if recipe is not None:
        (run / "recipe.json").write_text(json.dumps(recipe))
    return run


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ptops.ops.cli.diagnose", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ),
    )


def test_json_lists_expected_findings(tmp_path):
    run = make_run(tmp_path, recipe={"name": "synthetic", "engine": "titan"})
    p = _cli(str(run), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert set(rep) >= {"run_dir", "findings", "events_summary", "timeline"}
    assert rep["recipe"] == "synthetic" and rep["config"] == "defaults" and rep["ranks"] == [0, 1]
    got = {(f["monitor"], f["step"], f["rank"], f["source"]) for f in rep["findings"]}
    assert ("nan", 30, 0, "replay") in got
    assert ("crash", None, 1, "event") in got
    assert ("checkpoint_invalid", None, None, "event") in got
    strag = [f for f in rep["findings"] if f["monitor"] == "straggler"]
    assert len(strag) == 1 and strag[0]["rank"] == 1 and 50 <= strag[0]["step"] <= 53
    nan = next(f for f in rep["findings"] if f["monitor"] == "nan")
    assert nan["live"] is True and nan["value"] == "nan" and nan["runbook"] == "TrainingNaN"
    books = {f["monitor"]: f["runbook"] for f in rep["findings"]}
    assert books["straggler"] == "StragglerRank" and books["crash"] == "TrainingCrashLoop"
    assert books["checkpoint_invalid"] == "CheckpointCorrupt"
    assert len(rep["findings"]) == 4
    s = rep["events_summary"]
    assert s["state"] == "completed" and s["attempts"] == 2 and s["restarts"] == 1
    assert s["last_checkpoint_step"] == 40 and s["crashes"][0]["rank"] == 1
    # the timeline is ordered in time and interleaves findings with events
    kinds = [t["kind"] for t in rep["timeline"]]
    assert (
        kinds.index("finding:nan")
        < kinds.index("finding:straggler")
        < kinds.index("crash")
        < kinds.index("restart")
    )
    ts = [t["ts"] for t in rep["timeline"]]
    assert ts == sorted(ts)
    # attempt 2 redid steps 41-60 healthily: nothing more found
    assert all(f["attempt"] in (1, None) for f in rep["findings"])


def test_live_only_findings_are_kept(tmp_path):
    run = make_run(tmp_path, recipe={"name": "x", "monitors": {"nan": {"enabled": False}}})
    rep = diagnose(run)
    assert rep["config"] == "recipe.json"
    nan = [f for f in rep["findings"] if f["monitor"] == "nan"]
    assert (
        len(nan) == 1
        and nan[0]["source"] == "event"
        and nan[0]["live"] is True
        and nan[0]["runbook"] == "TrainingNaN"
    )


def test_recipe_monitors_config_is_used(tmp_path):
    run = make_run(
        tmp_path, recipe={"name": "x", "monitors": {"straggler": {"margin": 100.0}}}, live_nan=False
    )
    rep = diagnose(run)
    assert not [f for f in rep["findings"] if f["monitor"] == "straggler"]


def test_human_output(tmp_path):
    run = make_run(tmp_path)
    p = _cli(str(run))
    assert p.returncode == 0, p.stderr
    for word in (
        "TrainingNaN",
        "StragglerRank",
        "TrainingCrashLoop",
        "CheckpointCorrupt",
        "completed",
        "Timeline",
    ):
        assert word in p.stdout, word


def test_missing_run_dir_exit_2_one_line(tmp_path):
    p = _cli(str(tmp_path / "nope"), "--json")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "nope" in p.stderr


def test_not_a_run_dir_exit_2(tmp_path):
    p = _cli(str(tmp_path))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "metrics.jsonl" in p.stderr


def test_bad_monitors_section_exit_2(tmp_path):
    run = make_run(
        tmp_path, recipe={"name": "x", "monitors": {"loss_spike": {"z_threshold": "high"}}}
    )
    p = _cli(str(run))
    assert (
        p.returncode == 2
        and "monitors.loss_spike.z_threshold" in p.stderr
        and p.stderr.count("\n") == 1
    )


def test_events_only_run(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    _write(
        run / "events.jsonl",
        [
            {"ts": T0, "kind": "launch", "attempt": 1},
            {"ts": T0 + 5, "kind": "hang", "attempt": 1, "ranks": [0], "step": 0, "silent_s": 600},
            {"ts": T0 + 6, "kind": "failed", "reason": "hang: rank 0 silent"},
        ],
    )
    rep = diagnose(run)
    assert any("metrics.jsonl" in n for n in rep["notes"])
    got = {(f["monitor"], f["runbook"]) for f in rep["findings"]}
    assert ("hang", "TrainingHang") in got and ("failed", "TrainingHang") in got
    assert rep["events_summary"]["state"] == "failed"


def test_a_hangs_also_quiet_ranks_are_evidence_not_blame(tmp_path):
    """The hang event's ``also_quiet`` (quiet when the budget ran out, silent for less than the
    named ranks) is a line of evidence; the incident's ranks stay the named ones."""
    run = tmp_path / "r"
    run.mkdir()
    _write(
        run / "events.jsonl",
        [
            {"ts": T0, "kind": "launch", "attempt": 1},
            {
                "ts": T0 + 5,
                "kind": "hang",
                "attempt": 1,
                "ranks": list(range(8, 16)),
                "step": 6,
                "silent_s": 10.5,
                "why": "unresponsive",
                "also_quiet": list(range(16, 24)),
            },
        ],
    )
    (hang,) = [i for i in diagnose(run)["incidents"] if i["kind"] == "hang"]
    assert hang["ranks"] == list(range(8, 16)) and "rank(s) 8-15 silent" in hang["title"]
    assert "also quiet, not named (silent for less): rank(s) 16-23" in hang["evidence"]


def test_healthy_recorded_run_has_no_findings(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text((TRACES / "trl-grpo-tiny-100-s1.jsonl").read_text())
    rep = diagnose(run)
    assert rep["findings"] == []


def test_every_runbook_diagnose_names_is_a_file():
    """Each monitor and incident kind diagnose links resolves to runbooks/<Name>.md (all sources:
    test_runbooks.py)."""
    from ptops.monitors import MONITOR_NAMES

    assert set(MONITOR_NAMES) <= set(RUNBOOKS)
    missing = sorted(
        {rb for rb in RUNBOOKS.values() if not (REPO / "runbooks" / f"{rb}.md").is_file()}
    )
    assert not missing, f"diagnose links runbooks with no file: {missing}"


def test_ptops_diagnose_help_teaches_and_the_cli_behaves_like_the_module():
    p = subprocess.run(
        [sys.executable, "-m", "ptops", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0 and "diagnose" in p.stdout
    h = subprocess.run(
        [sys.executable, "-m", "ptops", "diagnose", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb"),
    )
    assert h.returncode == 0, h.stderr
    text = " ".join(h.stdout.split())
    # what it takes, how to get JSON, and what it prints
    for words in (
        "RUN_DIR",
        "--json",
        "findings",
        "runbook",
        "timeline",
        "events_summary",
        "exit 2",
    ):
        assert words.lower() in text.lower(), (
            f"`ptops diagnose --help` does not say {words!r}:\n{h.stdout}"
        )
    q = subprocess.run(
        [sys.executable, "-m", "ptops", "diagnose", "/nonexistent/run", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert (
        q.returncode == 2
        and q.stdout == ""
        and q.stderr.strip().startswith("error:")
        and q.stderr.count("\n") == 1
    )


def _rotated_copy(tmp_path):
    """A recorded run and a copy of it whose metrics went through the writer rotating every 3 KB."""
    import shutil

    from ptops.ops.runrecord.metrics import MetricsWriter
    from ptops.ops.runrecord.rundir import RunDir

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain = make_run(tmp_path / "a")
    rotated = tmp_path / "b" / "run"
    shutil.copytree(plain, rotated)
    (rotated / "metrics.jsonl").unlink()
    w = MetricsWriter(rotated, rotate_bytes=3000)
    for r in RunDir(plain).read_metrics():
        w.append(r)
    w.close()
    return plain, rotated


def test_a_rotated_run_diagnoses_as_the_same_run_unrotated(tmp_path):
    """The metrics in ``metrics/`` segments (the supervisor's writer at a tiny limit) give the
    same report, baselines included, as one ``metrics.jsonl``: diagnose streams every segment in
    order."""
    from ptops.ops.runrecord.metrics import segments
    from ptops.ops.runrecord.rundir import RunDir

    plain, rotated = _rotated_copy(tmp_path)
    assert (
        len(segments(rotated)) > 3
        and RunDir(rotated).read_metrics() == RunDir(plain).read_metrics()
    )
    a = json.dumps(diagnose(plain, baselines=[plain]), sort_keys=True).replace(str(plain), "RUN")
    b = json.dumps(diagnose(rotated, baselines=[plain]), sort_keys=True)
    assert a == b.replace(str(rotated), "RUN").replace(str(plain), "RUN")
    assert '"crash"' in a and '"nan"' in a


def test_a_rotated_run_replays_its_last_records_and_counts_the_rest_from_the_index(
    tmp_path, monkeypatch
):
    """Without --full a rotated run's monitors replay its last WINDOW_BYTES (seconds at any size);
    the whole-run numbers still come out exact (the index), the NaN of attempt 1 (an older
    segment) is still an incident through its live finding, and --full is the unrotated report."""
    import ptops.diagnostics.diagnose as dg

    monkeypatch.setattr(dg, "WINDOW_BYTES", 6000)

    from ptops.ops.runrecord.metrics import segments

    plain, rotated = _rotated_copy(tmp_path)
    segs = segments(rotated)
    a, b = diagnose(plain), diagnose(rotated)
    for k in ("metrics_records", "last_step", "goodput", "events_summary"):
        assert a[k] == b[k], k
    assert any("replayed the run's last" in n for n in b["notes"])
    assert b["findings"] != a["findings"]  # the window's replay is not the whole run's
    assert len(segs) > 3
    nan = [i for i in b["incidents"] if i["kind"] == "numeric"]
    assert nan and nan[0]["step"] == 30
    # the loss around it comes from the index's rank 0 records
    assert [e for e in nan[0]["evidence"] if e.startswith("around it (rank 0)")] == [
        e
        for e in next(i for i in a["incidents"] if i["kind"] == "numeric")["evidence"]
        if e.startswith("around it (rank 0)")
    ]
    full = json.dumps(diagnose(rotated, full=True), sort_keys=True).replace(str(rotated), "RUN")
    assert full == json.dumps(a, sort_keys=True).replace(str(plain), "RUN")
