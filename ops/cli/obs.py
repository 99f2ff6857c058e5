"""Observability commands: ``ptops alerts``, ``ptops dashboard``, ``ptops grafana push``,
``ptops runbook [NAME]``, ``ptops export RUN_DIR``.

Wire them into the main CLI with ``register(app)`` (``ptops.ops.cli.app``); each
command body does its heavy imports (grafana-foundation-sdk, grafana-client,
mlflow) itself, so ``ptops --help`` stays fast. The plain functions
(:func:`alerts_text`, :func:`runbook_names`, :func:`runbook_text`, ...) are usable
without typer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Annotated, Optional

import typer

from ptops.ops.cli.errors import fail

# ---------------------------------------------------------------------- plain functions


def alerts_text(runbook_base_url: str | None = None) -> str:
    from ptops.ops.obs.alerts import render_rules

    return render_rules(runbook_base_url)


def runbook_names() -> list[str]:
    root = resources.files("ptops.runbooks")
    return sorted(
        p.name[:-3] for p in root.iterdir() if p.name.endswith(".md") and not p.name.startswith("_")
    )


def runbook_text(name: str) -> str:
    names = runbook_names()
    match = [n for n in names if n.lower() == name.lower().removesuffix(".md")]
    if not match:
        raise KeyError(f"no runbook named {name!r}; known: {', '.join(names)}")
    return (resources.files("ptops.runbooks") / f"{match[0]}.md").read_text()


def _first_line(text: str) -> str:
    """The first plain sentence of a runbook (skips headings and the severity line)."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "Severity")):
            return line
    return ""


# ---------------------------------------------------------------------- commands

WANDB_HELP = (
    "Also export to Weights & Biases: per-step metrics, incidents (alerts and a table), "
    "checkpoints as "
    "artifact references, every attempt in one W&B run. Offline by default: the files land in "
    "RUN_DIR/wandb and `wandb sync RUN_DIR/wandb/offline-run-*` uploads them later; "
    "--wandb-project / "
    "--wandb-entity log online (needs `wandb login` or WANDB_API_KEY; never prompts)."
)


def cmd_alerts(
    runbook_base_url: Annotated[
        Optional[str],
        typer.Option(
            "--runbook-base-url",
            help="Base URL of the runbooks in runbook_url annotations (default: "
            "$PTOPS_RUNBOOK_BASE_URL or a placeholder).",
        ),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="Write the rule file here instead of stdout."),
    ] = None,
) -> None:
    """Print the Prometheus alert rule file (load it with `rule_files:` in prometheus.yml).

    Example: ptops alerts --runbook-base-url https://git.example.com/ml/ptops/-/blob/main/runbooks >
    /etc/prometheus/ptops-rules.yml
    """
    text = alerts_text(runbook_base_url)
    if output:
        output.write_text(text)
        typer.echo(f"wrote {output}", err=True)
    else:
        typer.echo(text, nl=False)


def cmd_dashboard(
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="Write the dashboard JSON here instead of stdout."),
    ] = None,
    provisioning: Annotated[
        Optional[Path],
        typer.Option(
            "--provisioning",
            help="Write a Grafana provisioning folder (datasource, dashboard provider + "
            "dashboard, alert rules) here.",
        ),
    ] = None,
    prometheus_url: Annotated[
        str, typer.Option("--prometheus-url", help="Prometheus URL for the provisioned datasource.")
    ] = "http://127.0.0.1:9090",
    runbook_base_url: Annotated[
        Optional[str],
        typer.Option("--runbook-base-url", help="Base URL of the runbooks in the alert rules."),
    ] = None,
) -> None:
    """Print the Grafana dashboard JSON (built with grafana-foundation-sdk).

    Examples:\n
      ptops dashboard > ptops-dashboard.json\n
      ptops dashboard --provisioning /etc/grafana/provisioning --prometheus-url http://prometheus:9090
    """
    from ptops.ops.obs import dashboard

    if provisioning:
        for p in dashboard.write_provisioning(
            provisioning, prometheus_url=prometheus_url, runbook_base=runbook_base_url
        ):
            typer.echo(f"wrote {p}", err=True)
        return
    text = dashboard.dashboard_json()
    if output:
        output.write_text(text)
        typer.echo(f"wrote {output}", err=True)
    else:
        typer.echo(text, nl=False)


def cmd_grafana_push(
    url: Annotated[str, typer.Option("--url", help="Grafana base URL, e.g. http://127.0.0.1:3000")],
    token: Annotated[
        Optional[str],
        typer.Option("--token", help="Service-account token (default: $GRAFANA_TOKEN)."),
    ] = None,
    datasource_uid: Annotated[
        str,
        typer.Option(
            "--datasource-uid", help="UID of the Prometheus datasource the alert rules query."
        ),
    ] = "ptops-prometheus",
    folder_uid: Annotated[
        str, typer.Option("--folder-uid", help="Folder for the dashboard and the rule group.")
    ] = "ptops",
    runbook_base_url: Annotated[
        Optional[str],
        typer.Option("--runbook-base-url", help="Base URL of the runbooks in the alert rules."),
    ] = None,
) -> None:
    """Provision the ptops folder, dashboard and alert rule group on a Grafana (idempotent).

    Example:  ptops grafana push --url http://127.0.0.1:3000 --token "$GRAFANA_TOKEN"
    """
    from ptops.ops.obs import dashboard

    token = token or os.environ.get("GRAFANA_TOKEN")
    try:
        res = dashboard.push(
            url,
            token,
            datasource_uid=datasource_uid,
            folder_uid=folder_uid,
            runbook_base=runbook_base_url,
        )
    except Exception as e:  # one clear line: which URL, what went wrong
        fail(f"grafana push to {url} failed: {type(e).__name__}: {e}", 1)
    typer.echo(
        f"provisioned on {url}: folder {res['folder']}, dashboard {res['dashboard']}, "
        f"{res['rules']} alert rules"
    )


def cmd_runbook(
    name: Annotated[
        Optional[str],
        typer.Argument(
            help="Runbook name (an alert name such as TrainingHang); omit to list them."
        ),
    ] = None,
) -> None:
    """List the runbooks, or print one.

    Examples:  ptops runbook ;  ptops runbook TrainingHang
    """
    if not name:
        for n in runbook_names():
            typer.echo(f"{n:24s} {_first_line(runbook_text(n))}")
        return
    try:
        typer.echo(runbook_text(name), nl=False)
    except KeyError as e:
        fail(str(e.args[0]))


def cmd_export(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory to follow (events.jsonl, metrics.jsonl).")
    ],
    port: Annotated[
        int,
        typer.Option("--port", help="Serve Prometheus metrics on this port (0 = pick a free one)."),
    ] = 9464,
    addr: Annotated[
        str, typer.Option("--addr", help="Address to bind (default loopback only).")
    ] = "127.0.0.1",
    mlflow_uri: Annotated[
        Optional[str],
        typer.Option(
            "--mlflow-uri",
            help="Also export to MLflow (default store: sqlite:///<run dir>/mlflow/mlflow.db "
            "with --mlflow).",
        ),
    ] = None,
    mlflow: Annotated[
        bool, typer.Option("--mlflow", help="Also export to MLflow at the default store.")
    ] = False,
    wandb: Annotated[bool, typer.Option("--wandb", help=WANDB_HELP)] = False,
    wandb_project: Annotated[
        Optional[str],
        typer.Option(
            "--wandb-project", help="W&B project (online; default project: the recipe's name)."
        ),
    ] = None,
    wandb_entity: Annotated[
        Optional[str], typer.Option("--wandb-entity", help="W&B entity (team or user; online).")
    ] = None,
    once: Annotated[
        bool,
        typer.Option("--once", help="Read the run directory once, print the metrics and exit."),
    ] = False,
) -> None:
    """Export a run directory (live or finished) to Prometheus, and optionally MLflow and W&B, until
    Ctrl-C.

    Examples:\n
      ptops export runs/titan-tiny-20261130-101500 --port 9464\n
      ptops export runs/titan-tiny-20261130-101500 --once --wandb
        (offline; then: wandb sync RUN_DIR/wandb/offline-run-*)
    """
    from ptops.ops.obs.prometheus import PrometheusExporter
    from ptops.ops.runrecord.follow import follow, replay

    if not (run_dir / "events.jsonl").exists() and not (run_dir / "metrics.jsonl").exists():
        fail(f"{run_dir}: not a run directory (no events.jsonl or metrics.jsonl)")
    exporter = PrometheusExporter.for_run_dir(run_dir)
    sinks = [exporter]
    ml = None
    if mlflow or mlflow_uri:
        from ptops.ops.obs.mlflow_export import MlflowExporter

        ml = MlflowExporter(run_dir, tracking_uri=mlflow_uri)
        sinks.append(ml)
    wb = None
    if wandb or wandb_project or wandb_entity:
        from ptops.ops.obs.wandb_export import WandbExporter, mode_for

        wb = WandbExporter(
            run_dir, wandb_project, wandb_entity, mode=mode_for(wandb_project, wandb_entity)
        )
        sinks.append(wb)
    if once:
        replay(run_dir, *sinks)
        typer.echo(exporter.text(), nl=False)
        if ml:
            ml.close(30)
        if wb:
            _close_wandb(wb, 60)
        return
    try:
        bound = exporter.serve(port, addr)
    except OSError as e:
        fail(f"cannot serve metrics on {addr}:{port}: {e}")
    typer.echo(
        f"ptops export: serving http://{addr}:{bound}/metrics for {run_dir} (Ctrl-C to stop)",
        err=True,
    )
    follower = follow(run_dir, *sinks)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    follower.stop()
    if ml:
        ml.close(10)
    if wb:
        _close_wandb(wb, 30)
    exporter.close()


def _close_wandb(wb, timeout: float) -> None:
    ok = wb.close(timeout)
    where = wb.run_dir / "wandb"
    if ok:
        typer.echo(f"ptops export: W&B run {wb.run_id} ({wb.mode}; files in {where})", err=True)
    else:
        typer.echo(
            f"ptops export: W&B export incomplete ({wb.dropped} records dropped, last error: "
            f"{wb.last_error})",
            err=True,
        )


def register(app: typer.Typer) -> None:
    """Add alerts, dashboard, grafana push, runbook and export to a typer app."""
    app.command("alerts")(cmd_alerts)
    app.command("dashboard")(cmd_dashboard)
    grafana = typer.Typer(help="Grafana provisioning.", no_args_is_help=True)
    grafana.command("push")(cmd_grafana_push)
    app.add_typer(grafana, name="grafana")
    app.command("runbook")(cmd_runbook)
    app.command("export")(cmd_export)


def make_app() -> typer.Typer:
    """A stand-alone app with only these commands (tests; ``python -m ptops.ops.cli.obs``)."""
    app = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    register(app)
    return app


if __name__ == "__main__":
    make_app()(prog_name="ptops", args=sys.argv[1:])
