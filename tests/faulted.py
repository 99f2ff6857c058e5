"""Real faulted titan-tiny runs, made once per test session and shared.

Each run costs 30-90 s of two ranks on two cores; the supervisor tests, ``ptops diagnose``
tests, the runbook commands and the HTML report all read the same run directories instead of
making their own. Runs are made lazily, on first use, and every one is held by a fault
until what its readers look for is in the run directory (no race with the machine's load).

Kinds (``faulted_runs.get(kind)`` -> ``Faulted(run, proc)``):

- ``reference``: uninterrupted, 16 steps (its digest is what every recovered run must end with)
- ``crash``:     rank 1 SIGKILLs itself at step 12 (held until the step-10 save commits); restart,
                 completed; with ``warm_spare=true``: the restart's ranks are forked from the warm
                 pool
- ``hang``:      attempt 1: rank 0 hangs in Python at step 8; attempt 2: rank 1 SIGSTOPped from
                 outside (held before step 8 until then); both found, stacks taken, restarted,
                 completed; with the shipped hang settings (no floor / ping overrides)
- ``nan``:       NaN loss at step 12 -> rollback to step 10 with lr x 0.5, completed
- ``straggler``: rank 1 0.5 s slower per step from step 3 for 14 steps; ``exclude_node`` recorded
- ``corrupt``:   (interval 4) the step-8 checkpoint is damaged, then rank 1 crashes at step 10: the
                 restart falls back to step 4 (step-8 quarantined), completed
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import PTOPS, REPO, run_ptops

STEPS = ["--set", "train.steps=16", "--set", "checkpoint.interval=5"]
FAST_HANG = [
    "--set",
    "supervisor.hang.floor_s=5",
    "--set",
    "supervisor.hang.ping_stale_s=4",
    "--set",
    "supervisor.restart.backoff_s=0.5",
]
# the hang run uses the shipped hang defaults (issue 12: detection needs no tuning); only the
# backoff is short
DEFAULT_HANG = ["--set", "supervisor.restart.backoff_s=0.5"]
# cold, whichever test asks first: the reference (the cold baseline test_standing_pool compares
# with) and the crash run, which keeps the run's own pool (test_warm reads it); hang, nan,
# straggler and corrupt start from the session's standing pool
COLD = {"PTOPS_STANDING_POOL": None}
HOLD_COMMITTED = "hold:step=12,until=committed,seconds=120"

KINDS = ("reference", "crash", "hang", "nan", "straggler", "corrupt")


@dataclass
class Faulted:
    run: Path
    proc: subprocess.CompletedProcess
    extra: dict


def _events(run: Path, kind: str) -> list[dict]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    out = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [e for e in out if e["kind"] == kind]


def _launch(run: Path, *args: str, cold: bool = False) -> subprocess.CompletedProcess:
    return run_ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        *STEPS,
        "--no-mlflow",
        *args,
        "--json",
        timeout=900,
        env=COLD if cold else None,
    )


def _hang(run: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.Popen(
        [
            *PTOPS,
            "launch",
            "titan-tiny",
            "--supervise",
            "--run-dir",
            str(run),
            *STEPS,
            *DEFAULT_HANG,
            "--no-mlflow",
            "--fault",
            "hang:rank=0,step=8",
            "--fault",
            "hold:step=8,attempt=2",
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len([e for e in _events(run, "fault_injected") if e["fault"].startswith("hold")]) < 2:
            if proc.poll() is not None:
                raise AssertionError(
                    f"supervisor exited {proc.returncode} before attempt 2 was "
                    f"held:\n{proc.stderr.read()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for both ranks to be held in attempt 2")
            time.sleep(0.1)
        st = json.loads((run / "status.json").read_text())
        assert st.get("attempt") == 2 and len(st.get("ranks", [])) == 2, st
        victim = next(r["pid"] for r in st["ranks"] if r["rank"] == 1)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        rel = run_ptops("inject", str(run), "release")
        assert rel.returncode == 0 and "injected release" in rel.stdout, rel.stderr
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, {"stopped_at": stopped_at, "victim_pid": victim}


def make(kind: str, run: Path) -> Faulted:
    if kind == "reference":
        proc = run_ptops(
            "launch",
            "titan-tiny",
            "--run-dir",
            str(run),
            *STEPS,
            "--no-mlflow",
            "--json",
            timeout=900,
            env=COLD,
        )
        return Faulted(run, proc, {})
    if kind == "crash":
        return Faulted(
            run,
            _launch(
                run,
                "--set",
                "supervisor.restart.warm_spare=true",
                "--fault",
                "crash:rank=1,step=12",
                "--fault",
                HOLD_COMMITTED,
                cold=True,
            ),
            {},
        )
    if kind == "hang":
        proc, extra = _hang(run)
        return Faulted(run, proc, extra)
    if kind == "nan":
        # held before step 12 until the async save of step 10 is committed: else the rollback target
        # is 10 or 5 depending on whether that save was still in flight
        return Faulted(
            run,
            _launch(
                run,
                "--set",
                "monitors.rollback.lr_scale=0.5",
                "--fault",
                "nan:step=12",
                "--fault",
                HOLD_COMMITTED,
            ),
            {},
        )
    if kind == "straggler":
        return Faulted(
            run,
            _launch(
                run,
                "--set",
                'monitors.straggler.action="exclude_node"',
                "--fault",
                "slow:rank=1,step=3,seconds=0.5,steps=14",
            ),
            {},
        )
    if kind == "corrupt":
        # saves at 4, 8, 12, 16; corrupt-ckpt makes the step-8 save synchronous and damages it once
        # committed; rank 1 is held before step 10 until then, so the restart must skip step 8 for 4
        return Faulted(
            run,
            _launch(
                run,
                "--set",
                "checkpoint.interval=4",
                "--fault",
                "corrupt-ckpt:step=8,mode=flip",
                "--fault",
                "crash:rank=1,step=10",
                "--fault",
                "hold:step=10,until=committed,seconds=120",
            ),
            {},
        )
    raise KeyError(f"unknown faulted run kind {kind!r} (expected one of {KINDS})")


class FaultedRuns:
    """Lazily made, cached for the session: ``get(kind)``.

    Under pytest-xdist the workers share ``root`` (the session's common temp folder): the first
    worker that asks for a kind makes it under a file lock and writes ``made.json``; the others wait
    on the lock and read that, so each faulted run is made once per session, not once per worker."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: dict[str, Faulted] = {}

    def get(self, kind: str) -> Faulted:
        if kind not in self._runs:
            self._runs[kind] = self._made_once(kind)
        return self._runs[kind]

    def _made_once(self, kind: str) -> Faulted:
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{kind}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            made = self.root / kind / "made.json"
            if made.exists():
                m = json.loads(made.read_text())
                proc = subprocess.CompletedProcess(
                    m["args"], m["returncode"], m["stdout"], m["stderr"]
                )
                return Faulted(Path(m["run"]), proc, m["extra"])
            run = self.root / kind / "run"
            if (
                run.parent.exists()
            ):  # an earlier worker's attempt failed: never resume its half-made run
                run.parent.rename(self.root / f"{kind}.failed-{os.getpid()}-{time.monotonic_ns()}")
            run.parent.mkdir(parents=True)
            f = make(kind, run)
            args = f.proc.args if isinstance(f.proc.args, str) else [str(a) for a in f.proc.args]
            made.write_text(
                json.dumps(
                    {
                        "run": str(f.run),
                        "args": args,
                        "returncode": f.proc.returncode,
                        "stdout": f.proc.stdout,
                        "stderr": f.proc.stderr,
                        "extra": f.extra,
                    }
                )
            )
            return f
