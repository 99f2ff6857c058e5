"""Exporters beside a live launch: they follow the run directory, never the ranks.

Data flows one way: ranks -> supervisor -> run directory -> these followers ->
Prometheus / MLflow / W&B. A slow or dead MLflow or W&B can only fill its own bounded queue.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ptops.ops.obs.prometheus import PrometheusExporter
from ptops.ops.runrecord.follow import follow


class LiveExporters:
    def __init__(
        self,
        run_dir: Path,
        metrics_port: int | None,
        mlflow_uri: str | None,
        mlflow: bool,
        out=None,
        wandb: bool = False,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
    ):
        self.out = out or sys.stderr
        self.followers = []
        self.prom = None
        self.mlflow = None
        self.wandb = None
        self.port: int | None = None
        if metrics_port is not None:
            self.prom = PrometheusExporter.for_run_dir(run_dir)
            self.port = self.prom.serve(metrics_port)
            self.followers.append(follow(run_dir, self.prom))
            print(
                f"ptops: Prometheus metrics on http://127.0.0.1:{self.port}/metrics", file=self.out
            )
        if mlflow:
            from ptops.ops.obs.mlflow_export import MlflowExporter

            # An adopted run was logged up to where its last supervisor got: go on from the end.
            resumed = (Path(run_dir) / "mlflow.json").exists()
            self.mlflow = MlflowExporter(run_dir, mlflow_uri)
            self.followers.append(follow(run_dir, self.mlflow, from_start=not resumed))
        if wandb:
            from ptops.ops.obs.wandb_export import WandbExporter, mode_for

            # from the start: wandb.json's cursor skips what an earlier attempt's exporter already
            # wrote
            mode = mode_for(wandb_project, wandb_entity)
            self.wandb = WandbExporter(run_dir, wandb_project, wandb_entity, mode=mode)
            self.followers.append(follow(run_dir, self.wandb))
            where = (
                "W&B offline files in " + str(Path(run_dir) / "wandb")
                if mode == "offline"
                else f"W&B project {wandb_entity + '/' if wandb_entity else ''}{self.wandb.project}"
            )
            print(f"ptops: {where}", file=self.out)

    def close(self, timeout: float = 15.0) -> None:
        for f in self.followers:
            f.stop()
        if self.mlflow is not None:
            if not self.mlflow.close(timeout):
                print(
                    f"ptops: MLflow export incomplete ({self.mlflow.dropped} records dropped, "
                    f"last error: {self.mlflow.last_error})",
                    file=self.out,
                )
        if self.wandb is not None:
            if not self.wandb.close(max(timeout, 30.0)):
                print(
                    f"ptops: W&B export incomplete ({self.wandb.dropped} records dropped, last "
                    "error: "
                    f"{self.wandb.last_error})",
                    file=self.out,
                )
        if self.prom is not None:
            self.prom.last_scrape()  # the followers' final poll is in: let Prometheus see the end
            self.prom.close()
