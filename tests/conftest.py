import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PTOPS = [sys.executable, "-m", "ptops"]


def run_ptops(*args: str, timeout: float = 600, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([*PTOPS, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"ptops {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def ptops():
    return run_ptops


def pytest_report_header(config):
    return [f"ptops repo: {REPO}", f"CI={os.environ.get('CI', '')}"]


@pytest.fixture(scope="session")
def have(request):
    """Look up a program; under CI a missing program is a failure, elsewhere a skip with a reason."""

    def _have(program: str) -> str:
        path = shutil.which(program)
        if path:
            return path
        if os.environ.get("CI") == "true":
            pytest.fail(f"{program} is not installed (CI must install it through scripts/setup.sh)")
        pytest.skip(f"{program} is not installed; run scripts/setup.sh")

    return _have


@pytest.fixture(scope="session")
def faulted_runs(tmp_path_factory):
    """Real faulted titan-tiny runs shared by every test that reads one (tests/faulted.py)."""
    from faulted import FaultedRuns

    return FaultedRuns(tmp_path_factory.mktemp("faulted"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real 3-node Slurm (scripts/slurm_cluster.sh) shared by every Slurm test; removed at the end."""
    from slurm_cluster import Cluster

    cluster = Cluster.start(nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()
