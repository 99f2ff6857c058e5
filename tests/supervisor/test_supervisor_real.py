"""The supervisor around real TorchTitan and TRL training (tiny models, 2 CPU ranks, gloo).

Every scenario ends with the same final checkpoint digest as an uninterrupted
run with the same seed. Each attempt costs ~35-45 s here (imports and process
exit of two ranks on two cores), so scenarios share runs where they can.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PTOPS, REPO, run_ptops

from ptops.diagnostics.stacks import node_sections

# the default path, torchrun and the run's own pool, not the session's standing pool
pytestmark = [pytest.mark.slow, pytest.mark.cold]

STEPS = ["--set", "train.steps=16", "--set", "checkpoint.interval=5"]
FAST_HANG = [
    "--set",
    "supervisor.hang.floor_s=5",
    "--set",
    "supervisor.hang.ping_stale_s=4",
    "--set",
    "supervisor.restart.backoff_s=0.5",
]


def events(run: Path, kind: str | None = None) -> list[dict]:
    out = [
        json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()
    ]
    return [e for e in out if kind is None or e["kind"] == kind]


def events_or_none(run: Path, kind: str) -> list[dict]:
    """Like events(), before the run directory has any: an empty list."""
    return events(run, kind) if (run / "events.jsonl").exists() else []


def final_digest(run: Path, steps: int = 16) -> str:
    """Digest of the final checkpoint (ptops.ckpt); falls back to the final rank-0 loss."""
    ck = next(
        (
            p
            for p in (
                run / "checkpoints" / f"step-{steps}",
                run / "checkpoints" / f"checkpoint-{steps}",
            )
            if p.is_dir()
        ),
        None,
    )
    assert ck is not None, f"no final checkpoint in {run / 'checkpoints'}"
    try:
        from ptops.ckpt import digest
    except ImportError:
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return repr([r["loss"] for r in recs if r["rank"] == 0 and r["step"] == steps][-1])
    return digest(ck)


def run_processes(run: Path) -> list[int]:
    from ptops.ops.supervisor.procs import run_processes as rp

    return rp(run)


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"supervisor exited {proc.returncode} while waiting for "
                f"{what}:\n{proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*PTOPS, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def titan_reference(faulted_runs) -> str:
    ref = faulted_runs.get("reference")
    assert ref.proc.returncode == 0, ref.proc.stderr
    return final_digest(ref.run)


def test_titan_crash_restarts_from_checkpoint(faulted_runs, titan_reference):
    # held before step 12 until the async save of step 10 is committed (else: 10 or 5 by load)
    run, proc = faulted_runs.get("crash").run, faulted_runs.get("crash").proc
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["state"] == "completed" and summary["restarts"] == 1 and summary["crashes"] == 1
    crash = events(run, "crash")[0]
    assert crash["attempt"] == 1 and crash["rank"] == 1 and crash["exit_code"] == -9
    crash_fault = [e for e in events(run, "fault_injected") if e["fault"].startswith("crash")]
    assert crash_fault[0] | {"ts": 0} == {
        "ts": 0,
        "kind": "fault_injected",
        "fault": "crash:rank=1,step=12",
        "rank": 1,
        "step": 12,
        "attempt": 1,
    }
    assert {e["by"] for e in events(run, "hold_released")} == {"committed"}
    restart = events(run, "restart")[0]
    assert restart["attempt"] == 2 and restart["from_step"] == 10
    assert events(run, "completed")[0]["step"] == 16
    # warm_spare=true (issue 27): the pool imports alongside attempt 1; the restart's ranks are
    # forked from it
    launches = events(run, "launch")
    assert [(e["attempt"], e["warm_pool"], e["ranks_from"]) for e in launches] == [
        (1, True, "cold"),
        (2, True, "warm"),
    ]
    assert launches[0]["cold_why"] == "pool_not_started" and launches[1]["warm_wait_s"] >= 0, (
        launches
    )
    st = run_ptops("status", str(run), "--json")
    good = json.loads(st.stdout)["goodput"]
    assert (
        0 < good["ratio"] < 1 and good["lost_s"]["restart"] > 0 and good["lost_s"]["detection"] > 0
    )
    assert (
        good["lost_s"]["recomputed"] > 0
    )  # steps 11 trained twice (resumed from 10, crashed at the start of 12)
    assert "goodput:" in run_ptops("status", str(run)).stdout
    assert final_digest(run) == titan_reference
    assert run_processes(run) == []


def test_titan_hang_fault_and_sigstopped_rank(faulted_runs, titan_reference):
    """Attempt 1: rank 0 hangs in Python (hang fault). Attempt 2: rank 1 is SIGSTOPped from outside
    (attempt 2 is held before step 8 until then, so the SIGSTOP never races the run's end)."""
    hang = faulted_runs.get("hang")
    run, err, stopped_at = hang.run, hang.proc.stderr, hang.extra["stopped_at"]
    proc = hang.proc
    assert proc.returncode == 0, err
    hangs = events(run, "hang")
    assert len(hangs) == 2, err
    first, second = hangs
    injected = events(run, "fault_injected")[0]
    assert injected["fault"] == "hang:rank=0,step=8"
    assert (
        first["attempt"] == 1
        and first["ranks"] == [0]
        and first["step"] == 7
        and first["why"] == "behind"
    )
    # found when the silence outran the budget the monitor had learned (the 5 s floor, or more where
    # the steps ran slow on a loaded machine): judged against that recorded budget, not the wall
    # clock
    assert first["timeout_s"] >= 5  # never under the floor
    assert (
        first["found_ts"] - injected["ts"] < first["timeout_s"] + 3
    )  # + the monitor's poll and one step
    assert second["attempt"] == 2 and second["ranks"] == [1] and second["why"] == "unresponsive"
    assert (
        second["found_ts"] - stopped_at < second["timeout_s"] + 3 + 10
    )  # budget + poll + ping staleness
    for k, (rank, source) in ((1, (0, "channel")), (2, (1, "py-spy"))):
        # a local run is a one-node run: its agent gathers the node's stacks into one file
        (node_file,) = (run / "stacks" / f"attempt-{k}").glob("node-*.txt")
        sections = node_sections(node_file.read_text())
        assert sorted(sections) == [0, 1]
        text = sections[rank]
        assert source in text.splitlines()[0]
        assert ("_hang" in text) if k == 1 else ("MainThread" in text)
    assert oct((run / "stacks" / "attempt-1").stat().st_mode & 0o777) == "0o700"
    assert [e["attempt"] for e in events(run, "launch")] == [1, 2, 3]
    assert final_digest(run) == titan_reference
    assert run_processes(run) == []


def test_titan_sigint_sigkill_lock_and_resume(tmp_path, titan_reference):
    run = tmp_path / "run"
    slow = "slow:rank=0,step=1,seconds=0.3,steps=40"
    # 1. Ctrl-C: exit 130, nothing left behind
    proc = start(
        "launch", "titan-tiny", "--supervise", "--run-dir", str(run), *STEPS, "--fault", slow
    )
    wait_for(lambda: status(run).get("step", 0) >= 3, 120, "step 3", proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert run_processes(run) == []
    assert events(run, "stopped")[-1]["signal"] == signal.SIGINT
    # 2. the supervisor is SIGKILLed: no rank survives it
    proc = start("launch", "titan-tiny", "--supervise", "--run-dir", str(run), *STEPS)
    try:
        wait_for(
            lambda: status(run).get("attempt") == 2 and len(status(run).get("ranks", [])) == 2,
            120,
            "attempt 2 ranks",
            proc,
        )
        # held at step 8 (or the next step, if 8 has passed) while the supervisor is checked and
        # killed, instead of racing the rest of the run with a slow fault
        inj = run_ptops("inject", str(run), "hold:step=8")
        assert inj.returncode == 0 and "injected" in inj.stdout, inj.stderr
        wait_for(
            lambda: (
                len(
                    [
                        e
                        for e in events_or_none(run, "fault_injected")
                        if e["fault"].startswith("hold") and e["attempt"] == 2
                    ]
                )
                == 2
            ),
            120,
            "both ranks held",
            proc,
        )
        st = status(
            run
        )  # written at every attempt's start with its ranks (its step may lag: not used)
        # a second supervisor on the same run directory: one clear line, exit 2
        second = run_ptops("launch", "titan-tiny", "--supervise", "--run-dir", str(run), *STEPS)
        assert second.returncode == 2 and second.stderr.strip().count("\n") == 0
        assert "already supervised by pid" in second.stderr
        ranks = [r["pid"] for r in st["ranks"]]
        assert len(ranks) == 2 and run_processes(run)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(
        lambda: run_processes(run) == [], 10, "every process of the run to die with its supervisor"
    )
    from ptops.ops.supervisor.procs import alive

    # dead (a zombie waiting for init to reap it counts as dead); a process in the middle of exiting
    # has already lost its environment but is not a zombie yet, hence the short wait
    wait_for(lambda: not any(alive(p) for p in ranks), 10, "the ranks to finish exiting")
    s = json.loads(run_ptops("status", str(run), "--json", check=True).stdout)
    assert s["state"] == "dead" and s["supervisor_pid"] is None
    # 3. rerun adopts the run and completes it
    done = run_ptops("launch", "titan-tiny", "--supervise", "--run-dir", str(run), *STEPS)
    assert done.returncode == 0, done.stderr
    assert events(run, "adopt") and [e["attempt"] for e in events(run, "launch")] == [1, 2, 3]
    assert final_digest(run) == titan_reference
    s = json.loads(run_ptops("status", str(run), "--json", check=True).stdout)
    assert s["state"] == "completed" and s["step"] == 16 and s["last_good_checkpoint"]["step"] == 16
    assert run_processes(run) == []


def test_trl_sft_crash_restarts_from_checkpoint(tmp_path):
    ref = tmp_path / "ref"
    run_ptops("launch", "trl-sft-tiny", "--run-dir", str(ref), *STEPS, check=True)
    run = tmp_path / "run"
    proc = run_ptops(
        "launch",
        "trl-sft-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        *STEPS,
        "--fault",
        "crash:rank=1,step=12",
    )
    assert proc.returncode == 0, proc.stderr
    crash = events(run, "crash")
    assert len(crash) == 1 and crash[0]["rank"] == 1 and crash[0]["attempt"] == 1
    assert events(run, "restart")[0]["from_step"] == 10
    assert final_digest(run) == final_digest(ref)
    assert run_processes(run) == []
