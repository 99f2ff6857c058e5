"""The health checks on one node of a multi-node run: ``srun --ntasks-per-node=1 python -m
ptops.ops.node.health``, one step over every node of the allocation (spares too) before each
attempt.

Why a step of its own and not the node agent: a node that fails must be swapped before the
attempt's ``srun --nodelist`` is formed, and the spares must be known good before one takes a
node's place; one short step answers both (checking inside the agents would start the attempt, tear
it down and start it again).

Input (environment, set by ``ops/slurm/inside.py``): ``PTOPS_HEALTH`` (JSON: the
:class:`~ptops.ops.supervisor.health.Context` of :meth:`~Context.to_dict`, plus ``out`` the
attempt's report folder, ``skip`` the checks not to run, ``clock_offsets`` {node: seconds} the
injected ``clock-skew`` faults, ``xid_marks`` {node: [boot id, kernel log record]} where each
node's previous check stopped reading) and ``PTOPS_HEALTH_TOKEN`` (the clock server's).
Output: one file ``<out>/<node>.json`` (``{"node", "results": [...], "injected": [...],
"xid_seen"}``), written whole or not at all: the run directory is on the shared filesystem a
checkpoint needs anyway, and a node whose file is missing failed (``report``). The exit code is 0
whatever the checks said.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from ptops import envnames
from ptops.ops.supervisor import health


def node_name(env: dict[str, str]) -> str:
    """Slurm's name for this node (what --nodelist and --exclude take)."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def check(env: dict[str, str]) -> dict:
    """Run the table here; the report this node writes."""
    spec = json.loads(env[envnames.HEALTH])
    node = node_name(env)
    if not node or "/" in node or node.startswith("."):
        raise ValueError(f"node name {node!r} cannot name a report file")
    offset = float((spec.get("clock_offsets") or {}).get(node, 0.0))
    mark = (spec.get("xid_marks") or {}).get(node)
    ctx = health.Context.from_dict(
        {**spec, "clock_offset_s": offset, "xid_mark": mark}, env.get(envnames.HEALTH_TOKEN, "")
    )
    results = health.run_checks(ctx, spec.get("skip") or [])
    injected = [f"clock-skew:node={node},offset_s={offset:g}"] if offset else []
    return {
        "node": node,
        "results": [r.to_dict() for r in results],
        "injected": injected,
        "xid_seen": ctx.xid_seen,
    }


def main() -> None:
    env = dict(os.environ)
    try:
        report = check(env)
    except (KeyError, ValueError, TypeError) as e:
        print(f"error: {envnames.HEALTH}: {e}", file=sys.stderr)
        sys.exit(2)
    out = Path(json.loads(env[envnames.HEALTH])["out"])
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{report['node']}.json.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out / f"{report['node']}.json")
    failed = [r["name"] for r in report["results"] if r["ok"] is False]
    print(f"ptops.node.health {report['node']}: {'failed ' + ','.join(failed) if failed else 'ok'}")


if __name__ == "__main__":
    main()
