"""W&B export, offline, read back from the files W&B wrote: a real crashed-and-restarted titan-tiny
run (the session's shared ``faulted_runs`` crash run) is one W&B run holding every step's loss, its
incidents as alerts and a table, its checkpoints as artifact references; a rerun of the export
continues it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_ptops
from wandb_records import items, of_type, records

from ptops.ops.obs.wandb_export import WandbExporter, run_id_for
from ptops.ops.runrecord.follow import feed


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def exported(faulted_runs, tmp_path_factory):
    """The crash run copied (the shared one stays as it is), exported the way a live launch and a
    later ``ptops export`` do it: attempt 1's exporter dies right after the restart decision; then
    ``ptops export --once --wandb`` of the finished directory; then the same command once more."""
    src = faulted_runs.get("crash").run
    run = tmp_path_factory.mktemp("wandb") / "crash-run"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("wandb", "wandb.json"))
    events, metrics = read(run / "events.jsonl"), read(run / "metrics.jsonl")
    restart_ts = next(e["ts"] for e in events if e["kind"] == "restart")
    cwd_before = set(os.listdir(Path.cwd()))

    first = WandbExporter(run)
    feed(
        [first],
        [e for e in events if e["ts"] <= restart_ts],
        [m for m in metrics if m["attempt"] == 1],
    )
    assert first.close(90), first.last_error
    assert first.dropped == 0
    after_first = offline_runs(run)

    env = {"HOME": str(run.parent / "home")}  # no W&B login anywhere: offline must not need one
    second = run_ptops("export", str(run), "--once", "--wandb", env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    after_second = offline_runs(run)
    third = run_ptops("export", str(run), "--once", "--wandb", env=env, timeout=300)
    assert third.returncode == 0, third.stderr
    return {
        "run": run,
        "events": events,
        "metrics": metrics,
        "first": first,
        "second": second,
        "after_first": after_first,
        "after_second": after_second,
        "after_third": offline_runs(run),
        "cwd_new": set(os.listdir(Path.cwd())) - cwd_before,
    }


def test_one_wandb_run_continued_not_duplicated(exported):
    run = exported["run"]
    state = json.loads((run / "wandb.json").read_text())
    assert state["run_id"] == exported["first"].run_id == run_id_for(run)
    assert run_id_for(run) == run_id_for(
        str(run) + "/"
    )  # the same directory, however it is spelled
    assert len(exported["after_first"]) == 1
    assert len(exported["after_second"]) == 2  # the rerun resumed: a second piece of the same run
    assert (
        exported["after_third"] == exported["after_second"]
    )  # nothing new: nothing written at all
    for folder in exported["after_second"]:
        wandb_files = list(folder.glob("*.wandb"))
        assert [f.name for f in wandb_files] == [f"run-{state['run_id']}.wandb"]
        (rec,) = of_type(records(wandb_files[0]), "run")
        assert rec.run_id == state["run_id"] and rec.project == "titan-tiny" and rec.resume
        assert json.loads(next(u.value_json for u in rec.config.update if u.key == "ptops"))[
            "run_dir"
        ] == str(run.resolve())
    assert f"W&B run {state['run_id']}" in exported["second"].stderr
    assert not exported["cwd_new"], f"W&B wrote into the working directory: {exported['cwd_new']}"


def test_every_step_loss_once_with_its_attempt(exported):
    rows = []
    for folder in exported["after_second"]:
        recs = records(next(folder.glob("*.wandb")))
        rows += [items(h) for h in of_type(recs, "history")]
    steps = [r for r in rows if "loss" in r]
    rank0 = [m for m in exported["metrics"] if m["rank"] == 0]
    # one history row per rank-0 record, in order, none twice (the rerun skipped what attempt 1
    # wrote)
    assert [(r["attempt"], r["step"]) for r in steps] == [(m["attempt"], m["step"]) for m in rank0]
    assert [r["loss"] for r in steps] == [m["loss"] for m in rank0]
    assert [r["grad_norm"] for r in steps] == [m["grad_norm"] for m in rank0]
    assert {r["attempt"] for r in steps} == {1, 2}
    assert sorted({r["step"] for r in steps}) == list(range(1, 17))
    wsteps = [r["_step"] for r in rows]
    assert wsteps == list(range(len(rows)))  # W&B's own step never goes back, across both pieces


def test_incidents_alerts_table_and_summary(exported):
    events = exported["events"]
    folders = exported["after_second"]
    recs = [r for f in folders for r in records(next(f.glob("*.wandb")))]
    alerts = of_type(recs, "alert")
    crashes = [e for e in events if e["kind"] == "crash"]
    assert crashes
    crash_alerts = [a for a in alerts if ": crash" in a.title]
    assert len(crash_alerts) == len(crashes) and all(a.level == "ERROR" for a in crash_alerts)
    assert json.loads(crash_alerts[0].text)["exit_code"] == crashes[0]["exit_code"]
    restart_alerts = [a for a in alerts if ": restart" in a.title]
    assert len(restart_alerts) == len([e for e in events if e["kind"] == "restart"]) == 1
    assert "attempt 2" in restart_alerts[0].title

    # the incident table of the last piece: every incident of the whole run, read from its file
    last = records(next(folders[-1].glob("*.wandb")))
    table_rows = [
        items(h) for h in of_type(last, "history") if any("ptops/incidents" in k for k in items(h))
    ]
    assert len(table_rows) == 1
    table = json.loads((folders[-1] / "files" / table_rows[0]["ptops/incidents/path"]).read_text())
    kinds = [row[table["columns"].index("kind")] for row in table["data"]]
    assert kinds.count("crash") == len(crashes) and kinds.count("restart") == 1
    assert "fault_injected" in kinds

    summary: dict = {}
    for s in of_type(last, "summary"):
        summary.update(items(s))
    assert summary["ptops/state"] == "completed"
    assert summary["ptops/attempts"] == 2
    assert (
        summary["ptops/events/launch/count"] == 2
    )  # counts carried over from attempt 1's exporter
    exits = of_type(last, "exit")
    assert [e.exit_code for e in exits] == [0]


def test_checkpoints_are_artifact_references(exported):
    run, events = exported["run"], exported["events"]
    recs = [r for f in exported["after_second"] for r in records(next(f.glob("*.wandb")))]
    arts = [a for a in of_type(recs, "artifact") if a.type == "model"]
    # the events name the original run directory's checkpoints: the copy's own are the ones to point
    # at; retention has removed the oldest by now: an export after the fact points only at what is
    # on disk
    ckpts = [
        e
        for e in events
        if e["kind"] == "checkpoint" and (run / "checkpoints" / Path(e["path"]).name).exists()
    ]
    assert len(ckpts) >= 2 and any(Path(e["path"]).is_absolute() for e in ckpts)
    assert [json.loads(a.metadata)["step"] for a in arts] == [e["step"] for e in ckpts]
    run_id = json.loads((run / "wandb.json").read_text())["run_id"]
    for art, ev in zip(arts, ckpts):
        assert art.name == f"ckpt-{run_id}"
        assert f"step-{ev['step']}" in art.aliases
        ckpt_dir = (run / "checkpoints" / Path(ev["path"]).name).resolve()
        files = sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file())
        assert files, ckpt_dir
        refs = sorted(c.ref for c in art.manifest.contents)
        assert refs == sorted((ckpt_dir / f).as_uri() for f in files)
        assert all(not c.local_path for c in art.manifest.contents)  # a reference: nothing copied


def test_online_without_credentials_fails_without_prompting(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    ex = WandbExporter(run, project="p", mode="online")
    ex.observe_metric({"step": 1, "rank": 0, "loss": 1.0})
    assert not ex.close(30)
    assert "no W&B credentials" in (ex.last_error or "")
    assert not (run / "wandb").exists()


def test_help_says_where_offline_files_go(ptops):
    for cmd in ("launch", "export"):
        out = ptops(cmd, "--help")
        assert out.returncode == 0
        text = " ".join(out.stdout.split())
        assert "--wandb" in text and "RUN_DIR/wandb" in text and "wandb sync" in text, text
