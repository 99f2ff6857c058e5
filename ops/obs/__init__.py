"""Exporters: what ptops sees, for Prometheus (with NVML GPU telemetry) and MLflow.

Both are fed from the run directory's records, one at a time:
``observe_event(event_dict)`` for each ``events.jsonl`` line and
``observe_metric(record_dict)`` for each ``metrics.jsonl`` line. The live
supervisor calls them as it writes; ``follow(run_dir, ...)`` tails a run
directory and feeds any number of sinks (``ptops.ops.runrecord.follow``).

Heavy imports (mlflow, pynvml) stay inside the modules that need them.

What the folder holds: Prometheus exporter, MLflow exporter, W&B exporter (`wandb_export.py`:
offline files in `RUN_DIR/wandb/`, `wandb.json` keeps the run id and how far it exported; it and
MLflow's write in a thread behind `queued.py`'s `QueuedExporter`: the caller only enqueues, a full
queue drops and counts), NVML, alert rules (`alerts/`), Grafana dashboard and provisioning
(`grafana/`). May import (of ptops): runrecord, monitors (names).
"""

from __future__ import annotations

from ptops.ops.obs.prometheus import PrometheusExporter
from ptops.ops.runrecord.follow import Follower, follow, replay

__all__ = ["PrometheusExporter", "Follower", "follow", "replay", "MlflowExporter"]


def __getattr__(name: str):
    if name == "MlflowExporter":
        from ptops.ops.obs.mlflow_export import MlflowExporter

        return MlflowExporter
    raise AttributeError(name)
