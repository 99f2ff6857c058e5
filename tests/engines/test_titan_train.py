"""TorchTitan 0.3.0 really trains on CPU under ptops: 2 gloo ranks, tiny llama3, no mocks.

Runs go through the real ``ptops launch`` CLI and are shared through
module-scoped fixtures (each launch spends most of its time importing torch and
torchtitan in both ranks):

- FSDP2 (the recipe's default), 10 steps, checkpoint every 3: also the
  uninterrupted reference for resume;
- TP=2, PP=2 (1F1B) and DDP (dp_replicate=2, dp_shard=1), 4 steps each;
- the FSDP run again, stopped once ``step-3`` is complete, then rerun on the same
  run directory: the resumed steps must reproduce the reference bit for bit.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from ptops.ops.runrecord.rundir import final_metrics_by_step, read_jsonl

RECIPE = "recipes/titan-tiny.toml"
STEPS = 10
INTERVAL = 3
SHORT = 4
FSDP_SETS = [f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}"]
LAUNCH_TIMEOUT = 300

pytestmark = pytest.mark.slow


def _argv(run_dir: Path, sets: list[str], faults: list[str] = ()) -> list[str]:
    argv = [sys.executable, "-m", "ptops", "launch", RECIPE, "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    for f in faults:
        argv += ["--fault", f]
    return argv


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PTOPS_RANK_LOGS", None)
    return env


def _logs(run_dir: Path) -> str:
    out = []
    for p in sorted(run_dir.glob("logs/attempt-*/rank-*.log")):
        out.append(f"--- {p.relative_to(run_dir)}\n{p.read_text(errors='replace')[-2500:]}")
    return "\n".join(out) or "(no rank logs)"


def launch(run_dir: Path, sets: list[str], faults: list[str] = ()) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        _argv(run_dir, sets, faults),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"ptops launch {sets} exited {proc.returncode}\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-2000:]}\n{_logs(run_dir)}"
        )
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return list(read_jsonl(run_dir / "metrics.jsonl"))


def assert_trained(run_dir: Path, steps: int) -> None:
    records = metrics(run_dir)
    for rank in (0, 1):
        by_step = final_metrics_by_step(records, rank)
        assert sorted(by_step) == list(range(1, steps + 1)), (rank, sorted(by_step), _logs(run_dir))
        for step, r in by_step.items():
            for key in ("loss", "grad_norm", "lr", "step_s", "tokens_per_s"):
                assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (
                    rank,
                    step,
                    key,
                    r[key],
                )
            assert 0 < r["loss"] < 20
    # both ranks agree on the global loss
    assert [r["loss"] for r in final_metrics_by_step(records, 0).values()] == [
        r["loss"] for r in final_metrics_by_step(records, 1).values()
    ]
    final = run_dir / "checkpoints" / f"step-{steps}"
    assert (final / ".metadata").is_file(), "the final step is always checkpointed"
    assert (run_dir / "titan").is_dir() and not (REPO / "outputs").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="module")
def fsdp_run(runs):
    """Each save committed before the step after the next save point begins: an async save still
    writing at the next save point is skipped by design, and on a loaded box it was (step 9 skipped,
    [3, 6, 10] kept); the holds make the kept set one value, not a race with the disk."""
    d = runs / "fsdp"
    holds = [f"hold:step={s + 1},until=committed,seconds=120" for s in (3, 6)]
    launch(d, FSDP_SETS, holds)
    return d


@pytest.mark.parametrize(
    "name,sets",
    [
        ("tp", ["titan.parallelism.tp=2"]),
        ("pp", ["titan.parallelism.pp=2"]),
        ("ddp", ["titan.parallelism.dp_replicate=2", "titan.parallelism.dp_shard=1"]),
    ],
)
def test_parallelism_trains(runs, name, sets):
    d = runs / name
    launch(d, [f"train.steps={SHORT}", *sets])
    assert_trained(d, SHORT)
    log = (d / "logs" / "attempt-1" / "rank-0.log").read_text()
    want = {"tp": "tp=2", "pp": "pp=2", "ddp": "dp_replicate=2"}[name]
    assert f"{want}," in log.split("Building device mesh with parallelism:")[1].splitlines()[0]


def test_fsdp_trains_and_checkpoints(fsdp_run):
    assert_trained(fsdp_run, STEPS)
    log = (fsdp_run / "logs" / "attempt-1" / "rank-0.log").read_text()
    assert "dp_shard=2" in log and "Applied FSDP" in log
    ckpts = sorted(int(p.name.split("-")[1]) for p in (fsdp_run / "checkpoints").glob("step-*"))
    assert ckpts == [6, 9, 10], ckpts  # every 3 steps + the final one, newest 3 kept
    # full state (optimizer included), not model-only: the final checkpoint holds optimizer keys
    meta = (fsdp_run / "checkpoints" / f"step-{STEPS}" / ".metadata").read_bytes()
    assert b"optimizer" in meta and b"lr_scheduler" in meta and b"dataloader" in meta
    r0 = final_metrics_by_step(metrics(fsdp_run), 0)
    assert {"mfu", "memory_max_reserved_gib", "titan_tps"} <= set(r0[1])


def test_kill_and_resume_is_bit_identical(runs, fsdp_run):
    d = runs / "resume"
    proc = subprocess.Popen(
        _argv(d, FSDP_SETS),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = d / "checkpoints" / f"step-{INTERVAL}" / ".metadata"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        while not marker.exists():
            assert proc.poll() is None, f"launch ended before step-{INTERVAL} was saved\n{_logs(d)}"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the launcher stops the whole torchrun job
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    first = metrics(d)
    done_before = max((r["step"] for r in first if r["rank"] == 0), default=0)
    assert done_before < STEPS, "the run finished before it could be stopped: stop it earlier"

    launch(d, FSDP_SETS)
    assert_trained(d, STEPS)
    rank_log = "\n".join(p.read_text() for p in sorted(d.glob("logs/attempt-*/rank-0.log")))
    assert f"Loading the checkpoint from {d / 'checkpoints'}" in rank_log

    resumed = [r for r in metrics(d) if r["attempt"] > 1]
    first_resumed = min(r["step"] for r in resumed)
    assert INTERVAL < first_resumed <= done_before + 1, (first_resumed, done_before)
    ref = {rank: final_metrics_by_step(metrics(fsdp_run), rank) for rank in (0, 1)}
    for r in resumed:
        want = ref[r["rank"]][r["step"]]
        assert (r["loss"], r["grad_norm"], r["lr"]) == (
            want["loss"],
            want["grad_norm"],
            want["lr"],
        ), (r["step"], r["rank"], r["loss"], want["loss"])
