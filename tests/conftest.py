import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# tests/ holds the helpers, data/, snapshots/ and the worker scripts; the test modules are one
# folder below, by concern (tests/supervisor/, tests/obs/, ...): paths come from here, not __file__
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PTOPS = [sys.executable, "-m", "ptops"]


def supervisor_without_ranks(tmp_path: Path, sets: list[str], world: int):
    """The real ``Supervisor`` of titan-tiny with ``sets``, attempt 1, a hang monitor for
    ``world`` ranks and a server stub that accepts every send: a test feeds ``handle`` itself."""
    import io

    from ptops.monitors.hang import HangMonitor
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor import Supervisor
    from ptops.recipes.schema import load

    rec, _ = load("titan-tiny", sets)
    run = RunDir(tmp_path / "run").create()
    sup = Supervisor(rec, run, [], out=io.StringIO(), strategy="temporary")

    class Server:
        def send(self, peer, msg):
            return True

        def address(self, advertise=""):
            return "127.0.0.1:1"

    sup.server, sup.attempt = Server(), 1
    sup.monitor = HangMonitor(world, 0.0, rec.supervisor.hang)
    return sup, run


def run_ptops(
    *args: str, timeout: float = 600, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would (``env``: a value of None unsets)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run(
        [*PTOPS, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"ptops {' '.join(args)} exited "
            f"{proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@pytest.fixture
def ptops():
    return run_ptops


def pytest_report_header(config):
    return [f"ptops repo: {REPO}", f"CI={os.environ.get('CI', '')}"]


# ------------------------------------------------------------------- the session's standing pools
# Most of a small launch is its ranks importing torch and the engine (~10 CPU-s each here): the
# session keeps one `ptops warm` (titan, trl and script pools) and every launch starts its ranks
# from it,
# the first attempt included. Tests of the cold path (torchrun, the run's own pool) say
# `pytest.mark.cold`, on the test or the module; PTOPS_TESTS_COLD=1 runs everything cold.
STANDING = "PTOPS_STANDING_POOL"


def _die_with_pytest() -> None:
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def engines_here() -> tuple[str, ...]:
    """The engines whose packages are installed here (the version matrix's oldest end has no
    TorchTitan: its torch is below [titan]'s range)."""
    import importlib.util

    need = {"titan": "torchtitan", "trl": "trl"}
    return tuple(
        e for e in ("titan", "trl", "script") if e not in need or importlib.util.find_spec(need[e])
    )


def start_standing_pool(name: str, logs: Path, engines=None):
    """A real `ptops warm` (its pools die with pytest); returns it once every pool answers."""
    engines = engines_here() if engines is None else engines
    warm = ["warm", *engines, "--name", name, "--log-dir", str(logs), "--json"]
    proc = subprocess.Popen(
        [*PTOPS, *warm],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        preexec_fn=_die_with_pytest,  # a killed session leaves no pool behind (pools die with it)
    )
    line = proc.stdout.readline()  # `--json`: one line once every pool answers, EOF if one fails
    if not line:
        proc.wait()
        raise RuntimeError(
            f"`ptops warm` exited {proc.returncode} before its pools were ready: {logs}"
        )
    return proc


def stop_standing_pool(proc, logs: Path) -> None:
    if proc.poll() is not None:  # launches after its death started cold (slower, still right)
        import warnings

        warnings.warn(f"the standing pool exited {proc.returncode} during the session: {logs}")
    proc.terminate()
    proc.wait(timeout=30)


# MLflow costs a launch ~5 s and ~6 CPU-s (its import and the SQLite store's schema check), more
# than a warm tiny run: it is off (PTOPS_MLFLOW=0) unless a test turns it on (`--mlflow`) or runs
# cold, which is a user's default path in full.
MLFLOW = "PTOPS_MLFLOW"


@pytest.fixture(scope="session", autouse=True)
def _strict_transitions():
    """The supervisors tests run in this process raise on a state change outside the table
    (ops/supervisor/states.py); in production it is one line and the run goes on."""
    from ptops.ops.supervisor.core import Supervisor

    Supervisor.strict_transitions = True
    yield
    Supervisor.strict_transitions = False


@pytest.fixture(scope="session", autouse=True)
def standing_pool(tmp_path_factory):
    if os.environ.get("PTOPS_TESTS_COLD") == "1":
        os.environ.pop(STANDING, None)
        os.environ.pop(MLFLOW, None)
        yield None
        return
    os.environ[MLFLOW] = "0"
    name = f"ptops-tests-{os.getpid()}"
    logs = tmp_path_factory.mktemp("warm")
    proc = start_standing_pool(name, logs)
    os.environ[STANDING] = name
    yield name
    os.environ.pop(STANDING, None)
    os.environ.pop(MLFLOW, None)
    stop_standing_pool(proc, logs)


def _cold_scope(node):
    """Without the standing pool while ``node`` (a module or a test marked ``cold``) runs."""
    if node.get_closest_marker("cold") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(STANDING, raising=False)
        mp.delenv(MLFLOW, raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def _cold_module(request, standing_pool):
    yield from _cold_scope(request.node)


@pytest.fixture(autouse=True)
def _cold_test(request, _cold_module):
    yield from _cold_scope(request.node)


@pytest.fixture(scope="session")
def have(request):
    """Look up a program; under CI a missing program is a failure, elsewhere a skip with a
    reason."""

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

    return FaultedRuns(shared_dir(tmp_path_factory) / "faulted")


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real 3-node Slurm (scripts/slurm_cluster.sh) shared by every Slurm test; removed at the
    end."""
    from slurm_cluster import Cluster

    cluster = Cluster.start(nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


# -------------------------------------------------------------- two workers (scripts/test.sh: -n 2)
# pytest-xdist with --dist loadfile: a module's tests stay on one worker, so its module fixtures
# (real runs) are made once. (loadgroup would also join modules, but with pytest 9 it does not group
# at all: tried.) What several modules share is shared through the workers' common temp folder
# instead: faulted runs (tests/faulted.py) and the `machine_lock` below. The Slurm cluster has one
# module, test_slurm.py.

# modules handed out first, longest first (a fresh clone's --durations): a long one last would leave
# the other worker idle at the end; the rest follow in collection order
LONGEST_FIRST = [
    "test_ckpt_e2e",
    "test_slurm",
    "test_diagnose_incidents",
    "test_trl_catalogue",
    "test_gpu_check",
    "test_pipeline",
    "test_install",
    "test_trl_grpo_rewards_train",
    "test_chaos",
    "test_byo_script",
    "test_supervisor_real",
    "test_titan_train",
    "test_hang_budgets",
    "test_trl_rewards",
    "test_code_forgery",
]


# The extended run: tests that leave the default run (CI's) because a default test covers the same
# path and they only repeat it for another recipe or driver; each says which default test covers
# it. Run them with `bash scripts/test.sh -m extended` before resolving an issue that touches what
# they name (the TRL recipes, the GPU check's drivers). Every entry must name a test that exists.
EXTENDED = {
    "tests/trl/test_vllm_engine.py::test_rloo_with_a_colocated_engine_recovers_a_crash_exactly": (
        "the engine seam's exact recovery: test_colocate_engine_recovers_... (GRPO, same seam)"
    ),
    "tests/trl/test_vllm_engine.py::test_server_engine_recovery_ends_at_the_uninterrupted_digest": (
        "the server engine's exact recovery: its redone steps match attempt 1's "
        "(test_server_engine_outlives_...); the colocate engine's digest: test_colocate_engine_..."
    ),
    "tests/trl/test_trl_catalogue.py::test_lora_sft_trains_adapters_and_resumes_exactly": (
        "the TRL adapter's crash-resume: test_trl_train (SFT kill/resume), test_supervisor_real"
    ),
    "tests/trl/test_trl_catalogue.py::test_reward_model_trains_and_resumes_exactly": (
        "the TRL adapter's crash-resume: test_trl_train, test_trl_grpo_rewards_train (code)"
    ),
    (
        "tests/trl/test_trl_catalogue.py::"
        "test_rloo_trains_with_the_verifiable_reward_and_resumes_exactly"
    ): "RL with a verifiable reward, crashed and resumed: test_grpo_code_trains_and_resumes_...",
    "tests/trl/test_trl_grpo_rewards_train.py::test_grpo_math_trains_and_resumes_exactly": (
        "the GRPO reward path: test_grpo_code_trains_and_resumes_exactly; the math verifier: "
        "test_trl_rewards"
    ),
    "tests/trl/test_trl_grpo_rewards_train.py::test_grpo_judge_trains_and_resumes_exactly": (
        "the GRPO reward path: test_grpo_code_trains_and_resumes_exactly; judge: test_trl_rewards"
    ),
    "tests/supervisor/test_supervisor_real.py::test_trl_sft_crash_restarts_from_checkpoint": (
        "the same supervised trl-sft-tiny crash at step 12, restart from step 10, equal digest and "
        "no process left: test_warm::test_trl_restart_from_a_warm_pool_is_exact"
    ),
    "tests/install/test_gpu_check.py::test_gpu_check_driver_on_cpu_smoke": (
        "titan crash/hang/async save: faulted runs (tests/faulted.py); the one-call driver and its "
        "stages: test_script_stage_driver_on_cpu_smoke, test_a_stage_over_its_budget_is_cut_..."
    ),
    "tests/install/test_gpu_check.py::test_trl_gpu_check_driver_on_cpu_smoke": (
        "trl-sft-tiny crash and exact resume: test_supervisor_real, test_trl_train"
    ),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}

    def module(item) -> str:
        return item.nodeid.split("::")[0].rpartition("/")[2].removesuffix(".py")

    # stable: a module's own order is kept
    items.sort(key=lambda it: rank.get(module(it), len(rank)))
    seen = set()
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
            seen.add(item.nodeid)
    # a moved or renamed module: checked on every run, whatever is selected
    modules = {f.stem for f in TESTS.glob("*/test_*.py")}
    gone = [n for n in EXTENDED if not (REPO / n.split("::")[0]).is_file()]
    gone += [m for m in LONGEST_FIRST if m not in modules]
    if gone:
        raise pytest.UsageError(
            f"tests/conftest.py EXTENDED or LONGEST_FIRST names modules that do not exist: {gone}"
        )
    files = {it.nodeid.split("::")[0] for it in items}
    stale = [n for n in EXTENDED if n.split("::")[0] in files and n not in seen]
    if stale and not (config.option.keyword or config.args != config.getini("testpaths")):
        raise pytest.UsageError(
            f"tests/conftest.py EXTENDED names tests that do not exist: {stale}"
        )


def shared_dir(tmp_path_factory) -> Path:
    """A folder every worker of this session sees (its own temp folder when there are no
    workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module")
def sandbox_lock(tmp_path_factory):
    """Held for a whole module that runs the code sandbox or asserts that none of its processes is
    left anywhere: with two workers, one module's sandboxes would be the other's "left over"
    processes."""
    import fcntl

    with open(shared_dir(tmp_path_factory) / "sandbox.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
