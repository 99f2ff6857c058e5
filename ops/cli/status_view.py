"""``ptops status``'s human view of :func:`ptops.ops.runrecord.status.collect` (the data stays in the run-record layer)."""

from __future__ import annotations

import json
import time
from typing import Any


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
