"""``ptops launch RECIPE --supervise --slurm``: write the sbatch script into the run directory,
print it (``--dry-run``) or submit it (``sbatch --parsable``) and record ``slurm_submitted``. The
supervisor then runs inside the job (``ptops.ops.slurm.inside``); ``ptops status RUN`` follows it
from the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def overrides(nodes, gpus_per_node, spare_nodes, partition, time_, account, qos) -> list[str]:
    """CLI flags as ``--set`` values (they win over the recipe's ``[slurm]``)."""
    out = []
    for key, value in (
        ("nodes", nodes),
        ("gpus_per_node", gpus_per_node),
        ("spare_nodes", spare_nodes),
    ):
        if value is not None:
            out.append(f"slurm.{key}={int(value)}")
    for key, value in (
        ("partition", partition),
        ("time", time_),
        ("account", account),
        ("qos", qos),
    ):
        if value is not None:
            out.append(f"slurm.{key}={json.dumps(value)}")
    if gpus_per_node:
        out.append(f"launch.nproc={int(gpus_per_node)}")  # one rank per GPU
    return out


def run(rec, path: Path, target: Path, faults: list[str], dry_run: bool, json_out: bool) -> int:
    from ptops.ops.slurm import commands, sbatch
    from ptops.ops.supervisor import launcher

    nodes, per_node, spares = sbatch.world(rec)
    if dry_run:
        text = sbatch.script(rec, target, faults, cwd=Path.cwd())
        if json_out:
            typer.echo(
                json.dumps(
                    {
                        "sbatch": text,
                        "nodes": nodes,
                        "ranks_per_node": per_node,
                        "spare_nodes": spares,
                        "world_size": nodes * per_node,
                    }
                )
            )
        else:
            typer.echo(text, nl=False)
        return 0
    run = launcher.prepare_run(rec, path, target)
    script = sbatch.write(rec, run.path, faults, cwd=Path.cwd())
    job = commands.submit(str(script))
    run.event(
        "slurm_submitted",
        job_id=job,
        script=str(script),
        nodes=nodes,
        spare_nodes=spares,
        exclude=list(rec.slurm.exclude),
    )
    if json_out:
        typer.echo(json.dumps({"job_id": job, "run_dir": str(run.path), "script": str(script)}))
    else:
        typer.echo(
            f"ptops: submitted Slurm job {job}: {rec.name} on {nodes} node(s) x {per_node} rank(s)"
            + (f" + {spares} spare" if spares else "")
            + f" -> {run.path}",
            err=True,
        )
        typer.echo(
            f"  follow it: ptops status {run.path}   (job output: {run.path}/slurm/job-{job}.out)",
            err=True,
        )
    return 0
