"""``ptops profile`` of a live titan-tiny run names the rank a ``slow`` fault slows (issue 15, point
4).

No race with the run's end: every rank is held before step 4 until the profile request is
recorded (the supervisor picks its start step past the held ranks), then released; the run
has 16 steps and the window ends several steps before the last. Profiling records and never
computes: the run ends with the same checkpoint digest as the uninterrupted reference run.
"""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

from conftest import PTOPS, REPO, run_ptops
from faulted import STEPS


def _events(run: Path, kind: str) -> list[dict]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [
        e
        for e in (json.loads(x) for x in path.read_text().splitlines() if x.strip())
        if e["kind"] == kind
    ]


def _wait(pred, what: str, proc: subprocess.Popen, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(
                f"{proc.args[2:4]} exited {proc.returncode} while waiting for {what}:\n"
                f"{proc.stderr.read() if proc.stderr else ''}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_profile_of_a_live_run_names_the_slow_rank(tmp_path, faulted_runs):
    from ptops.ckpt import digest

    run = tmp_path / "run"
    launch = subprocess.Popen(
        [
            *PTOPS,
            "launch",
            "titan-tiny",
            "--supervise",
            "--run-dir",
            str(run),
            *STEPS,
            "--no-mlflow",
            "--json",
            "--fault",
            "slow:rank=1,step=3,seconds=0.5,steps=40",
            "--fault",
            "hold:step=4",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prof = None
    try:
        _wait(
            lambda: (
                len([e for e in _events(run, "fault_injected") if e["fault"].startswith("hold")])
                == 2
            ),
            "both ranks held before step 4",
            launch,
        )
        # ptops diagnose on this live run (held, so it is still going when read): incidents so far,
        # a note
        live = run_ptops("diagnose", str(run), "--json")
        assert live.returncode == 0, live.stderr
        rep = json.loads(live.stdout)
        assert any("still going" in n for n in rep["notes"]) and rep["incidents"] == [], rep[
            "notes"
        ]
        assert rep["goodput"]["wall_s"] > 0 and 1 <= rep["last_step"] <= 3  # held before step 4
        prof = subprocess.Popen(
            [*PTOPS, "profile", str(run), "--steps", "4", "--json"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait(lambda: _events(run, "profile_requested"), "the profile request", prof)
        req = _events(run, "profile_requested")[0]
        assert req["ranks"] == [0, 1] and req["steps"] == 4 and req["start_step"] > 4, req
        rel = run_ptops("inject", str(run), "release")
        assert rel.returncode == 0, rel.stderr
        out, err = prof.communicate(timeout=300)
        assert prof.returncode == 0, err
        l_out, l_err = launch.communicate(timeout=300)
    finally:
        for p in (prof, launch):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert out.strip(), err
    report = json.loads(out)
    from ptops.diagnostics.profile import render

    seen = f"{render(report)}\n--- ptops profile stderr:\n{err}"  # what a failure shows
    assert report["slow_rank"] == 1, seen
    assert report["slow_part"] == "compute" and report["peers_wait_in"], seen
    assert report["verdict"].startswith("rank 1 is the slow rank: +"), seen
    assert report["steps"] == list(range(req["start_step"], req["start_step"] + 4)), seen
    fast, slow = report["per_rank"]
    # the 0.5 s sleep each step: rank 1's time outside collectives, rank 0's time waiting in them,
    # less what the shared machine's scheduler adds (a rank starved of CPU for a while is slower
    # too, and measured so)
    assert (
        report["excess_s"] > 0.2
        and fast["waiting_s"] > 0.2
        and slow["waiting_s"] < fast["waiting_s"]
    ), seen
    assert f"captured steps {req['start_step']}..{req['start_step'] + 3}" in err, seen
    # the traces and the summary are in the run directory, private like the rest of it
    folder = run / "profiles" / req["id"]
    assert (
        stat.S_IMODE((run / "profiles").stat().st_mode) == 0o700
        and stat.S_IMODE(folder.stat().st_mode) == 0o700
    )
    for name in ("rank-0.json", "rank-1.json", "summary.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    captured = _events(run, "profile_captured")
    assert sorted(e["rank"] for e in captured) == [0, 1] and not _events(run, "profile_failed")
    assert all(
        e["id"] == req["id"] and e["first_step"] == req["start_step"] and e["steps"] == 4
        for e in captured
    )
    # no restart, and the same training math as the uninterrupted reference run
    assert launch.returncode == 0, l_err
    summary = json.loads(l_out)
    assert summary["state"] == "completed" and summary["restarts"] == 0, summary
    ref = faulted_runs.get("reference")
    assert ref.proc.returncode == 0, ref.proc.stderr
    assert digest(run / "checkpoints" / "step-16") == digest(ref.run / "checkpoints" / "step-16")
