"""``status.json`` (rewritten atomically by the supervisor) and ``ptops status`` on top of it.

``ptops status`` never trusts a stale file: it checks whether a supervisor still
holds ``supervisor.lock``; when none does, a "running" status becomes "dead"
(the supervisor died; rerun ``ptops launch`` on the run directory to resume).
Runs without a supervisor (plain ``ptops launch``) are described from
``events.jsonl`` and ``metrics.jsonl`` alone.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ptops.ops.runrecord.rundir import RunDir, final_metrics_by_step

LIVE_STATES = ("starting", "running", "checkpointing", "restarting", "collecting_stacks", "stopping")
FINDING_KINDS = ("crash", "hang", "straggler", "anomaly", "checkpoint_invalid", "rollback")


def status_path(run: RunDir) -> Path:
    return run.path / "status.json"


def write_status(run: RunDir, status: dict[str, Any]) -> None:
    """Atomic rewrite: readers see the old or the new file, never half of one."""
    path = status_path(run)
    tmp = path.with_name(f".status.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(status, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def read_status_file(run: RunDir) -> dict[str, Any]:
    try:
        return json.loads(status_path(run).read_text())
    except (OSError, ValueError):
        return {}


def last_good_checkpoint(run: RunDir, deep: bool = False) -> dict[str, Any] | None:
    """``{step, path}`` of the newest good checkpoint (``ptops.ckpt.latest_good``; read-only)."""
    from ptops.ckpt import latest_good

    entry = latest_good(run.checkpoints, deep=deep)
    return None if entry is None else {"step": int(entry.step), "path": str(entry.path)}


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything ``ptops status`` reports, as one dict."""
    from ptops.ops.supervisor.lock import holder

    run = RunDir(Path(run_dir))
    if not run.path.is_dir():
        raise FileNotFoundError(f"{run.path}: no such run directory")
    if not run.events.exists() and not run.recipe_json.exists():
        raise FileNotFoundError(f"{run.path}: not a ptops run directory (no events.jsonl or recipe.json)")
    events = run.read_events()
    st = read_status_file(run)
    steps = final_metrics_by_step(run.read_metrics())
    total = st.get("total_steps")
    if total is None and run.recipe_json.exists():
        try:
            total = json.loads(run.recipe_json.read_text())["train"]["steps"]
        except (OSError, ValueError, KeyError):
            total = None
    launches = [e for e in events if e.get("kind") == "launch"]
    attempt = max((int(e.get("attempt", 0)) for e in launches), default=0)
    last_launch_i = max((i for i, e in enumerate(events) if e.get("kind") == "launch"), default=-1)
    end = next((e for e in reversed(events) if e.get("kind") in ("completed", "failed", "stopped")), None)
    lock_pid = holder(run.path)
    state = st.get("state")
    if state is None:
        if end is not None and events.index(end) > last_launch_i:
            state = end["kind"]
        elif launches:
            state = "running" if lock_pid else "unknown (unsupervised run; no status.json)"
        else:
            state = "new"
    elif state in LIVE_STATES and lock_pid is None:
        state = "dead"
    findings = [e for e in events[last_launch_i + 1 :] if e.get("kind") in FINDING_KINDS] if last_launch_i >= 0 else []
    out: dict[str, Any] = {
        "run_dir": str(run.path),
        "state": state,
        "step": max(steps, default=0),
        "total_steps": total,
        "attempt": st.get("attempt", attempt),
        "restarts": sum(1 for e in events if e.get("kind") == "restart"),
        "last_good_checkpoint": last_good_checkpoint(run),
        "supervisor_pid": st.get("supervisor_pid") if lock_pid else None,
        "supervisor_alive": lock_pid is not None,
        "ranks": st.get("ranks", []) if state in LIVE_STATES else [],
        "open_findings": findings,
        "reason": (end or {}).get("reason") if end is not None and events.index(end) > last_launch_i else st.get("reason"),
        "updated": st.get("updated"),
        "loss": (steps[max(steps)] if steps else {}).get("loss"),
    }
    if state == "dead":
        out["hint"] = f"the supervisor (pid {st.get('supervisor_pid')}) is gone; resume with: ptops launch --supervise <recipe> --run-dir {run.path}"
    return out


def render(s: dict[str, Any]) -> str:
    total = f"/{s['total_steps']}" if s.get("total_steps") else ""
    ck = s.get("last_good_checkpoint")
    lines = [
        f"{s['run_dir']}: {s['state']}",
        f"  step {s['step']}{total}, attempt {s['attempt']}, restarts {s['restarts']}, loss {s.get('loss')}",
        f"  last good checkpoint: {'step ' + str(ck['step']) + ' (' + ck['path'] + ')' if ck else 'none'}",
        f"  supervisor: {'pid ' + str(s['supervisor_pid']) if s['supervisor_alive'] else 'not running'}",
    ]
    if s.get("ranks"):
        lines.append("  ranks: " + ", ".join(f"{r['rank']}=pid {r['pid']}@{r['host']}" for r in s["ranks"]))
    for f in s.get("open_findings", []):
        detail = {k: v for k, v in f.items() if k not in ("ts", "kind")}
        when = time.strftime("%H:%M:%S", time.localtime(f.get("ts", 0)))
        lines.append(f"  finding {when} {f['kind']}: {json.dumps(detail, default=str)}")
    if s.get("reason"):
        lines.append(f"  reason: {s['reason']}")
    if s.get("hint"):
        lines.append(f"  hint: {s['hint']}")
    return "\n".join(lines)
