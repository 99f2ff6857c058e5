"""Warm spare ranks (ops/rank/warm.py): a rank handed to the pool behaves, to torchrun and the
supervisor, like the rank itself: same stdout/env/argv/cwd, same exit status (a signal death
included), signals forwarded, and the warm child dies with the thin rank. No torch here: the pool's
child runs a stub."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ops.rank import warm as warm_mod

pytestmark = pytest.mark.cold  # the run's own pool and torchrun are what these test


POOL = textwrap.dedent("""
    import os, signal, sys, time
    from ptops.ops.rank import warm

    def stub():
        how = os.environ["STUB"]
        print("child", os.getpid(), os.environ.get("MARK"), sys.argv[1:], os.getcwd(), flush=True)
        if how == "exit":
            if "RANK" in os.environ:  # warmlaunch: one file per rank (their stdout lines may interleave)
                open(os.environ["PIDFILE"] + "-exit-" + os.environ["RANK"], "w").close()
            os._exit(int(os.environ["CODE"]))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "rank":  # warmlaunch: rank 1 fails with CODE, the others wait to be stopped
            if os.environ["RANK"] == "1":  # once the others are up (no race with their start)
                others = [os.environ["PIDFILE"] + r for r in ("0", "2")]
                while not all(os.path.exists(f) for f in others):
                    time.sleep(0.05)
                os._exit(int(os.environ["CODE"]))
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            mine = os.environ["PIDFILE"] + os.environ["RANK"]
            with open(mine + ".tmp", "w") as f:
                f.write(os.environ["WORLD_SIZE"] + " " + os.environ["MASTER_PORT"])
            os.rename(mine + ".tmp", mine)
            while True:
                time.sleep(0.1)
        if how == "wait":  # warmlaunch: each rank waits; SIGUSR1 fails it (exit 1), SIGTERM stops it
            signal.signal(signal.SIGUSR1, lambda *a: os._exit(1))
            signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
            mine = os.environ["PIDFILE"] + os.environ["RANK"]
            with open(mine + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(mine + ".tmp", mine)
            while True:
                time.sleep(0.1)
        if how == "exec":  # no Python left in the child: its own watchdog thread is gone too
            with open(os.environ["PIDFILE"], "w") as f:
                f.write(str(os.getpid()))
            os.execv("/bin/sleep", ["sleep", "600"])
        if how == "term":
            signal.signal(signal.SIGTERM, lambda *a: (print("child got SIGTERM", flush=True), os._exit(7)))
        with open(os.environ["PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.1)

    warm.serve(sys.argv[1], "stub", target=stub)
""")  # noqa: E501

THIN = textwrap.dedent("""
    import sys
    from ptops.ops.rank import warm
    warm.handoff()
    print("cold", flush=True)
""")


@pytest.fixture
def pool(tmp_path):
    name = f"ptops-warm-test-{secrets.token_hex(6)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", POOL, name], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    line = proc.stderr.readline()  # the pool's log lines (ranklog: stderr; warm.log has both)
    assert line.startswith("[ptops.warm] ") and " ready " in line, (
        f"the pool did not come up: {line!r}"
    )
    yield name
    proc.kill()
    proc.wait()


def thin(name: str | None, tmp_path: Path, stub: str, **env: str) -> subprocess.Popen:
    e = dict(os.environ, STUB=stub, MARK="m1", PIDFILE=str(tmp_path / "pid"), **env)
    if name:
        e["PTOPS_WARM_SOCKET"] = name
    return subprocess.Popen(
        [sys.executable, "-c", THIN, "a", "b"],
        cwd=tmp_path,
        env=e,
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_file(p: Path, proc: subprocess.Popen) -> int:
    for _ in range(600):
        if p.exists() and p.read_text():
            return int(p.read_text())
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("the warm child never started")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a request as another user")
def test_a_request_from_another_user_is_refused_and_starts_nothing(pool, tmp_path):
    """Anyone on the host can connect to an abstract socket; the pool serves only its own user."""
    tmp_path.chmod(0o777)
    p = thin(pool, tmp_path, "exit", CODE="0")
    p.kill()
    p.wait()  # the pool answers this one (same user)
    pid = os.fork()
    if pid == 0:  # a stranger: another uid asks for a child
        try:
            os.setgid(65534)
            os.setuid(65534)
            warm_mod.request(pool, {"STUB": "exit", "CODE": "0"}, ["x"])
        except (OSError, ValueError, KeyError):
            os._exit(0)  # refused
        os._exit(1)  # served
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "a stranger got a warm child"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_pool_name_taken_by_another_user_gets_no_rank():
    """The abstract name goes to whoever binds it first: a rank does not hand its stdio, env and
    token to a pool of another user (it starts cold instead)."""
    name = f"ptops-warm-squat-{secrets.token_hex(4)}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setgid(65534)
        os.setuid(65534)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind("\0" + name)
        srv.listen(4)
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        os.read(r, 1)
        with pytest.raises(PermissionError):
            warm_mod.describe(name, timeout_s=5)
        with pytest.raises(PermissionError):
            warm_mod.request(name, {}, ["x"])
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_pool_runs_no_module_but_ptops_dry_runs_and_keeps_serving(pool, tmp_path):
    """A request may name a module instead of a rank: only ptops's own dry runs are run."""
    assert "ptops.recipes.titan.dryrun" in warm_mod.MODULES
    with pytest.raises(OSError):  # the pool closes the request: no child
        warm_mod.request(pool, dict(os.environ), ["http.server"], module="http.server")
    p = thin(pool, tmp_path, "exit", CODE="3")  # the pool still serves ranks
    assert p.wait(timeout=60) == 3


def test_no_pool_means_cold_start(tmp_path):
    p = thin(f"ptops-warm-none-{secrets.token_hex(4)}", tmp_path, "exit", CODE="0")
    assert p.communicate(timeout=60)[0].strip() == "cold" and p.returncode == 0


def test_exit_code_stdout_env_argv_cwd_are_the_childs(pool, tmp_path):
    p = thin(pool, tmp_path, "exit", CODE="3")
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 3, out
    words = out.split()
    assert words[0] == "child" and int(words[1]) != p.pid and "m1" in out and "['a', 'b']" in out
    assert str(tmp_path) in out and "cold" not in out


def test_a_child_killed_by_a_signal_kills_the_thin_rank_the_same_way(pool, tmp_path):
    p = thin(pool, tmp_path, "kill")
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL


def test_signals_are_forwarded_to_the_child(pool, tmp_path):
    p = thin(pool, tmp_path, "term")
    _wait_file(tmp_path / "pid", p)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert "child got SIGTERM" in out and p.returncode == 7, (out, p.returncode)


def test_the_child_dies_with_the_thin_rank(pool, tmp_path):
    p = thin(pool, tmp_path, "sleep")
    child = _wait_file(tmp_path / "pid", p)
    p.kill()
    p.wait()
    # the child's pidfd watchdog SIGKILLs it; the pool reaps it
    assert _gone(child, 30.0), f"warm child {child} outlived its thin rank"


def _gone(pid: int, within_s: float) -> bool:
    """``pid`` is gone within ``within_s`` (else it is SIGKILLed here, so no test leaks it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.kill(pid, 9)
    return False


def test_the_pool_kills_a_child_whose_requester_is_gone(pool, tmp_path):
    """The layer that bounds a standing pool's children (no run directory for sweeps to find):
    the child here exec'd away its own watchdog, so only the pool can end it."""
    p = thin(pool, tmp_path, "exec")
    child = _wait_file(tmp_path / "pid", p)
    for _ in range(100):  # the exec is done when the child's command line is sleep's
        if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"):
            break
        time.sleep(0.05)
    p.kill()
    p.wait()
    assert _gone(child, 10.0), f"warm child {child} outlived its requester"


def launcher(name: str, tmp_path: Path, stub: str, nproc: int = 3, **env: str) -> subprocess.Popen:
    """``ops/rank/warmlaunch.py`` with the stub pool; its fallback (no pool) prints FALLBACK."""
    e = dict(os.environ, STUB=stub, PIDFILE=str(tmp_path / "pid"), PTOPS_WARM_SOCKET=name, **env)
    argv = [
        sys.executable,
        "-m",
        "ptops.ops.rank.warmlaunch",
        "--nproc",
        str(nproc),
        "--port",
        "29999",
        "--",
        sys.executable,
        "-c",
        "print('FALLBACK')",
    ]
    return subprocess.Popen(
        argv, cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_warm_launch_all_ranks_exit_zero(pool, tmp_path):
    p = launcher(pool, tmp_path, "exit", CODE="0")
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and "3 ranks forked from the warm pool" in out, out
    assert sorted(f.name for f in tmp_path.glob("pid-exit-*")) == [
        "pid-exit-0",
        "pid-exit-1",
        "pid-exit-2",
    ]


def test_warm_launch_reports_the_failed_rank_as_torchrun_does_and_stops_the_others(pool, tmp_path):
    """The supervisor reads the failed rank from torchrun's own line (ops/supervisor/blame.py,
    which also reads warmlaunch's as the first death it saw); the others get the rank environment
    torchrun gives them and are stopped (SIGTERM) after the failure."""
    from ptops.ops.supervisor.blame import WARM_EXITED, WARM_FAILED, WORKER_FAILED

    p = launcher(pool, tmp_path, "rank", CODE="5")
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 1, out
    m = WORKER_FAILED.search(out)
    assert m and (m.group(1), m.group(2)) == ("5", "1"), out
    w = WARM_FAILED.search(out)
    assert w and (w.group(1), w.group(2)) == ("5", "1"), out
    for r in (0, 2):
        assert (tmp_path / f"pid{r}").read_text() == "3 29999"
    # the stopped ones' ends (their SIGTERM handler exits 0): blame tells a stopped rank by them
    ended = sorted((e.group(2), e.group(1)) for e in WARM_EXITED.finditer(out))
    assert ended == [("0", "0"), ("2", "0")], out


def test_warm_launch_reading_two_deaths_at_once_names_each_ones_own_end(pool, tmp_path):
    """Rank 1 SIGKILLed and rank 0 failing (exit 1) while warmlaunch is stopped: both statuses come
    in one select. The ``failed`` line then names rank 0 (rank order, no order of death), so each
    other child's own end follows it: rank 1's -9 tells blame no launcher stopped it. Rank 2 is
    stopped as usual; warmlaunch exits 1 without a traceback."""
    from ptops.ops.supervisor.blame import WARM_EXITED, WARM_FAILED

    p = launcher(pool, tmp_path, "wait")
    files = [tmp_path / f"pid{r}" for r in range(3)]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0]
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in files]
    os.kill(p.pid, signal.SIGSTOP)
    try:
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGUSR1)
        for pid in pids[:2]:  # gone (reaped by the pool, whose status lines now wait unread)
            while Path(f"/proc/{pid}").exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
        time.sleep(0.5)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 1 and "Traceback" not in out, out
    w = WARM_FAILED.search(out)
    assert w and (w.group(2), w.group(1)) == ("0", "1"), out
    ended = sorted((e.group(2), e.group(1)) for e in WARM_EXITED.finditer(out))
    assert ended == [("1", "-9"), ("2", "0")], out


def test_warm_launch_without_a_pool_becomes_its_torchrun_fallback(tmp_path):
    p = launcher(f"ptops-warm-none-{secrets.token_hex(4)}", tmp_path, "exit", CODE="0")
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and "did not answer" in out and out.strip().endswith("FALLBACK"), out


def _warm_restart(run: Path, recipe: str, sets: list[str], crash_step: int) -> list[dict]:
    """A supervised run with ``warm_spare`` and a crash of rank 1 at ``crash_step``; returns its
    events (the run must complete). No hold until the pool is ready: a restart that finds it still
    importing waits for it."""
    from conftest import run_ptops

    p = run_ptops(
        "launch",
        recipe,
        "--supervise",
        "--run-dir",
        str(run),
        *sets,
        "--set",
        "supervisor.restart.warm_spare=true",
        "--fault",
        f"crash:rank=1,step={crash_step}",
        "--json",
        "--no-mlflow",
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _assert_warm_attempt_2(run: Path) -> None:
    for r in (0, 1):  # attempt 1 started cold (no pool yet), the restart's ranks were forked warm
        cold = (run / "logs" / "attempt-1" / f"rank-{r}.log").read_text(errors="replace")
        warm = (run / "logs" / "attempt-2" / f"rank-{r}.log").read_text(errors="replace")
        assert (
            "warm rank: forked from pool" not in cold and "warm rank: forked from pool" in warm
        ), warm[:2000]
    launched = (run / "logs" / "attempt-2" / "torchrun.log").read_text(errors="replace")
    assert "2 ranks forked from the warm pool" in launched, launched[
        :2000
    ]  # no torchrun for the restart
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    assert [e["ranks_from"] for e in ev if e["kind"] == "launch"] == ["cold", "warm"]


@pytest.mark.slow
def test_trl_restart_from_a_warm_pool_is_exact(tmp_path):
    """The same for a TRL trainer (accelerate reads torchrun's environment, which the launcher
    sets): the crash is rank 1's, the restart resumes from step 10's checkpoint with ranks forked
    from the pool, the final weights equal an uninterrupted run's and nothing is left running (the
    TRL crash-restart of the default run; test_supervisor_real's cold one is extended)."""
    from conftest import run_ptops

    from ptops.ckpt import digest
    from ptops.ops.supervisor.procs import run_processes

    ref = tmp_path / "ref"
    p = run_ptops("launch", "trl-sft-tiny", "--supervise", "--run-dir", str(ref), "--no-mlflow")
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "warm"
    ev = _warm_restart(run, "trl-sft-tiny", [], crash_step=12)
    crash = [(e["rank"], e["attempt"], e["exit_code"]) for e in ev if e["kind"] == "crash"]
    assert crash == [(1, 1, -9)]
    assert [e["from_step"] for e in ev if e["kind"] == "restart"] == [10]
    _assert_warm_attempt_2(run)
    last = "checkpoint-20"
    assert digest(run / "checkpoints" / last) == digest(ref / "checkpoints" / last)
    assert run_processes(run) == []


def test_titan_restart_from_a_warm_pool_is_exact_and_leaves_nothing(faulted_runs):
    """The shared faulted crash run (tests/faulted.py: titan-tiny, ``warm_spare=true``, rank 1
    crashes at step 12): the restart's ranks come from the pool (their logs have no engine import,
    no torchrun started them), the run completes with the reference digest, and no process of the
    run is left. The pool is not waited for before the crash: it imports alongside attempt 1, and a
    restart that still finds it importing waits."""
    from ptops.ckpt import digest
    from ptops.ops.supervisor.procs import run_processes

    ref, crash = faulted_runs.get("reference"), faulted_runs.get("crash")
    assert ref.proc.returncode == 0 and crash.proc.returncode == 0, crash.proc.stderr[-3000:]
    _assert_warm_attempt_2(crash.run)
    assert digest(crash.run / "checkpoints" / "step-16") == digest(
        ref.run / "checkpoints" / "step-16"
    )
    assert run_processes(crash.run) == []


def test_the_pool_checks_that_a_forked_child_can_run_and_finds_no_gpu_problem_on_cpu():
    """The pool's fork check (a GPU pool whose children could not use CUDA serves nothing): a
    child's failure is seen, and on this CPU-only machine there is no CUDA problem to report."""
    from ptops.ops.rank.warm import cuda_fork_problem, forked_child_status

    def fails() -> None:
        raise RuntimeError("CUDA error: initialization error")

    assert forked_child_status(lambda: None) == 0
    assert forked_child_status(fails) != 0
    assert cuda_fork_problem() == ""


# ----------------------------------------- the supervisor's side: where a restart's ranks come from
# A pool that is still importing (issue 27): it binds its socket only once GO exists, then serves
# like the real one.
SLOW_POOL = textwrap.dedent("""
    import os, sys, time
    from ptops.ops.rank import warm

    print("importing", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    if sys.argv[3] == "decline":
        warm.say("no warm pool: a child forked from it cannot use CUDA (test)")
        sys.exit(0)
    warm.serve(sys.argv[1], "stub", target=lambda: None)
""")


def _slow_pool(tmp_path: Path, how: str = "serve"):
    from types import SimpleNamespace

    from ptops.ops.supervisor.warmpool import WarmPool

    (tmp_path / "supervisor").mkdir(parents=True, exist_ok=True)
    pool = WarmPool(None, SimpleNamespace(path=tmp_path))
    go = tmp_path / "go"
    with open(pool.log, "ab") as log:
        pool.proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_POOL, pool.name, str(go), how],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pool.started_at = time.monotonic()
    while "importing" not in pool.log.read_text():
        assert pool.proc.poll() is None, pool.log.read_text()
        time.sleep(0.05)
    return pool, go


def test_a_restart_waits_for_a_pool_that_is_still_importing_and_comes_warm(tmp_path):
    """The pool is started (importing) but not listening: the restart waits for it instead of going
    cold next to it, and is told warm once it answers (the readiness probe does not disturb the
    pool)."""
    import threading

    pool, go = _slow_pool(tmp_path)
    got: list[dict] = []
    t = threading.Thread(target=lambda: got.append(pool.source(300, lambda: False)))
    try:
        t.start()
        t.join(1.0)
        assert t.is_alive() and not got, got  # still waiting: the pool has not bound its socket yet
        go.touch()
        t.join(60)
        assert got and got[0]["ranks_from"] == "warm" and got[0]["warm_wait_s"] >= 1.0, got
        assert pool.source(300, lambda: False)["ranks_from"] == "warm"  # the probes left it serving
        assert "request failed" not in pool.log.read_text()
    finally:
        go.touch()
        pool.stop()


def test_a_pool_that_exited_or_hangs_or_declined_means_cold_with_why(tmp_path):
    pool, go = _slow_pool(tmp_path / "hung")
    pid = pool.proc.pid
    cold = pool.source(0, lambda: False)  # still importing past its budget: stopped, cold
    assert cold["ranks_from"] == "cold" and cold["cold_why"] == "pool_not_ready", cold
    assert pool.proc is None and pool.wanted and not os.path.exists(f"/proc/{pid}/cmdline")
    assert pool.source(300, lambda: False)["cold_why"] == "pool_not_started"

    pool, go = _slow_pool(tmp_path / "stop")
    cold = pool.source(300, lambda: True)  # Ctrl-C while waiting
    assert cold["cold_why"] == "stopping", cold
    pool.stop()

    pool, go = _slow_pool(tmp_path / "dead")
    pool.proc.kill()
    pool.proc.wait()
    cold = pool.source(300, lambda: False)
    assert cold["cold_why"] == "pool_exited" and "-9" in cold["cold_detail"] and pool.wanted, (
        cold
    )  # replaced later

    pool, go = _slow_pool(tmp_path / "gpu", "decline")
    go.touch()
    pool.proc.wait(timeout=60)
    cold = pool.source(300, lambda: False)
    assert cold["cold_why"] == "pool_exited" and "cannot use CUDA" in cold["cold_detail"], cold
    assert not pool.wanted and pool.source(300, lambda: False)["cold_why"] == "pool_declined"


def test_a_child_writes_its_run_into_the_blank_environ_slot_it_was_started_with(tmp_path):
    """ops/rank/environslot.py: what /proc/PID/environ shows changes; os.environ does not; a value
    longer than the slot, or no slot, writes nothing."""
    code = textwrap.dedent("""
        import os, sys
        from ptops.ops.rank import environslot as es
        slot = es.find()
        assert slot is not None and slot[1] == len(es.SLOT) + 1 + es.SIZE, slot
        assert not es.write(slot, "PTOPS_RUN_DIR", "x" * slot[1])  # too long: nothing written
        assert not es.write(None, "PTOPS_RUN_DIR", "/r")
        assert es.write(slot, "PTOPS_RUN_DIR", sys.argv[1])
        shown = open(f"/proc/{os.getpid()}/environ", "rb").read().split(b"\\0")
        assert ("PTOPS_RUN_DIR=" + sys.argv[1]).encode() in shown, shown[-3:]
        assert not any(x.startswith(es.SLOT.encode()) for x in shown)
        assert os.environ[es.SLOT] == "." * es.SIZE  # Python's copy is untouched
        print("ok")
    """)
    from ptops.ops.rank import environslot

    env = {**os.environ, **environslot.blank()}
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    none = subprocess.run(
        [sys.executable, "-c", "from ptops.ops.rank import environslot as es; print(es.find())"],
        env={k: v for k, v in os.environ.items() if k != environslot.SLOT},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert none.stdout.strip() == "None", none.stderr
