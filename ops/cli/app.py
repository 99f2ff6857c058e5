"""The ``ptops`` command line. Heavy imports (torch, trl) stay out of this path."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ptops import __version__

app = typer.Typer(
    name="ptops",
    help=(
        "Operations and reliability for TorchTitan and TRL training runs.\n\n"
        "Start with:  ptops launch titan-tiny   (a shipped recipe; see `ptops recipes`)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ptops {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    pass


@app.command()
def launch(
    recipe: Annotated[str, typer.Argument(help="Recipe TOML file, or the name of a shipped recipe (titan-tiny, trl-sft-tiny, ...).")],
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory; rerunning on an existing one resumes it. Default: runs/<recipe>-<timestamp>.")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe key, e.g. --set train.steps=30 (repeatable; values parse as TOML).")] = [],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate, print the resolved recipe and the rank command; start nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON on stdout.")] = False,
    supervise: Annotated[bool, typer.Option("--supervise", help="Run under the supervisor: detect crashes and hangs, restart from the last good checkpoint. Exit 3 means do not requeue.")] = False,
    metrics_port: Annotated[Optional[int], typer.Option("--metrics-port", help="Serve Prometheus metrics on 127.0.0.1:PORT while the run lives (0 picks a free port).")] = None,
    mlflow_uri: Annotated[Optional[str], typer.Option("--mlflow-uri", help="MLflow tracking URI (a server, or sqlite:///path). Default: sqlite:///<runs root>/mlflow.db beside the run directories.")] = None,
    mlflow: Annotated[bool, typer.Option("--mlflow/--no-mlflow", help="Log params, per-step metrics, events and an incident summary to MLflow.")] = True,
    fault: Annotated[list[str], typer.Option("--fault", help="Inject a fault, e.g. crash:rank=1,step=12 (repeatable; first attempt only unless attempt=N).")] = [],
) -> None:
    """Run a recipe's ranks with torchrun, checkpoint as the recipe says, resume on rerun.

    Examples:\n
      ptops launch titan-tiny --run-dir runs/demo\n
      ptops launch recipes/trl-grpo-tiny.toml --set train.steps=40 --set launch.nproc=2\n
      ptops launch titan-tiny --set titan.parallelism.tp=2 --dry-run\n
      ptops launch titan-tiny --supervise --fault crash:rank=1,step=12
    """
    from ptops.ops.supervisor import launcher
    from ptops.recipes.schema import RecipeError, dump_json, load

    from ptops.ops.cli.supervise import launch_supervised, parse_faults

    faults = parse_faults(fault)
    try:
        rec, path = load(recipe, set_)
        target = run_dir or launcher.default_run_dir(rec)
        if dry_run:
            typer.echo(dump_json(rec))
            from ptops.ops.runrecord.rundir import RunDir

            cmd = launcher.rank_command(rec, RunDir(target), 1)
            typer.echo(" ".join(cmd.argv))
            return
        run = launcher.prepare_run(rec, path, target)
    except RecipeError as e:
        fail(str(e))
    from ptops.ops.obs.live import LiveExporters
    from ptops.ops.supervisor.lock import LockedError, acquire, release

    try:
        lock_fd = acquire(run.path)  # one launcher per run directory, supervised or not
    except LockedError as e:
        fail(str(e))
    exporters = LiveExporters(run.path, metrics_port, mlflow_uri, mlflow)
    try:
        if supervise:  # the supervisor owns the lock from here and releases it
            code = launch_supervised(rec, run, faults, json_out, lock_fd=lock_fd)
        else:
            try:
                code = _launch_plain(rec, run, faults, json_out)
            finally:
                release(lock_fd)
    finally:
        exporters.close()
    raise typer.Exit(code)


def _launch_plain(rec, run, faults, json_out: bool) -> int:
    from ptops.ops.supervisor import launcher
    from ptops.ops.cli.progress import Progress

    resumed_from = launcher.completed_step(run)
    typer.echo(
        f"ptops: {rec.name} ({rec.engine}) -> {run.path}"
        + (f"  (resuming after step {resumed_from})" if resumed_from else ""),
        err=True,
    )
    if faults:
        import os

        from ptops.faultinject.spec import to_env

        os.environ["PTOPS_FAULTS"] = to_env(faults)  # rank_command passes the environment on
    t0 = time.monotonic()
    progress = Progress(rec.train.steps)
    code = launcher.run_plain(rec, run, progress)
    progress.close()
    summary = summarize(run, time.monotonic() - t0)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return code


def summarize(run, wall_s: float) -> dict:
    from ptops.ops.runrecord.rundir import final_metrics_by_step

    events = run.read_events()
    steps = final_metrics_by_step(run.read_metrics())
    last = steps[max(steps)] if steps else {}
    end = next((e for e in reversed(events) if e["kind"] in ("completed", "failed", "stopped")), None)
    return {
        "run_dir": str(run.path),
        "state": end["kind"] if end else "unknown",
        "reason": (end or {}).get("reason"),
        "step": max(steps, default=0),
        "loss": last.get("loss"),
        "attempts": sum(1 for e in events if e["kind"] == "launch"),
        "checkpoints": sorted(p.name for p in run.checkpoints.glob("*") if p.is_dir()),
        "wall_s": round(wall_s, 2),
    }


def _print_summary(s: dict) -> None:
    typer.echo(f"{s['state']}: step {s['step']}, loss {s['loss']}, attempts {s['attempts']}, {s['wall_s']} s", err=True)
    if s["reason"]:
        typer.echo(f"  reason: {s['reason']}", err=True)
    typer.echo(f"  run dir: {s['run_dir']}", err=True)
    typer.echo(f"  checkpoints: {', '.join(s['checkpoints']) or 'none'}", err=True)


@app.command()
def recipes() -> None:
    """List the shipped recipes."""
    from ptops.recipes.schema import RecipeError, load, shipped_names

    for name in shipped_names():
        try:
            rec, _ = load(name)
            typer.echo(f"{name:18s} {rec.engine:6s} {rec.description}")
        except RecipeError as e:
            typer.echo(f"{name:18s} INVALID {e}")


from ptops.ops.cli.supervise import register as _register_supervision  # noqa: E402

_register_supervision(app)

from ptops.ops.cli.obs import register as _register_observability  # noqa: E402

_register_observability(app)

@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (also one copied from elsewhere).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """What happened in a run: replay the monitors over metrics.jsonl, merge events, name the runbooks.

    Prints the findings (what, which step, which rank, which runbook), a summary of the run's
    events (state, attempts, restarts, last checkpoint) and a timeline; --json prints the same
    report as one JSON object (run_dir, findings, events_summary, timeline).

    Exit 0 with a report (findings or not); exit 2 when RUN_DIR is not a run directory.

    Example:  ptops diagnose runs/demo --json
    """
    from ptops.ops.cli.diagnose import diagnose_command

    raise typer.Exit(diagnose_command(run_dir, json_out))


from ptops.ops.cli.ckpt import app as _ckpt_app  # noqa: E402

app.add_typer(_ckpt_app, name="ckpt")

from ptops.ops.cli.chaos import register as _register_chaos  # noqa: E402

_register_chaos(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
