"""Weights & Biases exporter: one W&B run per ptops run directory, continued across restarts and
reruns.

``WandbExporter(run_dir, project=None, entity=None, mode="offline")`` is fed like the MLflow
exporter (``observe_event`` / ``observe_metric``, from the same follower). All W&B work happens in a
background thread behind a bounded queue: a slow or broken W&B fills the queue and new records are
dropped and counted (``dropped``), never blocking the caller. ``close(timeout)`` flushes what it can
in time.

What lands in W&B:
- config: the recipe (``recipe.json``) and the run directory;
- history: one row per rank-0 ``metrics.jsonl`` record (rank 0 only, as MLflow): its numeric keys
  plus ``step`` (the training step) and ``attempt``. ``step`` is the x-axis of every chart
  (``define_metric``); W&B's own ``_step`` only counts rows, because a restart redoes steps and W&B
  steps may not go back (the redone rows keep both values, as in MLflow);
- alerts (``run.alert``): each incident (an event kind with a severity), finding, restart and
  rollback; offline they are kept in the run's ``.wandb`` file;
- summary: ``ptops/state``, ``ptops/attempt``, ``ptops/events/<kind>/count``,
  ``ptops/last_checkpoint``;
- at the end (or close): the table ``ptops/incidents`` (every event of the incident summary, read
  from the run directory like MLflow's ``incident_summary``);
- checkpoints: each ``checkpoint`` event is a version of the artifact ``ckpt-<run id>`` (type
  ``model``, aliases ``step-N`` and ``latest``) holding *references* (``file://``) to the
  checkpoint's files: no copy and no read of the weights (``checksum=False``).

Files go under ``RUN_DIR/wandb/`` (offline: ``offline-run-*/run-<id>.wandb``; ``wandb sync`` uploads
them). ``RUN_DIR/wandb.json`` keeps the W&B run id (derived from the run directory's path) and, per
destination, how many events and rank-0 metric records were exported: every attempt's exporter and
every ``ptops export --wandb`` rerun resumes the same run (``resume="allow"``) and logs only what is
new. Offline mode never touches the network; online mode never prompts for a login (no credentials:
an error).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ptops.ops.obs.mlflow_export import SKIP_METRIC_KEYS, _num, incident_summary
from ptops.ops.obs.queued import FINALIZE as _FINALIZE
from ptops.ops.obs.queued import STOP as _STOP
from ptops.ops.obs.queued import QueuedExporter
from ptops.ops.runrecord.events import EventKind, spec
from ptops.ops.runrecord.jsonl import read_jsonl

log = logging.getLogger("ptops.exporters.wandb")

# kinds that raise an alert besides incidents and findings (EventSpec.severity / .finding)
ALERT_KINDS = {EventKind.RESTART, EventKind.ROLLBACK}
INCIDENT_COLUMNS = ["time_utc", "ts", "attempt", "kind", "step", "rank", "severity", "detail"]


def run_id_for(run_dir: str | Path) -> str:
    """A W&B run id that the same run directory always gets: its name and a hash of its path."""
    path = Path(run_dir).resolve()
    name = re.sub(r"[^A-Za-z0-9_-]", "-", path.name)[:40].strip("-") or "run"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


def mode_for(project: str | None, entity: str | None) -> str:
    """Offline unless the user named a project or entity (and ``WANDB_MODE`` does not say
    offline)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return "offline"
    return "online" if (project or entity) else "offline"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


class WandbExporter(QueuedExporter):
    close_timeout_s = 30.0

    def __init__(
        self,
        run_dir: str | Path,
        project: str | None = None,
        entity: str | None = None,
        mode: str = "offline",
        *,
        queue_size: int = 10000,
    ) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"W&B mode must be offline or online, not {mode!r}")
        self.run_dir = Path(run_dir)
        self.recipe = self._recipe()
        self.project = project or str(self.recipe.get("name") or "ptops")
        self.entity = entity
        self.mode = mode
        self.dest = "offline" if mode == "offline" else f"online:{entity or ''}/{self.project}"
        self.logged_rows = 0
        self.run_id: str | None = None
        self._run = None
        super().__init__(queue_size, "ptops-wandb")

    # ------------------------------------------------------------------ state (RUN_DIR/wandb.json)

    def _load_state(self) -> dict:
        try:
            st = json.loads((self.run_dir / "wandb.json").read_text())
            return st if isinstance(st, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        self._state["destinations"][self.dest] = self._cursor
        _write_json(self.run_dir / "wandb.json", self._state)

    # ------------------------------------------------------------------ background thread

    def _main(self) -> None:
        self._state = self._load_state()
        self.run_id = self._state.get("run_id") or run_id_for(self.run_dir)
        self._state.setdefault("run_id", self.run_id)
        self._state.setdefault("destinations", {})
        c = self._state["destinations"].get(self.dest) or {}
        # what earlier exporters of this destination already wrote: skip it, go on after it
        self._cursor = {
            "events": int(c.get("events", 0)),
            "metrics": int(c.get("metrics", 0)),
            "next_step": int(c.get("next_step", 0)),
            "finalized_events": c.get("finalized_events"),
            "project": self.project,
            "entity": self.entity,
        }
        self._seen = {"events": 0, "metrics": 0}
        self._counts: dict[str, int] = dict(c.get("counts", {}))
        self._dirty = False
        failed = False
        while True:
            item = self._q.get()
            if item is _STOP:
                if not failed:
                    self._guard(self._finalize, terminal=False)
                    self._guard(self._finish)
                return
            if failed:
                continue
            if item is _FINALIZE:
                ok = self._guard(self._finalize, terminal=True)
            else:
                kind, rec = item
                ok = self._guard(self._metric if kind == "metric" else self._event, rec)
            if not ok and self._run is None:
                failed = True  # could not start the W&B run: drain, never raise into training

    def _guard(self, fn, *args, **kw) -> bool:
        try:
            fn(*args, **kw)
            return True
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("W&B export of %s: %s", self.run_dir, self.last_error)
            return False

    def _ensure_run(self):
        if self._run is not None:
            return self._run
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        if self.mode == "online":
            self._check_credentials(wandb)
        settings = wandb.Settings(
            mode=self.mode,
            silent=True,
            console="off",
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
            allow_offline_artifacts=True,
        )
        wandb_dir = self.run_dir / "wandb"
        wandb_dir.mkdir(mode=0o700, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=self.run_id,
            resume="allow",
            name=self.run_dir.name,
            dir=str(self.run_dir),
            settings=settings,
            job_type="train",
            reinit="create_new",
            config={"ptops": {"run_dir": str(self.run_dir.resolve()), "recipe": self.recipe}},
            allow_val_change=True,
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step", step_sync=True)
        self._state["project"], self._state["entity"] = self.project, self.entity
        self._save_state()
        return self._run

    def _check_credentials(self, wandb) -> None:
        """Online without a key would prompt on the terminal: fail with one line instead."""
        if os.environ.get("WANDB_API_KEY"):
            return
        try:
            from wandb.sdk.lib.wbauth import authenticate_session

            auth = authenticate_session(
                host=wandb.Settings().base_url, source="ptops", prompt=False
            )
        except ImportError:
            return  # another wandb: let init decide
        if auth is None:
            raise RuntimeError(
                "no W&B credentials: set WANDB_API_KEY or run `wandb login` "
                "(or export offline and `wandb sync` later)"
            )

    def _metric(self, rec: dict) -> None:
        self._seen["metrics"] += 1
        if self._seen["metrics"] <= self._cursor["metrics"]:
            return
        try:
            step = int(rec.get("step"))
        except (TypeError, ValueError):
            step = None
        row: dict[str, Any] = {}
        for k, v in rec.items():
            if k in SKIP_METRIC_KEYS:
                continue
            f = _num(v)
            if f is not None:
                row[str(k)] = f
        if step is not None:
            row["step"] = step
            if rec.get("attempt") is not None:
                row["attempt"] = rec["attempt"]
            run = self._ensure_run()
            run.log(row, step=self._cursor["next_step"])
            self._cursor["next_step"] += 1
            self.logged_rows += 1
        self._cursor["metrics"] = self._seen["metrics"]
        self._dirty = True
        if self.logged_rows % 50 == 0:
            self._save_state()

    def _event(self, ev: dict) -> None:
        self._seen["events"] += 1
        if self._seen["events"] <= self._cursor["events"]:
            return
        run = self._ensure_run()
        kind = str(ev.get("kind") or "unknown")
        self._counts[kind] = self._counts.get(kind, 0) + 1
        upd: dict[str, Any] = {f"ptops/events/{kind}/count": self._counts[kind]}
        sp = spec(kind)
        if sp is not None and sp.state is not None:
            upd["ptops/state"] = str(sp.state)
        if kind == EventKind.LAUNCH and ev.get("attempt") is not None:
            upd["ptops/attempt"] = ev["attempt"]
        if kind == EventKind.CHECKPOINT:
            upd["ptops/last_checkpoint"] = {"step": ev.get("step"), "path": ev.get("path")}
            self._checkpoint(run, ev)
        run.summary.update(upd)
        if (sp is not None and (sp.severity or sp.finding)) or kind in ALERT_KINDS:
            self._alert(run, ev, sp.severity if sp is not None else None)
        self._cursor["events"] = self._seen["events"]
        self._cursor["counts"] = self._counts
        self._dirty = True
        self._save_state()

    def _alert(self, run, ev: dict, severity: str | None) -> None:
        import wandb

        kind = ev.get("kind")
        # the event's own severity (a monitor finding's; "info" for an all-clear), else its kind's
        level = {"critical": wandb.AlertLevel.ERROR, "warning": wandb.AlertLevel.WARN}.get(
            str(ev.get("severity") or severity or "warning"), wandb.AlertLevel.INFO
        )
        where = ", ".join(
            f"{k} {ev[k]}" for k in ("attempt", "step", "rank") if ev.get(k) is not None
        )
        details = {k: v for k, v in ev.items() if k not in ("ts", "kind")}
        run.alert(
            title=f"ptops {self.run_dir.name}: {kind}" + (f" ({where})" if where else ""),
            text=json.dumps(details, default=str)[:3000],
            level=level,
        )

    def _checkpoint(self, run, ev: dict) -> None:
        import wandb

        path = self._checkpoint_path(ev.get("path"))
        if path is None:
            log.info("checkpoint %s is no longer on disk: no artifact", ev.get("path"))
            return  # retention removed it before this export: nothing to point at
        keys = ("step", "attempt", "blocking_s", "total_s", "mode")
        meta = {k: ev.get(k) for k in keys if ev.get(k) is not None}
        meta["path"] = str(path)
        manifest = path / "ptops-manifest.json"
        if manifest.is_file():
            meta["ptops_manifest_sha256"] = hashlib.sha256(manifest.read_bytes()).hexdigest()
        art = wandb.Artifact(f"ckpt-{self.run_id}", type="model", metadata=meta)
        art.add_reference(path.as_uri(), name=path.name, checksum=False)
        aliases = ["latest"] + ([f"step-{ev['step']}"] if ev.get("step") is not None else [])
        run.log_artifact(art, aliases=aliases)

    def _checkpoint_path(self, recorded: Any) -> Path | None:
        """Where the checkpoint is now: the rank records absolute paths, and a run directory that
        was moved or copied since holds it under its own ``checkpoints/``."""
        if not recorded:
            return None
        p = Path(str(recorded))
        here = self.run_dir / "checkpoints" / p.name
        for cand in [here, p] if p.is_absolute() else [self.run_dir / p, here]:
            if cand.exists():
                return cand.resolve()
        return None

    def _finalize(self, terminal: bool) -> None:
        events = list(read_jsonl(self.run_dir / "events.jsonl"))
        if not self._dirty and self._cursor.get("finalized_events") == len(events):
            return  # an earlier export already ended this run with these events: nothing new
        run = self._ensure_run()
        summary = incident_summary(events)
        rows = []
        for e in summary["incidents"]:
            ts = e.get("ts")
            when = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
                if isinstance(ts, (int, float))
                else ""
            )
            sp = spec(str(e.get("kind")))
            detail = {
                k: v for k, v in e.items() if k not in ("ts", "kind", "attempt", "step", "rank")
            }
            rows.append(
                [
                    when,
                    ts,
                    e.get("attempt"),
                    e.get("kind"),
                    e.get("step"),
                    e.get("rank"),
                    e.get("severity") or (sp.severity if sp is not None else None),
                    json.dumps(detail, default=str),
                ]
            )
        import wandb

        table = wandb.Table(columns=INCIDENT_COLUMNS, data=rows, allow_mixed_types=True)
        run.log({"ptops/incidents": table}, step=self._cursor["next_step"])
        self._cursor["next_step"] += 1
        run.summary.update(
            {
                "ptops/state": summary["state"],
                "ptops/attempts": summary["attempts"],
                "ptops/incident_count": len(rows),
            }
        )
        self._cursor["finalized_events"] = len(events)
        if terminal:
            self._finish(exit_code=0 if summary["state"] == EventKind.COMPLETED else 1)
        else:
            self._save_state()

    def _finish(self, exit_code: int | None = None) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        self._dirty = False
        self._save_state()
        run.finish(exit_code=exit_code)
