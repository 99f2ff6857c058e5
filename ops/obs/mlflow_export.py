"""MLflow exporter: one MLflow run per ptops run directory, continued across restarts.

``MlflowExporter(run_dir, tracking_uri=None)`` is fed like the Prometheus
exporter (``observe_event`` / ``observe_metric``). All MLflow work happens in a
background thread behind a bounded queue: when MLflow is slow or down the queue
fills and new records are dropped and counted (``dropped``), never blocking the
caller. ``close(timeout)`` flushes what it can in ``timeout`` seconds.

What lands in MLflow:
- params: the recipe (``recipe.json``) flattened to dotted keys (first attempt only;
  MLflow params are immutable);
- metrics: every key of each rank-0 ``metrics.jsonl`` record at its ``step``
  (a restart that redoes steps logs them again: MLflow keeps both values);
- tags: ``ptops.state``, ``ptops.attempt``, ``ptops.events.<kind>.count`` and
  ``ptops.events.<kind>.last`` (the latest event as JSON);
- artifacts at a terminal event (``completed``/``failed``/``stopped``) or close:
  ``ptops/incident_summary.json`` and ``.md``, and the checkpoint manifests
  (``checkpoints/*/ptops-manifest.json``) under ``ptops/checkpoints/``.

The MLflow run id is stored in ``RUN_DIR/mlflow.json`` so a restarted supervisor
(or an offline ``ptops export``) continues the same MLflow run. The default
tracking URI is ``sqlite:///<run dir>/mlflow/mlflow.db``, with the artifacts in
``<run dir>/mlflow/mlartifacts/``: everything of a run lands in its run directory (private, 0700).
An explicit tracking URI wins; a SQLite one keeps its artifacts in ``mlartifacts/`` beside its file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from ptops.ops.obs.queued import FINALIZE as _FINALIZE
from ptops.ops.obs.queued import STOP as _STOP
from ptops.ops.obs.queued import QueuedExporter
from ptops.ops.runrecord.events import SUMMARY_KINDS, EventKind, Reducer, reduce
from ptops.ops.runrecord.jsonl import read_jsonl

log = logging.getLogger("ptops.exporters.mlflow")

# end event kind (END_KINDS) -> MLflow run status
TERMINAL = {
    EventKind.COMPLETED: "FINISHED",
    EventKind.FAILED: "FAILED",
    EventKind.STOPPED: "KILLED",
}
SKIP_METRIC_KEYS = {"step", "rank", "attempt", "ts"}
MAX_BATCH_METRICS = 1000  # MLflow log_batch limit


def _quiet_third_party_loggers() -> None:
    """MLflow's INFO lines ("Creating initial MLflow database tables...") and alembic's migration
    notes would land in the middle of the launch's progress output (stderr): keep warnings only.
    Call after ``import mlflow`` (its import sets these loggers up)."""
    for name in ("mlflow", "alembic", "sqlalchemy"):
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)


STORE_DIR = "mlflow"  # the default store's folder inside the run (or pipeline) directory


def default_tracking_uri(run_dir: str | Path) -> str:
    """``sqlite:///<run dir>/mlflow/mlflow.db``: the store of one run lands inside it."""
    return f"sqlite:///{Path(run_dir).resolve() / STORE_DIR / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Where an experiment created in a SQLite store keeps its artifacts: ``mlartifacts/`` beside
    the database file (inside the run directory for the default store); None for a server store
    (the server decides)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()


def seed_sqlite_store(uri: str) -> bool:
    """A new SQLite store starts as a copy of an empty one MLflow made and migrated once, kept in
    the cache per MLflow version: creating and migrating the tables costs ~3 CPU-s at every first
    launch in a folder (bench/README.md). Never replaces a store that exists or appears meanwhile;
    a cached copy that does not look like an MLflow store is rebuilt, not used. True when it
    seeded ``uri``."""
    if not uri.startswith("sqlite:///"):
        return False
    target = Path(uri[len("sqlite:///") :])
    if target.exists():
        return False
    import mlflow

    from ptops.ops.runrecord.cache import cache_root

    empty = cache_root() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    if not _looks_like_a_store(empty):
        from mlflow.tracking import MlflowClient

        empty.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own: MLflow keeps one store per URI for the life of the process
        tmp = empty.with_name(f".{empty.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # creates, migrates
        os.replace(tmp, empty)
    # private like the rest of the run directory (the default store's folder is new in it)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(empty, tmp)
        os.link(tmp, target)  # fails if the store appeared meanwhile: that one is kept
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _looks_like_a_store(path: Path) -> bool:
    import sqlite3

    if not path.is_file():
        return False
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            version = db.execute("SELECT version_num FROM alembic_version").fetchone()
            db.execute("SELECT experiment_id FROM experiments LIMIT 1").fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return False
    return bool(version and version[0])


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() in ("nan", "inf", "+inf", "-inf"):
        return float(v.strip().lower())
    return None


def _metric_key(k: str) -> str:
    # MLflow allows alphanumerics, _ - . space / ; keep the adapter's names
    return "".join(c if (c.isalnum() or c in "_-./ ") else "_" for c in str(k))[:250]


class MlflowExporter(QueuedExporter):
    def __init__(
        self,
        run_dir: str | Path,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        queue_size: int = 10000,
        flush_interval_s: float = 1.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        self.experiment = experiment
        self.flush_interval_s = flush_interval_s
        self.logged_metrics = 0
        self.run_id: str | None = None
        self._reducer = Reducer()  # the one reading of events (ops/runrecord/events.py)
        self._earlier_counts: dict[str, int] = {}  # event counts of earlier exporter processes
        self._finalized = False
        self._ready = threading.Event()
        super().__init__(queue_size, "ptops-mlflow")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the MLflow run exists (the background thread connected)."""
        return self._ready.wait(timeout) and self.run_id is not None

    # ------------------------------------------------------------------ background thread

    def _main(self) -> None:
        try:
            self._client = self._connect()
        except (
            Exception
        ) as e:  # MLflow down/misconfigured: drain and count, never raise into training
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("MLflow export disabled for %s: %s", self.run_dir, self.last_error)
            self._ready.set()
            self._drain_forever()
            return
        self._ready.set()
        pending_metrics: list = []
        pending_tags: dict[str, str] = {}
        last_flush = time.monotonic()
        stop = False
        while not stop:
            try:
                item = self._q.get(timeout=self.flush_interval_s)
            except queue.Empty:
                item = None
            finalize = False
            while item is not None:
                if item is _STOP:
                    stop = True
                elif item is _FINALIZE:
                    finalize = True
                else:
                    kind, rec = item
                    if kind == "metric":
                        pending_metrics.extend(self._metrics_of(rec))
                    else:
                        pending_tags.update(self._tags_of(rec))
                if stop or len(pending_metrics) >= MAX_BATCH_METRICS:
                    break
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    item = None
            if pending_metrics or pending_tags:
                if (
                    stop
                    or finalize
                    or len(pending_metrics) >= MAX_BATCH_METRICS
                    or time.monotonic() - last_flush >= self.flush_interval_s
                ):
                    self._flush(pending_metrics, pending_tags)
                    pending_metrics, pending_tags = [], {}
                    last_flush = time.monotonic()
            if finalize or stop:
                self._flush(pending_metrics, pending_tags)
                pending_metrics, pending_tags = [], {}
                self._finalize(terminal=finalize)

    def _drain_forever(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return

    def _connect(self):
        from mlflow.tracking import MlflowClient

        _quiet_third_party_loggers()
        seed_sqlite_store(self.tracking_uri)
        client = MlflowClient(tracking_uri=self.tracking_uri)
        state_file = self.run_dir / "mlflow.json"
        stored = None
        try:
            stored = json.loads(state_file.read_text())
        except (OSError, ValueError):
            stored = None
        if stored and stored.get("tracking_uri") == self.tracking_uri and stored.get("run_id"):
            try:
                run = client.get_run(stored["run_id"])
                self.run_id = run.info.run_id
                for k, v in run.data.tags.items():  # continue the event counts of earlier attempts
                    if k.startswith("ptops.events.") and k.endswith(".count"):
                        try:
                            kind = k[len("ptops.events.") : -len(".count")]
                            self._earlier_counts[kind] = int(v)
                        except ValueError:
                            pass
                if run.info.status != "RUNNING":
                    client.update_run(self.run_id, status="RUNNING")
                return client
            except Exception as e:
                log.warning(
                    "stored MLflow run %s not found (%s); starting a new one",
                    stored.get("run_id"),
                    e,
                )
        recipe = self._recipe()
        name = self.experiment or recipe.get("name") or "ptops"
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                exp_id = client.create_experiment(
                    name, artifact_location=artifact_location(self.tracking_uri)
                )
            except Exception:  # created meanwhile by another process
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        run = client.create_run(
            exp_id,
            run_name=self.run_dir.name,
            tags={
                "ptops.run_dir": str(self.run_dir.resolve()),
                "ptops.recipe": str(recipe.get("name", "")),
                "ptops.engine": str(recipe.get("engine", "")),
            },
        )
        self.run_id = run.info.run_id
        tmp = state_file.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {"run_id": self.run_id, "experiment_id": exp_id, "tracking_uri": self.tracking_uri},
                f,
            )
        os.replace(tmp, state_file)
        params = flatten(recipe)
        if params:
            from mlflow.entities import Param

            items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                client.log_batch(self.run_id, params=items[i : i + 100])
        return client

    def _metrics_of(self, rec: Mapping[str, Any]) -> list:
        from mlflow.entities import Metric

        try:
            step = int(rec.get("step"))
        except (TypeError, ValueError):
            return []
        ts = rec.get("ts")
        ts_ms = int((ts if isinstance(ts, (int, float)) else time.time()) * 1000)
        out = []
        for k, v in rec.items():
            if k in SKIP_METRIC_KEYS:
                continue
            f = _num(v)
            if f is None:
                continue
            out.append(Metric(_metric_key(k), f, ts_ms, step))
        return out

    def _tags_of(self, ev: Mapping[str, Any]) -> dict[str, str]:
        kind = str(ev.get("kind") or "unknown")
        v = self._reducer.view
        had = v.state_events
        self._reducer.add(ev)
        n = self._earlier_counts.get(kind, 0) + v.counts[kind]
        tags = {
            f"ptops.events.{kind}.count": str(n),
            f"ptops.events.{kind}.last": json.dumps(ev, default=str)[:4000],
        }
        if kind == EventKind.LAUNCH and ev.get("attempt") is not None:
            tags["ptops.attempt"] = str(ev["attempt"])
        if v.state_events > had and v.event_state is not None:  # this event carried a state
            tags["ptops.state"] = str(v.event_state)
        return tags

    def _flush(self, metrics: list, tags: dict[str, str]) -> None:
        if not metrics and not tags:
            return
        from mlflow.entities import RunTag

        try:
            tag_items = [RunTag(k, v) for k, v in tags.items()]
            for i in range(0, max(len(metrics), 1), MAX_BATCH_METRICS):
                self._client.log_batch(
                    self.run_id,
                    metrics=metrics[i : i + MAX_BATCH_METRICS],
                    tags=tag_items if i == 0 else [],
                )
            self.logged_metrics += len(metrics)
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning(
                "MLflow log_batch failed (%d metrics lost): %s", len(metrics), self.last_error
            )

    def _finalize(self, terminal: bool) -> None:
        if self._finalized:
            return
        events = list(read_jsonl(self.run_dir / "events.jsonl"))
        try:
            summary = incident_summary(events)
            self._client.log_dict(self.run_id, summary, "ptops/incident_summary.json")
            self._client.log_text(
                self.run_id, summary_markdown(summary), "ptops/incident_summary.md"
            )
            for manifest in sorted((self.run_dir / "checkpoints").glob("*/ptops-manifest.json")):
                self._client.log_artifact(
                    self.run_id, str(manifest), f"ptops/checkpoints/{manifest.parent.name}"
                )
            if terminal:
                end = reduce(events).end
                status = TERMINAL.get((end or {}).get("kind"), "FINISHED")
                self._client.set_terminated(self.run_id, status=status)
                self._finalized = True
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("MLflow finalize failed: %s", self.last_error)


def incident_summary(events: list[dict]) -> dict:
    view = reduce(events)
    return {
        "state": (view.end or {}).get("kind", "running"),
        "attempts": view.launches,
        "event_counts": view.counts,
        "last_good_checkpoint": view.last_checkpoint,
        "incidents": [e for e in events if e.get("kind") in SUMMARY_KINDS][-500:],
    }


def summary_markdown(s: dict) -> str:
    lines = [
        "# ptops incident summary",
        "",
        f"- final state: **{s['state']}**",
        f"- attempts: {s['attempts']}",
    ]
    ck = s.get("last_good_checkpoint")
    lines.append(
        f"- last good checkpoint: step {ck.get('step')} ({ck.get('path')})"
        if ck
        else "- no checkpoint"
    )
    lines += ["", "| time (UTC) | kind | details |", "|---|---|---|"]
    for e in s["incidents"]:
        ts = e.get("ts")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
            if isinstance(ts, (int, float)) and math.isfinite(ts)
            else "?"
        )
        details = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("ts", "kind"))
        lines.append(f"| {when} | {e.get('kind')} | {details} |")
    return "\n".join(lines) + "\n"
