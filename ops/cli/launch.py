"""``ptops launch``'s one path: plain or ``--supervise``, the same Supervisor, progress and summary.

A plain launch is the supervisor with the ``temporary`` restart strategy (never restarts;
its monitors only record), so both kinds of run leave the same records and end with the
same summary; only what happens after a failure differs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time

import typer


def run_launch(rec, run, faults: list, json_out: bool, lock_fd: int, supervise: bool) -> int:
    """Run ``run`` (a prepared RunDir whose lock the caller holds as ``lock_fd``; the supervisor
    releases it); print progress and the summary; return the exit code."""
    from ptops.ops.cli.progress import Progress
    from ptops.ops.supervisor import Supervisor
    from ptops.ops.supervisor.launcher import completed_step

    resumed_from = completed_step(run)
    typer.echo(
        f"ptops: {rec.name} ({rec.engine}) -> {run.path}"
        + (f"  [supervised, pid {os.getpid()}]" if supervise else "")
        + (f"  (resuming after step {resumed_from})" if resumed_from else ""),
        err=True,
    )
    t0 = time.monotonic()
    progress = Progress(progress_total(rec))
    sup = Supervisor(
        rec, run, faults, progress=progress, strategy="permanent" if supervise else "temporary"
    )
    code = _with_sidecars(rec, run, lock_fd, lambda: sup.run_all(lock_fd=lock_fd))
    progress.close()
    summary = summarize(run, time.monotonic() - t0, code)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return code


def progress_total(rec) -> int | None:
    """The progress line's total: ``train.steps`` bounds a recipe's run; a script's own loop decides
    its steps, so for the script engine only a ``train.steps`` the user set (``--set
    train.steps=N``, or ``[train] steps`` in its recipe file) is one, never the default."""
    if rec.engine == "script" and "steps" not in rec.train.model_fields_set:
        return None
    return rec.train.steps


def _with_sidecars(rec, run, lock_fd: int, body) -> int:
    """The engine's sidecars (e.g. ``trl vllm-serve``) live for the whole launch, across
    attempts."""
    from ptops.recipes.engines import sidecar_specs

    specs = sidecar_specs(rec)
    if not specs:
        return body()
    from ptops.ops.runrecord.events import EventKind
    from ptops.ops.supervisor.sidecar import run_sidecars

    try:
        with run_sidecars(specs, run.path, run.event):
            return body()
    except RuntimeError as e:
        if not str(e).startswith("sidecar "):
            raise
        typer.echo(f"error: {e}", err=True)
        run.event(EventKind.FAILED, reason=str(e))
        os.close(lock_fd)
        return 1


def summarize(run, wall_s: float, code: int) -> dict:
    """The end-of-launch summary, from the run directory (the same for plain and supervised
    runs)."""
    from ptops.ckpt import latest_good
    from ptops.ops.runrecord.events import EventKind as K
    from ptops.ops.runrecord.events import reduce
    from ptops.ops.runrecord.metrics import rank0_records
    from ptops.ops.runrecord.rundir import final_metrics_by_step

    view = reduce(run.read_events())
    steps = final_metrics_by_step(rank0_records(run.path))
    last = steps[max(steps)] if steps else {}
    end = view.end
    count = lambda kind: view.counts.get(kind, 0)  # noqa: E731
    entry = latest_good(run.checkpoints, deep=False)
    good = entry.ref() if entry else None
    return {
        "run_dir": str(run.path),
        "state": end["kind"] if end else "unknown",
        "exit_code": code,
        "reason": (end or {}).get("reason"),
        "step": max(steps, default=0),
        "loss": last.get("loss"),
        "attempts": view.launches,
        "restarts": view.restarts,
        "crashes": count(K.CRASH),
        "hangs": count(K.HANG),
        "faults_injected": count(K.FAULT_INJECTED),
        "last_good_checkpoint": good,
        "checkpoints": sorted(p.name for p in run.checkpoints.glob("*") if p.is_dir()),
        "stacks": sorted(str(p) for p in (run.path / "stacks").glob("attempt-*"))
        if (run.path / "stacks").exists()
        else [],
        "wall_s": round(wall_s, 2),
    }


def print_summary(s: dict) -> None:
    e = lambda m: typer.echo(m, err=True)  # noqa: E731
    e(
        f"{s['state']} (exit {s['exit_code']}): step {s['step']}, loss {s['loss']}, attempts "
        f"{s['attempts']}, "
        f"restarts {s['restarts']} (crashes {s['crashes']}, hangs {s['hangs']}), {s['wall_s']} s"
    )
    if s["reason"]:
        e(f"  reason: {s['reason']}")
    e(f"  run dir: {s['run_dir']}")
    good = s.get("last_good_checkpoint")
    e(f"  last good checkpoint: {good['path'] if good else 'none'}")
    e(f"  checkpoints: {', '.join(s['checkpoints']) or 'none'}")
    for p in s["stacks"]:
        e(f"  stacks: {p}")
    from ptops.ops.supervisor import exitcodes

    row = exitcodes.describe(s["exit_code"]) if s["exit_code"] else None
    if row is not None:  # the table's word for a scheduler and a person (docs/exit-codes.md)
        look = row.code in (exitcodes.NO_PROGRESS, exitcodes.MISCONFIGURED)
        e(
            f"  exit {row.code} ({row.name}): requeue: {row.requeue}"
            + ("; a person must look (ptops status / ptops diagnose)" if look else "")
        )


# what a user's own command starts with (a launcher, or a script run directly)
_COMMAND_START = re.compile(
    r"^(python[\d.]*|torchrun|accelerate|deepspeed|bash|sh|uv|.*\.(py|sh))$", re.I
)


def command_hint(params: list, args: list[str]) -> str | None:
    """``ptops launch`` arguments (no ``--`` among them) that hold the user's own command where the
    recipe goes (``ptops launch --supervise python train.py``, ``ptops launch train.py``): the
    command line they meant, with its ``--``, for a one-line error. None when the first positional
    argument is a recipe (a shipped name or a .toml file) or none is given."""
    options = [p for p in params if getattr(p, "param_type_name", "") == "option"]
    takes_value = {  # click's options (typer carries its own copy of click: duck-typed)
        name
        for p in options
        if not p.is_flag and not p.count
        for name in (*p.opts, *p.secondary_opts)
    }
    known = {name for p in options for name in (*p.opts, *p.secondary_opts)}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--help", "-h"):
            return None
        if not a.startswith("-") or a == "-":
            break
        i += 2 if a in takes_value else 1  # "--set=x" or a flag: one token
    else:
        return None
    first, rest = args[i], list(args[i + 1 :])
    if first.endswith(".toml"):
        return None
    from ptops.recipes.schema import shipped_recipes

    if first in shipped_recipes():
        return None
    words, j = [], 0  # what follows that is not an option of launch's own (`NAME --dry-run`)
    while j < len(rest):
        opt = rest[j].split("=", 1)[0]
        if opt in known:
            j += 2 if rest[j] in takes_value else 1
            continue
        words.append(rest[j])
        j += 1
    if not (_COMMAND_START.match(os.path.basename(first)) or words):
        return None  # a mistyped recipe name: the loader's error lists the recipes
    command = [first, *rest]
    if first.endswith(".py"):
        command.insert(0, "python")
    before = ["ptops", "launch", *args[:i]]
    return (
        f"{shlex.join([first, *rest])}: not a recipe; your own command goes after -- "
        f"(did you mean: {shlex.join(before)} -- {shlex.join(command)})"
    )
