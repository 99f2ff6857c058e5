"""`ptops warm`: a standing pool forks the ranks of every attempt of a launch that names it, and
they end where cold ranks end; a launch the pool does not fit starts cold and says why."""

import json
import os
from pathlib import Path

import pytest
from conftest import run_ptops, start_standing_pool, stop_standing_pool
from faulted import HOLD_COMMITTED, STEPS

from ptops.ckpt import digest
from ptops.ops.rank.warm import WARM_LINE
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.supervisor.warmpool import WarmPool
from ptops.recipes.schema import load


@pytest.fixture(scope="module")
def standing_pool(standing_pool, tmp_path_factory):
    """The session's pool, or (``PTOPS_TESTS_COLD=1``: none) one of this module's own: what these
    tests check is the standing pool itself."""
    if standing_pool:
        yield standing_pool
        return
    name, logs = f"ptops-tests-own-{os.getpid()}", tmp_path_factory.mktemp("warm")
    proc = start_standing_pool(name, logs, engines=("titan",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PTOPS_STANDING_POOL", name)
        yield name
    stop_standing_pool(proc, logs)


def _launches(run: Path) -> list[dict]:
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in ev if e["kind"] == "launch"]


def test_a_crashed_run_from_the_standing_pool_ends_where_a_cold_run_ends(
    standing_pool, faulted_runs, tmp_path
):
    ref = faulted_runs.get("reference")  # cold: torchrun, no pool
    run = tmp_path / "run"
    p = run_ptops(
        "launch", "titan-tiny", "--supervise", "--run-dir", str(run), *STEPS, "--no-mlflow",
        "--fault", "crash:rank=1,step=12", "--fault", HOLD_COMMITTED, "--json", timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    pool = f"{standing_pool}-titan"
    got = [(e["attempt"], e["ranks_from"], e.get("standing_pool")) for e in _launches(run)]
    assert got == [(1, "warm", pool), (2, "warm", pool)], got
    assert digest(run / "checkpoints" / "step-16") == digest(ref.run / "checkpoints" / "step-16")
    for attempt in (1, 2):
        log = (run / "logs" / f"attempt-{attempt}" / "rank-0.log").read_text(errors="replace")
        assert WARM_LINE.split("{")[0] in log, log[-2000:]


def test_the_sweeps_find_the_ranks_a_standing_pool_forked_for_a_run(standing_pool, tmp_path):
    """A forked child shows the pool's exec environment in /proc/PID/environ; it writes its run's
    PTOPS_RUN_DIR into the pool's blank slot (ops/rank/environslot.py), so the supervisor's
    sweeps (and the no-orphan checks of the tests and of `ptops chaos`) see it like a cold rank."""
    import subprocess
    import time

    from conftest import PTOPS, REPO

    from ptops.ops.rank.warm import describe
    from ptops.ops.supervisor.procs import run_processes

    run = tmp_path / "run"
    args = ["launch", "titan-tiny", "--supervise", "--run-dir", str(run), "--no-mlflow"]
    args += ["--set", "train.steps=4", "--fault", "hold:step=2,seconds=300"]
    proc = subprocess.Popen([*PTOPS, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pool = describe(f"{standing_pool}-titan")["pid"]

        def parent(pid: int) -> int:
            try:
                return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                return 0

        deadline = time.monotonic() + 300
        while len([p for p in run_processes(run) if parent(p) == pool]) < 2:  # both ranks
            assert proc.poll() is None and time.monotonic() < deadline, run_processes(run)
            time.sleep(0.2)
        assert run_ptops("inject", str(run), "release").returncode == 0
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    assert run_processes(run) == []


def test_a_launch_the_pool_does_not_fit_starts_cold_and_says_why(standing_pool, tmp_path):
    run = RunDir(tmp_path / "run")
    fits, _ = load("titan-tiny")
    assert WarmPool(fits, run, standing=standing_pool).source(5, lambda: False) == {
        "ranks_from": "warm",
        "warm_wait_s": 0.0,
        "standing_pool": f"{standing_pool}-titan",
    }
    threads, _ = load("titan-tiny", ["launch.omp_num_threads=2"])
    got = WarmPool(threads, run, standing=standing_pool).source(5, lambda: False)
    assert got["ranks_from"] == "cold" and got["cold_why"] == "standing_pool_differs", got
    assert "OMP_NUM_THREADS" in got["cold_detail"] and "'2'" in got["cold_detail"], got
    gone = WarmPool(fits, run, standing=f"{standing_pool}-none").source(5, lambda: False)
    assert gone["cold_why"] == "standing_pool_gone" and "-none-titan" in gone["cold_detail"], gone


def test_a_dry_run_forked_from_the_standing_pool_answers_what_a_cold_one_answers(standing_pool):
    """`--dry-run` builds the model in a subprocess; with a standing pool that fits, that process
    is forked from it (seconds, not ~13 CPU-s of imports) and the report is the same."""
    dry = ("launch", "llama3-8b-h100", "--dry-run", "--json")
    warm = run_ptops(*dry, timeout=600)
    cold = run_ptops(*dry, env={"PTOPS_STANDING_POOL": None}, timeout=600)
    assert warm.returncode == 0 and cold.returncode == 0, warm.stderr + cold.stderr
    w, c = json.loads(warm.stdout)["torchtitan"], json.loads(cold.stdout)["torchtitan"]
    assert w.pop("warm_pool") == f"{standing_pool}-titan" and "warm_pool" not in c
    timing = ("seconds", "peak_rss_gib", "titan_peak_memory_gib")  # this process', not the model's
    assert {k: v for k, v in w.items() if k not in timing} == {
        k: v for k, v in c.items() if k not in timing
    }
    human = run_ptops("launch", "llama3-8b-h100", "--dry-run", timeout=600)
    assert f"forked from the standing pool {standing_pool}-titan" in human.stdout, human.stdout


def test_ptops_warm_refuses_an_unknown_engine_in_one_line():
    p = run_ptops("warm", "nosuch", env={"PTOPS_STANDING_POOL": None}, timeout=120)
    assert p.returncode == 2 and "unknown engine 'nosuch'" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_launch_the_pool_does_not_fit_keeps_its_own_pool_and_says_why(standing_pool, tmp_path):
    """The supervisor asks once, before the first attempt: a pool of another engine (or one that
    differs) is not used, and the run keeps the warm pool it would have had without one."""
    import io

    from ptops.ops.supervisor import Supervisor

    out = io.StringIO()
    keep = ["supervisor.restart.warm_spare=true", "launch.omp_num_threads=2"]
    rec, _ = load("titan-tiny", keep)
    sup = Supervisor(rec, RunDir(tmp_path / "a").create(), [], out=out)
    assert sup.warm is not None and not sup.warm.standing  # the run's own pool
    assert "standing warm pool not used (standing_pool_differs)" in out.getvalue()
    rec, _ = load("titan-tiny")
    sup = Supervisor(rec, RunDir(tmp_path / "b").create(), [], out=io.StringIO())
    assert sup.warm is not None and sup.warm.standing == f"{standing_pool}-titan"
