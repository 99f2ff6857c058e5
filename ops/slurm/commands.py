"""Slurm driven through its commands (``sbatch``, ``srun``, ``scontrol``, ``squeue``): parsable text
only.

Why commands and not a library: pyslurm does not build against Debian's Slurm 22.05, and the
commands are what an on-call engineer would type. Every call has a timeout and raises
:class:`SlurmError` with the command's own message.
"""

from __future__ import annotations

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
