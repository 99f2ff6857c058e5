"""Slurm driven through its commands (``sbatch``, ``srun``, ``scontrol``, ``squeue``): parsable text
only.

Why commands and not a library: pyslurm does not build against Debian's Slurm 22.05, and the
commands are what an on-call engineer would type. Every call has a timeout and raises
:class:`SlurmError` with the command's own message.
"""

from __future__ import annotations

import os
import shutil
import subprocess


class SlurmError(RuntimeError):
    pass


def _run(argv: list[str], timeout: float = 30.0) -> str:
    if shutil.which(argv[0]) is None:
        raise SlurmError(
            f"{argv[0]} not found: is Slurm's client installed (apt-get install slurm-client)?"
        )
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
    if out.returncode != 0:
        raise SlurmError(f"{' '.join(argv)}: {(out.stderr or out.stdout).strip()[:500]}")
    return out.stdout


def submit(script: str, extra: list[str] | None = None) -> str:
    """``sbatch --parsable SCRIPT`` -> the job id."""
    out = _run(["sbatch", "--parsable", *(extra or []), script]).strip()
    return out.split(";")[0]


def hostnames(nodelist: str) -> list[str]:
    """``n[1-3],m7`` -> ``[n1, n2, n3, m7]`` (``scontrol show hostnames``)."""
    if not nodelist:
        return []
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def requeue(job_id: str) -> None:
    _run(["scontrol", "requeue", job_id])


def cancel(job_id: str, signal: str | None = None, batch: bool = False) -> None:
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    _run([*argv, job_id])


def job_state(job_id: str) -> tuple[str, str]:
    """(state, node list) of a job from ``squeue``; ("", "") once it left the queue."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%N"]).strip()
    if not out:
        return "", ""
    state, _, nodes = out.splitlines()[0].partition("|")
    return state, nodes


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))
