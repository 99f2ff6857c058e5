"""``ptops status PIPE_DIR``: the pipeline's state and every stage's (state, steps, digests, gate),
from the records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ptops.ops.pipeline.runner import SNAPSHOT, stage_dirs
from ptops.ops.runrecord.lock import holder
from ptops.ops.runrecord.rundir import RunDir

_END = {
    "pipeline_completed": "completed",
    "pipeline_failed": "failed",
    "pipeline_stopped": "stopped",
}


def collect(pipe_dir: Path) -> dict[str, Any]:
    from ptops.ckpt import latest_good
    from ptops.ops.runrecord.status import collect as run_status

    pipe = Path(pipe_dir)
    snap = json.loads((pipe / SNAPSHOT).read_text())
    events = RunDir(pipe).read_events()
    state, reason = "new", None
    last: dict[tuple[str, str], dict] = {}
    for e in events:
        kind = e.get("kind")
        if kind == "pipeline_started":
            state, reason = "running", None
        elif kind in _END:
            state, reason = _END[kind], e.get("reason")
        elif e.get("stage") is not None:
            last[(str(e["stage"]), str(kind))] = e
    if state == "running" and holder(pipe) is None:
        state = "dead"
    stages = []
    for i, (s, sdir) in enumerate(zip(snap["stages"], stage_dirs(pipe, snap))):
        name = s["name"]
        started = last.get((name, "stage_started"))
        completed = last.get((name, "stage_completed"))
        gate = last.get((name, "gate"))
        row: dict[str, Any] = {
            "index": i + 1,
            "name": name,
            "recipe": s["recipe"],
            "run_dir": str(sdir),
            "state": "pending",
            "step": 0,
            "total_steps": s.get("steps"),
            "input_stage": s.get("input"),
            "input_digest": (started or {}).get("input_digest"),
            "digest": (completed or {}).get("digest"),
            "checkpoint": (completed or {}).get("checkpoint"),
            "gate": None
            if s.get("gate") is None
            else {
                "metric": s["gate"]["metric"],
                "op": s["gate"]["op"],
                "threshold": s["gate"]["value"],
                "value": (gate or {}).get("value"),
                "step": (gate or {}).get("step"),
                "passed": (gate or {}).get("passed"),
            },
        }
        if (sdir / "recipe.json").exists() or (sdir / "events.jsonl").exists():
            try:
                good = latest_good(RunDir(sdir).checkpoints, deep=False)
                st = run_status(sdir, good.ref() if good else None)
                row["state"], row["step"] = st["state"], st["step"]
                row["total_steps"] = st.get("total_steps") or row["total_steps"]
                row["last_good_checkpoint"] = st.get("last_good_checkpoint")
            except FileNotFoundError:
                pass
        if completed is not None:
            row["state"] = "completed"
        if gate is not None and gate.get("passed") is False:
            row["state"] = "gate_failed"
        stages.append(row)
    return {
        "pipeline_dir": str(pipe),
        "name": snap["name"],
        "state": state,
        "reason": reason,
        "pipeline_pid": holder(pipe),
        "stages": stages,
    }


def render(s: dict[str, Any]) -> str:
    lines = [f"{s['pipeline_dir']}: pipeline {s['name']} {s['state']}"]
    width = max(len(r["name"]) for r in s["stages"])
    for r in s["stages"]:
        total = f"/{r['total_steps']}" if r.get("total_steps") else ""
        parts = [f"  {r['index']}. {r['name']:<{width}}  {r['state']:<11} step {r['step']}{total}"]
        if r.get("input_stage"):
            parts.append(f"input {r['input_stage']}@{(r.get('input_digest') or '?')[:12]}")
        if r.get("digest"):
            parts.append(f"digest {r['digest'][:12]}")
        g = r.get("gate")
        if g:
            if g.get("passed") is None:
                verdict = "not judged yet"
            else:
                value = "never recorded" if g.get("value") is None else f"{g['value']:.4g}"
                verdict = f"{'passed' if g['passed'] else 'FAILED'} ({value})"
            parts.append(f"gate {g['metric']} {g['op']} {g['threshold']:g}: {verdict}")
        lines.append("  ".join(parts))
    if s.get("reason"):
        lines.append(f"  reason: {s['reason']}")
    return "\n".join(lines)
