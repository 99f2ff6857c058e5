"""The [monitors] policy on real training (tiny models, 2 CPU ranks, gloo), under the real
supervisor.

- titan-tiny, NaN at step 12 (nan action = rollback, the default): the finding wins over the
  "Loss is not finite" crash torchtitan raises right after; the run rolls back to step 10, skips
  the anomaly step's batch, halves the LR (lr_scale=0.5) and completes with a finite loss.
- titan-tiny, rank 1 sleeping 0.5 s before each step: a straggler finding names rank 1 and,
  with action = exclude_node, the decision is recorded with the host (not acted on: no Slurm
  launcher yet).
- trl-grpo-tiny with the gameable length reward and the held-out verifier (weight 0): the
  reward_hacking monitor fires while it trains (reward up, verifier down or length coupled) and
  its action (stop, set for the test) ends the run before its last step.

~60-75 s + ~45 s + ~50 s on 2 cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_ptops

from ptops.ops.supervisor.policy import EXIT_NO_REQUEUE

pytestmark = pytest.mark.slow

STEPS = ["--set", "train.steps=16", "--set", "checkpoint.interval=5"]


def events(run: Path, kind: str | None = None) -> list[dict]:
    out = [
        json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()
    ]
    return [e for e in out if kind is None or e["kind"] == kind]


def metrics(run: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def test_titan_nan_rolls_back_to_the_checkpoint_before_the_anomaly(faulted_runs):
    # made in tests/faulted.py: held before step 12 until the async save of step 10 is committed
    run, proc = faulted_runs.get("nan").run, faulted_runs.get("nan").proc
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["state"] == "completed" and summary["attempts"] == 2
    nan = [e for e in events(run, "anomaly") if e["monitor"] == "nan"]
    assert nan and nan[0]["step"] == 12 and nan[0]["attempt"] == 1
    (rb,) = events(run, "rollback")
    assert (rb["from_step"], rb["to_step"]) == (12, 10) and "nan" in rb["reason"]
    assert rb["skip_batches"] == 1 and rb["skip_at_step"] == 12 and rb["lr_factor"] == 0.5
    # the rollback won the race with torchtitan's "Loss is not finite": not a crash restart
    assert events(run, "crash") == [] and events(run, "restart") == []
    kinds = [e["kind"] for e in events(run)]
    assert kinds.index("rollback") < max(i for i, k in enumerate(kinds) if k == "launch")
    launches = events(run, "launch")
    assert launches[1]["from_step"] == 10 and launches[1]["attempt"] == 2
    applied = {e["what"]: e for e in events(run, "rollback_applied")}
    assert applied["skip"]["step"] == 12 and applied["skip"]["batches_dropped"] == 1
    assert applied["lr"]["lr_factor"] == 0.5
    recs = metrics(run)
    lr = {(r["attempt"], r["step"]): r["lr"] for r in recs if r["rank"] == 0}
    assert lr[(2, 11)] == pytest.approx(0.5 * lr[(1, 11)])
    final = [r for r in recs if r["rank"] == 0 and r["step"] == 16]
    assert final and math.isfinite(float(final[-1]["loss"])) and final[-1]["attempt"] == 2
    assert events(run, "completed")[0]["step"] == 16


def test_titan_slow_rank_is_a_straggler_and_exclude_node_is_recorded(faulted_runs):
    run, proc = faulted_runs.get("straggler").run, faulted_runs.get("straggler").proc
    assert proc.returncode == 0, proc.stderr
    strag = events(run, "straggler")
    assert strag and {e["rank"] for e in strag} == {1}, strag
    excl = events(run, "exclude_node")
    assert excl and excl[0]["rank"] == 1 and excl[0]["host"] and excl[0]["acted"] is False
    assert events(run, "completed")


def test_grpo_gameable_reward_is_flagged_as_reward_hacking(tmp_path):
    run = tmp_path / "run"
    # the recipe's action for the monitor is stop: the finding must end the run while it trains
    proc = run_ptops(
        "launch",
        "trl-grpo-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--no-mlflow",
        "--set",
        "train.steps=40",
        "--set",
        "checkpoint.interval=40",
        "--set",
        'trl.reward="length"',
        "--set",
        "trl.lr=0.03",
        "--set",
        'monitors.reward_hacking.action="stop"',
        "--json",
    )
    assert proc.returncode == EXIT_NO_REQUEUE, (proc.returncode, proc.stderr[-2000:])
    recs = [r for r in metrics(run) if r["rank"] == 0]
    assert all("rewards_verifier_mean" in r for r in recs)  # the held-out verifier is logged
    hack = [e for e in events(run, "anomaly") if e["monitor"] == "reward_hacking"]
    assert hack and hack[0]["phase"] == "open", [e for e in events(run, "anomaly")]
    # the reward climbs against the verifier (held-out falls or does not follow) or with the length
    assert "verifier" in hack[0]["detail"] or "length" in hack[0]["detail"], hack
    # the action was taken: the supervisor stopped the run on that finding, before its last step
    (failed,) = events(run, "failed")
    assert failed["monitor"] == "reward_hacking" and failed["step"] == hack[0]["step"], failed
    assert (
        failed["reason"].startswith("stopped by policy") and failed["exit_code"] == EXIT_NO_REQUEUE
    )
    assert max(r["step"] for r in recs) < 40 and not events(run, "completed")
    diag = run_ptops("diagnose", str(run), "--json")
    assert diag.returncode == 0, diag.stderr
    assert "reward_hacking" in diag.stdout
