"""What many tests do: launch a TRL recipe the plain way and read what it left, and check that a
command failed with one clear line. Imported by name (pyproject: pytest's ``pythonpath``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from ptops.ops.runrecord.rundir import RunDir, final_metrics_by_step

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NPROC = 2  # the tiny TRL recipes' ranks


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def launch(
    recipe: str, run_dir: Path, overrides: list[str], attempt: int = 1, faults: list[str] = ()
):
    """``ptops launch RECIPE --run-dir D --set ...`` (plain, unsupervised); rerun on D resumes."""
    cmd = [str(BIN / "ptops"), "launch", recipe, "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    for f in faults:
        cmd += ["--fault", f]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PTOPS_RANK_LOGS", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(
        f"--- rank {k} ---\n{tail(run_dir / 'logs' / f'attempt-{attempt}' / f'rank-{k}.log')}"
        for k in range(NPROC)
    )
    return proc, logs


def assert_launched(proc, logs: str) -> None:
    assert proc.returncode == 0, (
        f"ptops launch exit {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-2000:]}\n{logs}"
    )


def records_by_rank(run_dir: Path) -> dict[int, dict[int, dict]]:
    records = RunDir(run_dir).read_metrics()
    return {rank: final_metrics_by_step(records, rank) for rank in range(NPROC)}


def is_finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def trl_checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("checkpoint-*"))


def assert_one_clear_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    for n in needles:
        assert n in err, (n, err)


def offline_supervisor(tmp_path: Path, nproc: int):
    """A titan-tiny ``Supervisor`` in attempt 1 with no channel (sends succeed, nothing is sent) and
    a fresh hang monitor: for driving its message handlers directly."""
    import io

    from ptops.monitors.hang import HangMonitor
    from ptops.ops.supervisor import Supervisor
    from ptops.recipes.schema import load

    class _Server:
        def send(self, peer, msg):
            return True

        def address(self, advertise=""):
            return "127.0.0.1:1"

    rec, _ = load("titan-tiny", [f"launch.nproc={nproc}"])
    sup = Supervisor(
        rec, RunDir(tmp_path / "run").create(), [], out=io.StringIO(), strategy="temporary"
    )
    sup.server, sup.attempt, sup.misconfigured = _Server(), 1, None
    sup.monitor = HangMonitor(nproc, 0.0, rec.supervisor.hang)
    return sup


def source_tree(dest: Path) -> Path:
    """This checkout's files as a user's source tree (no git, venvs, builds or runs): pip builds a
    local directory in place (``build/``), which must not land in the repository others scan."""
    import shutil

    skip = {".git", "build", "runs", "__pycache__", "mlruns", "mlartifacts"}
    shutil.copytree(
        REPO,
        dest,
        ignore=lambda d, names: [
            n for n in names if n in skip or n.startswith(".venv") or n.endswith(".egg-info")
        ],
    )
    return dest
