"""float8 (torchao, emulated on CPU) from the recipe: a titan-tiny run trains and recovers exactly.

One module-scoped pair of real runs (uninterrupted, and crashed at step 12 then restarted by the
supervisor); the crashed run is held before step 12 until the step-10 save is committed, so the
resume point is known without racing the clock.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_ptops

F8 = [
    "--set",
    "titan.float8.enabled=true",
    "--set",
    "titan.float8.emulate=true",
    "--set",
    "train.steps=16",
    "--set",
    "checkpoint.interval=5",
    "--no-mlflow",
    "--json",
]


def _digest(run: Path) -> str:
    from ptops.ckpt import digest

    return digest(run / "checkpoints" / "step-16")


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in recs if r.get("rank") == 0 and "loss" in r}


@pytest.fixture(scope="module")
def float8_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8")
    ref = run_ptops("launch", "titan-tiny", "--run-dir", str(root / "ref"), *F8, timeout=900)
    crash = run_ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(root / "crash"),
        *F8,
        "--fault",
        "crash:rank=1,step=12",
        "--fault",
        "hold:step=12,until=committed,seconds=120",
        timeout=900,
    )
    return root / "ref", ref, root / "crash", crash


@pytest.mark.slow
def test_float8_emulated_trains_and_recovers_exactly(float8_runs):
    ref_dir, ref, crash_dir, crash = float8_runs
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert crash.returncode == 0, crash.stderr[-3000:]
    # the ranks really ran Float8Linear (torchtitan logs the swap)
    logs = "".join(
        p.read_text(errors="replace") for p in (ref_dir / "logs").rglob("*") if p.is_file()
    )
    assert "Float8 training active" in logs or "Swapped to Float8Linear" in logs
    losses = _losses(ref_dir)
    assert losses[16] < losses[1] - 0.3, losses
    restarts = [json.loads(x) for x in (crash_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "restart" for e in restarts), "the crash was not restarted"
    assert _digest(crash_dir) == _digest(ref_dir)


@pytest.mark.slow
def test_activation_checkpointing_from_the_recipe_trains(tmp_path):
    """[titan.activation_checkpoint] mode reaches TorchTitan (its FullAC wraps every block) and
    training runs."""
    run = tmp_path / "ac"
    proc = run_ptops(
        "launch",
        "titan-tiny",
        "--run-dir",
        str(run),
        "--set",
        'titan.activation_checkpoint.mode="full"',
        "--set",
        "train.steps=6",
        "--set",
        "checkpoint.interval=3",
        "--no-mlflow",
        "--json",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "logs" / "attempt-1" / "rank-0.log").read_text(errors="replace")
    assert "Applied FullAC activation checkpointing" in log
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
