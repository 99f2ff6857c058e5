"""``status.json`` (rewritten atomically by the supervisor) and the data of ``ptops status`` (its
text: ``ops/cli/status_view.py``).

``ptops status`` never trusts a stale file: it checks whether a supervisor still
holds ``supervisor.lock``; when none does, a "running" status becomes "dead"
(the supervisor died; rerun ``ptops launch`` on the run directory to resume).
Runs without a supervisor (plain ``ptops launch``) are described from
``events.jsonl`` and ``metrics.jsonl`` alone.

What it shows of the metrics (step, loss, goodput) is rank 0's: it reads the index of the rotated
segments and the live file, other ranks' lines skipped unparsed (``metrics.rank0_records``), so it
answers in seconds on a run directory of any size (docs/scale.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .events import LIVE_STATES, RunState, reduce
from .goodput import account
from .lock import holder
from .metrics import rank0_records
from .rundir import RunDir, final_metrics_by_step


def status_path(run: RunDir) -> Path:
    return run.path / "status.json"


def write_status(
    run: RunDir, status: dict[str, Any], encoded: dict[str, str] | None = None
) -> None:
    """Atomic rewrite: readers see the old or the new file, never half of one. One line, encoded
    by ``json``'s C encoder (``indent`` and ``json.dump`` to a file take the pure-Python one: at
    2,048 ranks each rewrite cost 84 ms of the supervisor's main thread, once a second).
    ``encoded``: more keys, their values already JSON text (the supervisor's list of ranks, which
    changes at hellos and exits, not every second: 131,072 ranks are ~7 MB to encode)."""
    path = status_path(run)
    tmp = path.with_name(f".status.{os.getpid()}.tmp")
    parts = [json.dumps(status, default=str)[1:-1]] if status else []
    parts += [f"{json.dumps(k)}:{v}" for k, v in (encoded or {}).items()]
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("{" + ",".join(parts) + "}\n")
    os.replace(tmp, path)


def read_status_file(run: RunDir) -> dict[str, Any]:
    try:
        return json.loads(status_path(run).read_text())
    except (OSError, ValueError):
        return {}


def slurm_view(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Slurm job of a ``--slurm`` run, from its events: job id, allocated nodes, the nodes the
    latest attempt ran on, spares, requeues. None for a local run."""
    out: dict[str, Any] = {}
    for e in events:
        kind = e.get("kind")
        if kind == "slurm_submitted":
            out.update(job_id=e.get("job_id"), state="submitted")
        elif kind == "slurm_allocation":
            out.update(
                job_id=e.get("job_id"),
                nodes=e.get("nodes"),
                restart_count=e.get("restart_count"),
                batch_host=e.get("batch_host"),
                spares=e.get("spares"),
                state="allocated",
            )
        elif kind == "launch" and "nodes" in e:
            out.update(active=e.get("nodes"), spares=e.get("spares"))
        elif kind == "node_replaced":
            out.setdefault("replaced", []).append({"node": e.get("node"), "by": e.get("by")})
        elif kind == "slurm_requeue":
            out.update(state="requeued" if e.get("how") == "requeue" else "resubmitted")
            if e.get("new_job_id"):
                out["job_id"] = e.get("new_job_id")
    return out or None


def _behind(e: dict[str, Any] | None) -> dict[str, Any] | None:
    if e is None:
        return None
    return {k: e.get(k) for k in ("ts", "attempt", "lag_s", "queued")}


def last_transitions(path: Path, n: int = 5, tail_bytes: int = 16_384) -> list[dict[str, Any]]:
    """The supervisor's last ``n`` state changes (``supervisor/transitions.jsonl``, written by
    ``Supervisor.transition``): ``ts``, ``attempt``, ``from``, ``to``, ``why``, ``ok``. A copied or
    hand-edited file yields what parses, never an error."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines[-n:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("to"), str):
            out.append({k: rec.get(k) for k in ("ts", "attempt", "from", "to", "why", "ok")})
    return out


def collect(run_dir: Path, last_good_checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything ``ptops status`` reports, as one dict. The caller names the last good checkpoint
    (``ptops.ckpt.latest_good``): which checkpoint is good is the checkpoint layer's call, not the
    record's."""
    run = RunDir(Path(run_dir))
    if not run.path.is_dir():
        raise FileNotFoundError(f"{run.path}: no such run directory")
    if not run.events.exists() and not run.recipe_json.exists():
        raise FileNotFoundError(
            f"{run.path}: not a ptops run directory (no events.jsonl or recipe.json)"
        )
    events = run.read_events()
    st = read_status_file(run)
    records = list(rank0_records(run.path))  # MetricsIndexError: a hostile copy (one line)
    steps = final_metrics_by_step(records)
    total = st.get("total_steps")
    if total is None and run.recipe_json.exists():
        try:
            total = json.loads(run.recipe_json.read_text())["train"]["steps"]
        except (OSError, ValueError, KeyError):
            total = None
    view = reduce(events)
    lock_pid = holder(run.path)
    state = st.get("state")
    if state is None:
        if view.ended or not view.launches:
            state = view.state  # the latest attempt's end kind, or new
        else:
            state = RunState.RUNNING if lock_pid else "unknown (unsupervised run; no status.json)"
    elif state in LIVE_STATES and lock_pid is None:
        state = RunState.DEAD
    out: dict[str, Any] = {
        "run_dir": str(run.path),
        "state": str(state),
        "step": max(steps, default=0),
        "total_steps": total,
        "attempt": st.get("attempt", view.attempt),
        "restarts": view.restarts,
        "last_good_checkpoint": last_good_checkpoint,
        "supervisor_pid": st.get("supervisor_pid") if lock_pid else None,
        "supervisor_alive": lock_pid is not None,
        "ranks": st.get("ranks", []) if state in LIVE_STATES else [],
        # the open inbox_behind episode of a live supervisor: its hang findings come late
        "supervisor_behind": _behind(view.behind) if state in LIVE_STATES else None,
        "open_findings": view.open_findings,
        "reason": view.reason if view.ended else st.get("reason"),
        "updated": st.get("updated"),
        "loss": (steps[max(steps)] if steps else {}).get("loss"),
        # a live run's wall time runs to now; an ended (or dead) one's to its last event or record
        "goodput": account(events, records, now=time.time() if state in LIVE_STATES else None),
    }
    out["transitions"] = last_transitions(run.path / "supervisor" / "transitions.jsonl")
    slurm = slurm_view(events)
    if slurm:
        out["slurm"] = slurm
    if state == RunState.DEAD:
        out["hint"] = (
            f"the supervisor (pid {st.get('supervisor_pid')}) is gone; resume with: ptops launch "
            f"--supervise <recipe> --run-dir {run.path}"
        )
    return out
