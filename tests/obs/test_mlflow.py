"""MLflow export: a run with a restart is one MLflow run holding the loss of every step;
a slow or dead MLflow never blocks the caller."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path

from conftest import TESTS

from ptops.ops.obs.mlflow_export import MlflowExporter, default_tracking_uri, flatten

DATA = TESTS / "data"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_restarted_run_is_one_mlflow_run_with_every_step(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "obs-titan"
    shutil.copytree(DATA / "obs-titan", run)
    (run / "checkpoints" / "step-8").mkdir(parents=True)
    (run / "checkpoints" / "step-8" / "ptops-manifest.json").write_text(
        '{"version": 1, "step": 8, "files": []}'
    )
    events, metrics = read(run / "events.jsonl"), read(run / "metrics.jsonl")
    cut = next(i for i, e in enumerate(events) if e["kind"] == "restart") + 1

    # attempt 1 (the supervisor that dies after the restart decision), then attempt 2 (a new
    # supervisor)
    t0 = time.monotonic()
    first = MlflowExporter(run)
    for e in events[:cut]:
        first.observe_event(e)
    for m in metrics:
        if m["attempt"] == 1:
            first.observe_metric(m)
    feed_s = time.monotonic() - t0
    assert feed_s < 0.5, f"observe_* blocked for {feed_s:.2f}s"
    assert first.close(60), first.last_error
    assert (run / "mlflow.json").exists()
    assert stat.S_IMODE(os.stat(run / "mlflow.json").st_mode) == 0o600
    second = MlflowExporter(run)
    for e in events[cut:]:
        second.observe_event(e)
    for m in metrics:
        if m["attempt"] == 2:
            second.observe_metric(m)
    assert second.close(60), second.last_error
    assert second.run_id == first.run_id
    assert first.dropped == second.dropped == 0

    from mlflow.tracking import MlflowClient

    # the store and its artifacts land inside the run directory, private like the rest of it
    store = run.resolve() / "mlflow"
    assert default_tracking_uri(run) == f"sqlite:///{store / 'mlflow.db'}"
    assert (store / "mlflow.db").exists() and stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert sorted(p.name for p in runs.iterdir()) == ["obs-titan"]  # nothing beside the run
    client = MlflowClient(tracking_uri=default_tracking_uri(run))
    exp = client.get_experiment_by_name("titan-tiny")
    found = client.search_runs([exp.experiment_id])
    assert len(found) == 1
    r = found[0]
    assert r.info.run_id == first.run_id and r.info.status == "FINISHED"
    history = client.get_metric_history(r.info.run_id, "loss")
    assert sorted({h.step for h in history}) == list(range(1, 9))
    rank0 = {(m["attempt"], m["step"]): m["loss"] for m in metrics if m["rank"] == 0}
    assert len(history) == len(rank0)  # steps 6-8 twice: attempt 1 and the redo in attempt 2
    assert {h.value for h in history if h.step == 8} == {rank0[(2, 8)]}
    assert client.get_metric_history(r.info.run_id, "tokens_per_s")
    # params: the recipe flattened
    recipe = json.loads((run / "recipe.json").read_text())
    assert r.data.params["train.steps"] == str(recipe["train"]["steps"])
    assert r.data.params["name"] == "titan-tiny"
    # tags: event counts over both attempts, last event, state
    tags = r.data.tags
    assert tags["ptops.events.launch.count"] == "2"
    assert tags["ptops.events.restart.count"] == "1"
    assert json.loads(tags["ptops.events.restart.last"])["reason"].startswith("crash")
    assert tags["ptops.state"] == "completed" and tags["ptops.attempt"] == "2"
    # artifacts: incident summary and the checkpoint manifests
    arts = {a.path for a in client.list_artifacts(r.info.run_id, "ptops")}
    assert {"ptops/incident_summary.json", "ptops/incident_summary.md", "ptops/checkpoints"} <= arts
    assert [a.path for a in client.list_artifacts(r.info.run_id, "ptops/checkpoints/step-8")] == [
        "ptops/checkpoints/step-8/ptops-manifest.json"
    ]
    assert r.info.artifact_uri.startswith((store / "mlartifacts").as_uri())
    assert list((store / "mlartifacts").rglob("incident_summary.json"))


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_dead_mlflow_never_blocks_and_drops_are_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    ex = MlflowExporter(run, tracking_uri=f"http://127.0.0.1:{_closed_port()}", queue_size=100)
    t0 = time.monotonic()
    for step in range(10000):
        ex.observe_metric({"step": step, "rank": 0, "loss": 1.0, "ts": time.time()})
    ex.observe_event({"ts": time.time(), "kind": "completed", "step": 9999})
    feed_s = time.monotonic() - t0
    assert feed_s < 1.0, f"10000 observe_metric calls took {feed_s:.2f}s"
    assert ex.dropped > 0
    t1 = time.monotonic()
    ok = ex.close(timeout=2.0)
    assert time.monotonic() - t1 < 3.0
    assert not ok  # nothing reached MLflow, and close says so instead of hanging
    assert not (run / "mlflow.json").exists()


def test_slow_mlflow_is_bounded(tmp_path, monkeypatch):
    """A store that does not answer: the caller is never slowed, close() gives up on time.

    The store answers only when the test lets it (or after 60 s): feeding and close() must both be
    over while it still has not answered, whatever the machine's load (no wall-clock bound to race).
    """
    run = tmp_path / "runs" / "r2"
    run.mkdir(parents=True)
    gate, answered = threading.Event(), threading.Event()

    def slow_connect(self):
        gate.wait(60)
        answered.set()
        raise ConnectionError("too slow")

    monkeypatch.setattr(MlflowExporter, "_connect", slow_connect)
    ex = MlflowExporter(run, queue_size=50)
    try:
        for step in range(1000):
            ex.observe_metric({"step": step, "rank": 0, "loss": 1.0})
            ex.observe_metric(
                {"step": step, "rank": 1, "loss": 1.0}
            )  # other ranks are not exported at all
        assert not answered.is_set(), "feeding waited for the store"
        assert ex.dropped == 950
        assert not ex.close(timeout=0.5)
        assert not answered.is_set(), (
            "close() waited for the store instead of giving up after its timeout"
        )
    finally:
        gate.set()


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": None}) == {
        "a.b": "1",
        "a.c.d": "x",
        "e": "[1, 2]",
        "f": "None",
    }


def test_a_new_store_is_seeded_from_the_cache_and_an_odd_cached_copy_is_rebuilt(
    tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from ptops.ops.obs.mlflow_export import seed_sqlite_store

    monkeypatch.setenv("PTOPS_CACHE", str(tmp_path / "cache"))
    first = tmp_path / "a" / "mlflow.db"
    assert seed_sqlite_store(f"sqlite:///{first}")  # builds the empty store once, then copies it
    cached = list((tmp_path / "cache" / "mlflow").glob("empty-store-*.db"))
    assert len(cached) == 1 and first.stat().st_size == cached[0].stat().st_size
    client = MlflowClient(tracking_uri=f"sqlite:///{first}")
    run = client.create_run(client.create_experiment("seeded"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=1)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 1.5
    assert not seed_sqlite_store(f"sqlite:///{first}")  # an existing store is never replaced
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 1.5}
    cached[0].write_bytes(b"not a database")  # an odd cached copy is rebuilt, never used
    second = tmp_path / "b" / "mlflow.db"
    assert seed_sqlite_store(f"sqlite:///{second}")
    names = [e.name for e in MlflowClient(tracking_uri=f"sqlite:///{second}").search_experiments()]
    assert names == ["Default"] and cached[0].read_bytes()[:15] == b"SQLite format 3"
    assert not seed_sqlite_store("http://127.0.0.1:1")  # a server store is its own


def test_ptops_mlflow_0_turns_the_export_off_and_the_flag_wins_over_it(tmp_path):
    """PTOPS_MLFLOW=0 (a CI job's or a shell's setting) keeps a launch out of MLflow; an explicit
    ``--mlflow`` still exports (the pipeline passes it to its stages for its lineage)."""
    from conftest import run_ptops

    steps = ("--set", "train.steps=2", "--set", "checkpoint.interval=2")
    off, on = tmp_path / "off" / "run", tmp_path / "on" / "run"
    env = {"PTOPS_MLFLOW": "0"}
    p = run_ptops("launch", "titan-tiny", "--supervise", "--run-dir", str(off), *steps, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (off / "mlflow.json").exists() and not (off / "mlflow").exists()
    p = run_ptops(
        "launch", "titan-tiny", "--supervise", "--run-dir", str(on), *steps, "--mlflow", env=env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (on / "mlflow.json").exists() and (on / "mlflow" / "mlflow.db").exists()
    assert sorted(p.name for p in on.parent.iterdir()) == ["run"]  # nothing beside the run dir


def test_a_pipelines_default_store_is_inside_the_pipeline_dir_and_its_stages_share_it(tmp_path):
    """Issue 47: a pipeline's directory is its run directory: one store inside it, the stages' runs
    (below it) nested in that store; nothing lands beside it."""
    from mlflow.tracking import MlflowClient

    from ptops.ops.pipeline.lineage import Lineage

    pipe = tmp_path / "runs" / "pipe"
    stage = pipe / "stages" / "01-sft"
    stage.mkdir(parents=True)
    lineage = Lineage(pipe, "pipe")
    assert lineage.error is None
    store = pipe.resolve() / "mlflow"
    assert lineage.uri == f"sqlite:///{store / 'mlflow.db'}"
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    child = lineage.child("sft", 0, stage, {"name": "sft"}, None, None)
    assert json.loads((stage / "mlflow.json").read_text())["tracking_uri"] == lineage.uri
    client = MlflowClient(tracking_uri=lineage.uri)
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == lineage.parent
    assert run.info.artifact_uri.startswith((store / "mlartifacts").as_uri())
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["pipe"]
