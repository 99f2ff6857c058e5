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
    """Real faulted titan-tiny runs shared by every test that reads one (tests/faulted.py); under
    pytest-xdist, by every worker: they live in the workers' common temp folder."""
    from faulted import FaultedRuns

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return FaultedRuns(tmp_path_factory.getbasetemp().parent / "faulted")
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


# ---------------------------------------------------------------- two workers (scripts/test.sh: -n 2)
# pytest-xdist runs each group on one worker: a module's tests stay together (its module fixtures, real
# runs, are made once), and modules that share a machine-wide thing form one group: the Slurm cluster,
# and the code sandbox's uids (test_trl_rewards asserts that no sandbox process is left anywhere).
# Faulted runs are shared across workers through a file lock instead (tests/faulted.py).
SHARED_GROUPS = {
    "test_slurm": "slurm",
    "test_trl_rewards": "sandbox",
    "test_trl_grpo_rewards_train": "sandbox",
    "test_code_forgery": "sandbox",
}
# groups handed out first, longest first (a fresh clone's --durations): a long one last would leave the
# other worker idle at the end; the rest follow in collection order
LONGEST_FIRST = [
    "test_ckpt_e2e", "slurm", "test_diagnose_incidents", "test_trl_catalogue", "test_gpu_check", "test_pipeline",
    "sandbox", "test_install", "test_chaos", "test_byo_script", "test_supervisor_real", "test_titan_train",
    "test_hang_budgets",
]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    group_of = {}
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else item.nodeid.split("::")[0]
        group_of[item.nodeid] = SHARED_GROUPS.get(module, module)
        item.add_marker(pytest.mark.xdist_group(group_of[item.nodeid]))
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(group_of[it.nodeid], len(rank)))  # stable: order within a group kept
