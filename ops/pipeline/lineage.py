"""MLflow lineage of a pipeline: one parent run, one nested child run per stage, inputs and outputs
by digest.

The parent lives in the pipeline directory's ``mlflow.json``; each child is created here (tag
``mlflow.parentRunId``, the stage's recipe as params, its input digest as a param) and written to
the stage's own ``mlflow.json`` *before* the stage launches, so the stage's ordinary MLflow
exporter (:mod:`ptops.ops.obs.mlflow_export`) continues that same run with its metrics, events and
artifacts. A rerun of the pipeline finds both files and continues the same runs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ptops.ops.obs.mlflow_export import (
    _quiet_third_party_loggers,
    artifact_location,
    default_tracking_uri,
    flatten,
    seed_sqlite_store,
)

log = logging.getLogger("ptops.pipeline.mlflow")


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _stored(path: Path, uri: str) -> str | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d.get("run_id") if d.get("tracking_uri") == uri else None


class Lineage:
    """Best effort, like every exporter: an MLflow failure is a warning, never a failed pipeline."""

    def __init__(self, pipe_dir: Path, name: str, uri: str | None = None) -> None:
        self.dir = Path(pipe_dir)
        self.uri = uri or default_tracking_uri(self.dir)
        self.name = name
        self.client: Any = None
        self.parent: str | None = None
        self.experiment_id: str | None = None
        self.error: str | None = None
        try:
            self._connect()
        except Exception as e:  # MLflow down or misconfigured
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {e}"
        log.warning("MLflow lineage off: %s", self.error)
        self.client = None

    def _connect(self) -> None:
        from mlflow.tracking import MlflowClient

        _quiet_third_party_loggers()
        seed_sqlite_store(self.uri)  # the default store's folder is made private (0700)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.name)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                self.name, artifact_location=artifact_location(self.uri)
            )
        else:
            self.experiment_id = exp.experiment_id
        run_id = _stored(self.dir / "mlflow.json", self.uri)
        if run_id is None:
            run = self.client.create_run(
                self.experiment_id,
                run_name=self.dir.name,
                tags={
                    "ptops.pipeline": self.name,
                    "ptops.run_dir": str(self.dir.resolve()),
                    "ptops.kind": "pipeline",
                },
            )
            run_id = run.info.run_id
            _write(
                self.dir / "mlflow.json",
                {"run_id": run_id, "experiment_id": self.experiment_id, "tracking_uri": self.uri},
            )
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.parent = run_id

    def child(
        self,
        stage: str,
        index: int,
        stage_dir: Path,
        recipe: dict,
        input_stage: str | None,
        input_digest: str | None,
    ) -> str | None:
        """The stage's MLflow run (created once, nested under the parent), stored where its launch
        finds it."""
        if self.client is None:
            return None
        try:
            run_id = _stored(stage_dir / "mlflow.json", self.uri)
            if run_id is not None:
                return run_id
            from mlflow.entities import Param

            run = self.client.create_run(
                self.experiment_id,
                run_name=f"{index + 1:02d}-{stage}",
                tags={
                    "mlflow.parentRunId": self.parent,
                    "ptops.pipeline": self.name,
                    "ptops.stage": stage,
                    "ptops.run_dir": str(stage_dir.resolve()),
                    "ptops.recipe": str(recipe.get("name", "")),
                    "ptops.engine": str(recipe.get("engine", "")),
                    "ptops.input_stage": input_stage or "",
                    "ptops.input_digest": input_digest or "",
                },
            )
            run_id = run.info.run_id
            params = flatten(recipe) | {
                "ptops.input_stage": input_stage or "",
                "ptops.input_digest": input_digest or "",
            }
            items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
            _write(
                stage_dir / "mlflow.json",
                {"run_id": run_id, "experiment_id": self.experiment_id, "tracking_uri": self.uri},
            )
            self.client.set_tag(self.parent, f"ptops.stage.{stage}.run_id", run_id)
            return run_id
        except Exception as e:
            self._fail(e)
            return None

    def stage_done(self, stage: str, stage_dir: Path, fields: dict[str, Any]) -> None:
        """Output digest (and gate) on the child and, per stage, on the parent."""
        if self.client is None:
            return
        try:
            run_id = _stored(stage_dir / "mlflow.json", self.uri)
            for k, v in fields.items():
                if v is None:
                    continue
                if run_id is not None:
                    self.client.set_tag(run_id, f"ptops.{k}", str(v))
                self.client.set_tag(self.parent, f"ptops.stage.{stage}.{k}", str(v))
        except Exception as e:
            self._fail(e)

    def finish(self, state: str, message: str | None = None) -> None:
        if self.client is None:
            return
        try:
            self.client.set_tag(self.parent, "ptops.state", state)
            if message:
                self.client.set_tag(self.parent, "ptops.message", message[:4000])
            status = {"completed": "FINISHED", "stopped": "KILLED"}.get(state, "FAILED")
            self.client.set_terminated(self.parent, status=status)
        except Exception as e:
            self._fail(e)
