"""The sbatch script of a supervised multi-node run: written into the run directory, printed by
``--dry-run``.

Why these directives (each one is checked by ``tests/slurm/test_slurm_dryrun.py``):

- ``--nodes=N+K``: the ranks' nodes plus K spares held for replacing blamed nodes in-job;
- ``--ntasks-per-node=1``: one node agent per node; the agent starts that node's ranks;
- ``--gpus-per-node=G``: only when GPUs are asked for;
- ``--signal=B:USR1@S``: the warning before the time limit (or preemption) goes to the batch shell
  only (``B:``), which ``exec``s the supervisor, so the supervisor itself receives it;
- ``--requeue``: the supervisor requeues its own job after a preemption save;
- ``--open-mode=append``: a requeued job appends to the same output file instead of truncating it;
- ``--exclude``: nodes that must not be used (the recipe's, and blamed ones on a resubmit).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

SCRIPT_NAME = "job.sbatch"


def world(recipe) -> tuple[int, int, int]:
    """(nodes, ranks per node, spare nodes) of a Slurm launch."""
    s = recipe.slurm
    per_node = s.gpus_per_node or recipe.launch.nproc
    return s.nodes, per_node, s.spare_nodes


def script(
    recipe, run_dir: Path, faults: list[str], python: str | None = None, cwd: Path | None = None
) -> str:
    s = recipe.slurm
    nodes, per_node, spares = world(recipe)
    run_dir = Path(run_dir).resolve()
    lines = [
        "#!/bin/bash",
        f"# ptops: {recipe.name} on {nodes} node(s) x {per_node} rank(s)"
        + (f" + {spares} spare node(s)" if spares else "")
        + "; the supervisor runs in this batch step (ptops.ops.slurm.inside)",
        f"#SBATCH --job-name=ptops-{recipe.name}",
        f"#SBATCH --nodes={nodes + spares}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    for flag, value in (
        ("partition", s.partition),
        ("time", s.time),
        ("account", s.account),
        ("qos", s.qos),
    ):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        f"#SBATCH --signal=B:USR1@{s.signal_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={run_dir}/slurm/job-%j.out",
    ]
    if cwd is not None:
        lines.append(f"#SBATCH --chdir={Path(cwd).resolve()}")
    if s.exclude:
        lines.append(f"#SBATCH --exclude={','.join(s.exclude)}")
    lines += [f"#SBATCH {a}" for a in s.sbatch_args]
    args = [python or sys.executable, "-P", "-m", "ptops.ops.slurm.inside", str(run_dir)]
    for f in faults:
        args += ["--fault", f]
    lines += [
        "",
        "export PYTHONUNBUFFERED=1",
        "# exec: the supervisor is the batch shell, so Slurm's USR1 (B:) and scancel's TERM "
        "reach it",
        "exec " + " ".join(shlex.quote(a) for a in args),
        "",
    ]
    return "\n".join(lines)


def write(recipe, run_dir: Path, faults: list[str], cwd: Path | None = None) -> Path:
    path = Path(run_dir) / "slurm" / SCRIPT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script(recipe, run_dir, faults, cwd=cwd))
    path.chmod(0o700)
    return path
