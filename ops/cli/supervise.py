"""CLI pieces of supervision: ``ptops launch --supervise``, ``ptops status``, ``ptops inject``.

``ops/cli/app.py`` calls :func:`launch_supervised` from ``launch`` and adds the two
commands with :func:`register`. Heavy imports stay out of this module's top.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def parse_faults(specs: list[str]) -> list:
    """Parse every ``--fault``; one clear line and exit 2 on the first bad one."""
    from ptops.faultinject.spec import FaultSpecError, parse_all

    try:
        return parse_all(specs)
    except FaultSpecError as e:
        _fail(f"--fault: {e}")
        return []


def launch_supervised(rec, run, faults: list, json_out: bool = False, lock_fd: int | None = None) -> int:
    """Run ``run`` (a prepared RunDir) under the supervisor; print progress and a summary; return the exit code."""
    from ptops.ops.supervisor.launcher import completed_step
    from ptops.ops.cli.progress import Progress
    from ptops.ops.supervisor import LockedError, Supervisor
    from ptops.ops.supervisor.lock import acquire

    if lock_fd is None:
        try:
            lock_fd = acquire(run.path)
        except LockedError as e:
            _fail(str(e))
    resumed_from = completed_step(run)
    typer.echo(
        f"ptops: {rec.name} ({rec.engine}) -> {run.path}  [supervised, pid {os.getpid()}]"
        + (f"  (resuming after step {resumed_from})" if resumed_from else ""),
        err=True,
    )
    t0 = time.monotonic()
    progress = Progress(rec.train.steps)
    sup = Supervisor(rec, run, faults, progress=progress)
    code = sup.run_all(lock_fd=lock_fd)
    progress.close()
    summary = summarize_supervised(run, time.monotonic() - t0, code)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return code


def summarize_supervised(run, wall_s: float, code: int) -> dict:
    from ptops.ops.runrecord.rundir import final_metrics_by_step
    from ptops.ops.runrecord.status import last_good_checkpoint

    events = run.read_events()
    # this supervisor's share: from its first launch on (an adopted run has earlier ones)
    steps = final_metrics_by_step(run.read_metrics())
    last = steps[max(steps)] if steps else {}
    end = next((e for e in reversed(events) if e["kind"] in ("completed", "failed", "stopped")), None)
    count = lambda kind: sum(1 for e in events if e["kind"] == kind)  # noqa: E731
    good = last_good_checkpoint(run)
    return {
        "run_dir": str(run.path),
        "state": end["kind"] if end else "unknown",
        "exit_code": code,
        "reason": (end or {}).get("reason"),
        "step": max(steps, default=0),
        "loss": last.get("loss"),
        "attempts": count("launch"),
        "restarts": count("restart"),
        "crashes": count("crash"),
        "hangs": count("hang"),
        "faults_injected": count("fault_injected"),
        "last_good_checkpoint": good,
        "checkpoints": sorted(p.name for p in run.checkpoints.glob("*") if p.is_dir()),
        "stacks": sorted(str(p) for p in (run.path / "stacks").glob("attempt-*")) if (run.path / "stacks").exists() else [],
        "wall_s": round(wall_s, 2),
    }


def print_summary(s: dict) -> None:
    e = lambda m: typer.echo(m, err=True)  # noqa: E731
    e(
        f"{s['state']} (exit {s['exit_code']}): step {s['step']}, loss {s['loss']}, attempts {s['attempts']}, "
        f"restarts {s['restarts']} (crashes {s['crashes']}, hangs {s['hangs']}), {s['wall_s']} s"
    )
    if s["reason"]:
        e(f"  reason: {s['reason']}")
    e(f"  run dir: {s['run_dir']}")
    good = s.get("last_good_checkpoint")
    e(f"  last good checkpoint: {good['path'] if good else 'none'}")
    for p in s["stacks"]:
        e(f"  stacks: {p}")
    if s["exit_code"] == 3:
        e("  do not requeue: a person must look (ptops status / ptops diagnose)")


def status_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """State, step, attempt, last good checkpoint, open findings, supervisor pid and live ranks of a run.

    Works on a live run (reads the supervisor's status.json) and after the fact.\n
    Example:  ptops status runs/demo --json
    """
    from ptops.ops.runrecord.status import collect, render

    try:
        s = collect(run_dir)
    except FileNotFoundError as e:
        _fail(str(e))
    typer.echo(json.dumps(s, indent=2, default=str) if json_out else render(s))


def inject_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a live supervised run.")],
    spec: Annotated[str, typer.Argument(help="Fault spec, e.g. hang:rank=0,step=30 (the step may be past: fires at the next), or release (ends a hold).")],
) -> None:
    """Inject a fault into a live supervised run (sent to its ranks over the supervisor's channel).

    Example:  ptops inject runs/demo crash:rank=1,step=40
    """
    from ptops.faultinject.spec import FaultSpecError, parse
    from ptops.ops.rank.channel import ChannelClient, read_info

    try:
        parse(spec)
    except FaultSpecError as e:
        _fail(str(e))
    info_path = Path(run_dir) / "supervisor" / "channel.json"
    from ptops.ops.supervisor.lock import holder

    if holder(Path(run_dir)) is None:
        _fail(f"{run_dir}: no live supervisor (launch it with `ptops launch --supervise`)", 1)
    try:
        info = read_info(info_path)
        client = ChannelClient(info["address"], info["token"], {"role": "control", "pid": 0}, connect_timeout=5)
        answer = client.request({"t": "inject", "spec": spec}, timeout=10)
        client.close()
    except (OSError, ValueError, KeyError, ConnectionError) as e:
        _fail(f"{run_dir}: cannot reach the supervisor ({e})", 1)
    if not answer.get("ok"):
        _fail(str(answer.get("error")), 2)
    typer.echo(f"injected {answer['fault']} into attempt {answer['attempt']} (ranks {answer['ranks']})")


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)
    app.command("inject")(inject_cmd)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
