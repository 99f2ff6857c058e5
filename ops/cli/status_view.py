"""``ptops status``'s human view of :func:`ptops.ops.runrecord.status.collect` (the data stays in
the run-record layer)."""

from __future__ import annotations

import json
import time
from typing import Any

from ptops.ops.runrecord.ranks import compact, rank_list


def render(s: dict[str, Any]) -> str:
    total = f"/{s['total_steps']}" if s.get("total_steps") else ""
    ck = s.get("last_good_checkpoint")
    lines = [
        f"{s['run_dir']}: {s['state']}",
        f"  step {s['step']}{total}, attempt {s['attempt']}, restarts {s['restarts']}, loss "
        f"{s.get('loss')}",
        "  last good checkpoint: "
        f"{'step ' + str(ck['step']) + ' (' + ck['path'] + ')' if ck else 'none'}",
        "  supervisor: "
        f"{'pid ' + str(s['supervisor_pid']) if s['supervisor_alive'] else 'not running'}",
    ]
    b = s.get("supervisor_behind")
    if b:
        ts = b.get("ts")
        when = time.strftime("%H:%M:%S", time.localtime(ts)) if type(ts) in (int, float) else "?"
        lines[-1] += (
            f", behind its ranks' messages since {when} ({b.get('lag_s')} s, {b.get('queued')} "
            "queued when it began): hangs are found late by the lag (ptops runbook "
            "SupervisorBehind)"
        )
    g = s.get("goodput") or {}
    if g.get("ratio") is not None:
        lost = sorted(((v, k) for k, v in g["lost_s"].items() if v >= 0.05), reverse=True)
        where = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for v, k in lost) or "nothing lost"
        lines.append(
            f"  goodput: {g['ratio']:.0%} of {g['wall_s']:.1f} s productive; lost: {where}"
        )
    sl = s.get("slurm")
    if sl:
        lines.append(
            f"  slurm job {sl.get('job_id')} ({sl.get('state')})"
            + (f" on {','.join(sl['nodes'])}" if sl.get("nodes") else "")
            + (f"; attempt nodes {','.join(sl['active'])}" if sl.get("active") else "")
            + (f"; spares {','.join(sl['spares'])}" if sl.get("spares") else "")
            + (f"; requeues {sl['restart_count']}" if sl.get("restart_count") else "")
        )
    if s.get("ranks") and len(s["ranks"]) <= 16:
        lines.append(
            "  ranks: " + ", ".join(f"{r['rank']}=pid {r['pid']}@{r['host']}" for r in s["ranks"])
        )
    elif s.get("ranks"):  # thousands: ranges and hosts, the pids are in --json
        hosts = {r.get("host") for r in s["ranks"]}
        lines.append(
            f"  ranks: {rank_list([r['rank'] for r in s['ranks']], bare=True)} on "
            f"{len(hosts)} host(s) (pids: --json)"
        )
    for f in s.get("open_findings", []):
        detail = {
            k: compact(k, v)  # a rank list as ranges
            for k, v in f.items()
            if k not in ("ts", "kind") and not (k == "ranks_text" and "ranks" in f)
        }
        when = time.strftime("%H:%M:%S", time.localtime(f.get("ts", 0)))
        lines.append(f"  finding {when} {f['kind']}: {json.dumps(detail, default=str)}")
    moves = s.get("transitions") or []
    if moves:
        lines.append(
            "  last state changes: "
            + ", ".join(
                f"{_hms(m.get('ts'))} {m.get('from')} -> {m.get('to')} ({m.get('why')}"
                + ("" if m.get("ok", True) else ", not in the table")
                + ")"
                for m in moves
            )
        )
    if s.get("reason"):
        lines.append(f"  reason: {s['reason']}")
    if s.get("hint"):
        lines.append(f"  hint: {s['hint']}")
    return "\n".join(lines)


def _hms(ts: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if type(ts) in (int, float) else "?"
