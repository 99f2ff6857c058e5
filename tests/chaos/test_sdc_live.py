"""Silent data corruption on real training (titan-tiny: FSDP2 over 2 CPU ranks, gloo), under the
real supervisor, checked every 10 steps (``monitors.sdc.every = 10``: the at-rest windows after
steps 10 and 20).

- transient: rank 1 flips one bit of one of its parameter shards before step 11. The at-rest check
  of step 11 catches it on rank 1; the policy rolls back exactly to step 5 (the step-10
  checkpoint, written after the last clean fingerprint, is set aside) and the run ends with the
  digest of the uninterrupted reference run (tests/faulted.py).
- persistent (a bad device: a new flip before every step from 11, in every attempt): caught in
  attempt 1, rolled back, caught again on the same rank in attempt 2; the node is struck
  (``exclude_node``, recorded only: a local launch cannot replace it) and the run stops (exit 3).
  ``ptops diagnose`` names the rank, the node, the kind and "persistent".

- replicas (trl-sft-tiny: DDP over 2 ranks): rank 1 flips before step 13, outside any at-rest
  window; the ranks' fingerprints at step 20 disagree (which rank lies is unknown with two), the
  run rolls back exactly to step 5 (the last agreement was at step 10) and ends with the digest of
  an uninterrupted run of the same recipe.

Every attempt is held before step 13 (``hold``), so the run never races past the finding: the
supervisor acts on the record of step 11 while the ranks wait; the transient run is also held before
step 11 until the save of step 10 is committed (the checkpoint to set aside is then always on disk).
~45 s + ~50 s on 2 cores.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import run_ptops

pytestmark = pytest.mark.slow

# the cadence is set, not the default's: the flips are placed in (or outside) its windows
EVERY = ["--set", "monitors.sdc.every=10"]
STEPS = ["--set", "train.steps=16", "--set", "checkpoint.interval=5", *EVERY]


def events(run: Path, kind: str | None = None) -> list[dict]:
    out = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in out if kind is None or e["kind"] == kind]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def launch(
    run: Path, *faults: str, recipe: str = "titan-tiny", steps: list[str] = STEPS
) -> subprocess.CompletedProcess:
    args = [a for f in faults for a in ("--fault", f)]
    return run_ptops(
        "launch", recipe, "--supervise", "--run-dir", str(run), *steps, "--no-mlflow",
        *args, "--json", timeout=900,
    )  # fmt: skip


def final_digest(run: Path, name: str = "step-16") -> str:
    from ptops.ckpt import digest

    return digest(run / "checkpoints" / name)


@pytest.fixture(scope="module")
def transient(tmp_path_factory):
    run = tmp_path_factory.mktemp("sdc") / "transient"
    # held before step 11 until the async save of step 10 is committed (so it is on disk to be
    # set aside, whatever the load), and before step 13 until the supervisor acts
    return run, launch(
        run,
        "hold:step=11,until=committed,seconds=120",
        "bitflip:rank=1,step=11",
        "hold:step=13,seconds=120",
    )


@pytest.fixture(scope="module")
def persistent(tmp_path_factory):
    run = tmp_path_factory.mktemp("sdc") / "persistent"
    return run, launch(
        run, "bitflip:rank=1,step=11,mode=persistent", "hold:step=13,seconds=120,attempt=0"
    )


# gradients computed again every 5 steps (FSDP shards have no replica to compare with)
RECHECK = [*STEPS, "--set", "monitors.sdc.recheck_every=5"]


@pytest.fixture(scope="module")
def grad_flips(tmp_path_factory):
    """A gradient flip once at step 10 (a recheck step), and a bad device that flips a gradient
    at every step from 8 (steps 8-9 unseen: no recheck there); held before step 16 so the run
    never ends before the supervisor acts on step 15's record."""
    base = tmp_path_factory.mktemp("sdc-grad")
    once = launch(base / "once", "bitflip:rank=1,step=10,target=grad", steps=RECHECK)
    bad = launch(
        base / "bad", "bitflip:rank=1,step=8,target=grad,mode=persistent",
        "hold:step=16,seconds=120,attempt=0", steps=RECHECK,
    )  # fmt: skip
    return (base / "once", once), (base / "bad", bad)


def test_gradient_flip_is_outvoted_before_the_optimizer_no_rollback_digest_equal(
    grad_flips, faulted_runs
):
    (run, proc), _ = grad_flips
    assert proc.returncode == 0, proc.stderr
    assert (
        json.loads(proc.stdout)["attempts"] == 1
    )  # nothing to roll back: the weights never saw it
    rechecks = {(r["step"], r["rank"]): r for r in metrics(run) if r.get("sdc_recheck") is not None}
    assert sorted(rechecks) == [(s, r) for s in (5, 10, 15) for r in (0, 1)]
    assert [k for k, r in rechecks.items() if r["sdc_recheck"]] == [(10, 1)]  # clean steps: equal
    assert rechecks[(10, 1)]["sdc_recheck_kept"] == "recompute"
    (found,) = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert (found["rank"], found["step"], found["severity"]) == (1, 10, "warning")
    assert found["detail"].startswith("recompute transient: rank 1's gradients at step 10")
    assert not events(run, "rollback")
    ref = faulted_runs.get("reference")
    assert final_digest(run) == final_digest(ref.run)
    diag = json.loads(run_ptops("diagnose", str(run), "--json", check=True).stdout)
    (inc,) = [i for i in diag["incidents"] if i["kind"] == "sdc"]
    assert inc["rank"] == 1 and inc["host"] == socket.gethostname() and inc["severity"] == "warning"
    assert inc["details"]["kind"] == "recompute" and "no rollback" in inc["action"]


def test_a_device_that_flips_gradients_every_step_is_caught_twice_and_struck(grad_flips):
    _, (run, proc) = grad_flips
    assert proc.returncode == 3, proc.stderr
    found = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert [(e["rank"], e["step"], e["severity"]) for e in found] == [
        (1, 10, "warning"),  # contained at the step-10 recheck
        (1, 5, "critical"),  # caught again at 15: back before its last clean recheck, step 5
    ]
    assert found[1]["detail"].startswith("recompute persistent") and found[1]["value"] == 2
    (ex,) = events(run, "exclude_node")
    assert (ex["rank"], ex["host"], ex["acted"]) == (1, socket.gethostname(), False)
    (failed,) = events(run, "failed")
    assert "recompute persistent" in failed["reason"] and failed["exit_code"] == 3


def test_transient_flip_is_caught_on_its_rank_and_recovers_to_the_reference_digest(
    transient, faulted_runs
):
    run, proc = transient
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["state"] == "completed" and summary["attempts"] == 2
    (flip,) = [e for e in events(run, "fault_injected") if e["fault"].startswith("bitflip")]
    assert (flip["rank"], flip["step"], flip["attempt"]) == (1, 11, 1)
    (found,) = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert (found["rank"], found["step"], found["severity"]) == (1, 10, "critical")
    assert found["detail"].startswith("at_rest transient: rank 1")
    # what the ranks recorded: rank 1's state changed at rest, rank 0's did not
    rest = {
        (r["attempt"], r["step"], r["rank"]): r["sdc_rest"] for r in metrics(run) if "sdc_rest" in r
    }
    assert rest[(1, 11, 1)] == 1 and rest.get((1, 11, 0)) in (0, None)  # rank 0: never changed
    assert rest[(2, 11, 1)] == 0 and rest[(2, 11, 0)] == 0  # attempt 2: clean
    (rb,) = events(run, "rollback")
    assert (rb["from_step"], rb["to_step"], rb["monitor"]) == (10, 5, "sdc")
    assert rb["skip_batches"] == 0 and rb["lr_factor"] == 1.0  # exact: same data, same LR
    invalid = [e for e in events(run, "checkpoint_invalid") if "after anomaly" in e["reason"]]
    assert any(e["path"].endswith("step-10") for e in invalid), invalid
    assert events(run, "launch")[1]["from_step"] == 5
    ref = faulted_runs.get("reference")
    assert ref.proc.returncode == 0, ref.proc.stderr
    assert final_digest(run) == final_digest(ref.run)
    # diagnose: rank, node, kind
    diag = json.loads(run_ptops("diagnose", str(run), "--json", check=True).stdout)
    (inc,) = [i for i in diag["incidents"] if i["kind"] == "sdc"]
    assert inc["rank"] == 1 and inc["host"] == socket.gethostname()
    assert inc["details"]["kind"] == "at_rest" and inc["details"]["persistent"] is False
    assert inc["runbook"] == "SilentDataCorruption" and "checkpoint step 5" in inc["action"]


def test_persistent_flip_is_caught_again_strikes_the_node_and_stops(persistent):
    run, proc = persistent
    assert proc.returncode == 3, proc.stderr
    found = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert [(e["rank"], e["step"], e["attempt"]) for e in found] == [(1, 10, 1), (1, 10, 2)]
    assert "persistent" in found[1]["detail"] and found[1]["value"] == 2
    (ex,) = events(run, "exclude_node")
    assert (ex["rank"], ex["host"], ex["acted"]) == (1, socket.gethostname(), False)
    (failed,) = events(run, "failed")
    assert "sdc" in failed["reason"] and failed["exit_code"] == 3
    assert len(events(run, "rollback")) == 1  # once; the second time is the device, not the data
    diag = json.loads(run_ptops("diagnose", str(run), "--json", check=True).stdout)
    incs = [i for i in diag["incidents"] if i["kind"] == "sdc"]
    assert [i["details"]["persistent"] for i in incs] == [False, True]
    last = incs[-1]
    assert last["rank"] == 1 and last["host"] == socket.gethostname()
    assert "persistent" in last["title"] and "struck" in last["action"]


# the default keep (3): the step-20 save keeps checkpoint-5, the rollback's clean target, because
# sdc checks are on (ckpt.retention.sdc_rollback_steps); it used to prune it, before or after the
# supervisor planned the rollback, depending on load
TRL_STEPS = ["--set", "train.steps=24", "--set", "checkpoint.interval=5", *EVERY]


@pytest.fixture(scope="module")
def trl_replicas(tmp_path_factory):
    base = tmp_path_factory.mktemp("sdc-trl")
    ref = launch(base / "reference", recipe="trl-sft-tiny", steps=TRL_STEPS)
    assert ref.returncode == 0, ref.stderr
    run = base / "flip"
    proc = launch(
        run,
        "bitflip:rank=1,step=13",
        "hold:step=21,seconds=120",
        recipe="trl-sft-tiny",
        steps=TRL_STEPS,
    )
    return base / "reference", run, proc


def test_trl_replicas_disagree_and_the_run_recovers_to_the_reference_digest(trl_replicas):
    ref, run, proc = trl_replicas
    assert proc.returncode == 0, proc.stderr
    fps = {(r["attempt"], r["step"], r["rank"]): r["sdc_fp"] for r in metrics(run) if "sdc_fp" in r}
    assert fps[(1, 10, 0)] == fps[(1, 10, 1)] and fps[(1, 20, 0)] != fps[(1, 20, 1)]
    assert fps[(2, 20, 0)] == fps[(2, 20, 1)]  # after the rollback: replicas again
    rest = [r["sdc_rest"] for r in metrics(run) if "sdc_rest" in r]
    assert rest and not any(rest)  # the flip came outside the at-rest windows (after 10, 20)
    (found,) = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert found["rank"] is None and found["step"] == 10
    assert found["detail"].startswith("replica transient") and "at step 20" in found["detail"]
    (rb,) = events(run, "rollback")
    assert (rb["from_step"], rb["to_step"], rb["skip_batches"]) == (10, 5, 0)
    assert final_digest(run, "checkpoint-24") == final_digest(ref, "checkpoint-24")


# what a rank hands to the gradient reduce-scatter, flipped (``bitflip target=compute``); the
# recheck and the partner run every 5 steps
PARTNER = [*RECHECK, "--set", "monitors.sdc.partner_every=5"]


@pytest.fixture(scope="module")
def compute_flips(tmp_path_factory):
    """2 ranks: a one-off compute error at step 5 (contained), then a device wrong the same way
    in every run of every step from 10 (attempt 1 only): the partner run sees it, the pair cannot
    say which device. 3 ranks: the same bad device in every attempt, named and struck. Both held
    before step 11 until the supervisor acts on step 10's records."""
    base = tmp_path_factory.mktemp("sdc-compute")
    pair = launch(
        base / "pair", "bitflip:rank=1,step=5,target=compute",
        "bitflip:rank=1,step=10,target=compute,mode=persistent,attempt=1",
        "hold:step=11,seconds=120,attempt=1", steps=PARTNER,
    )  # fmt: skip
    trio = launch(
        base / "trio", "bitflip:rank=1,step=10,target=compute,mode=persistent",
        "hold:step=11,seconds=120,attempt=0", steps=[*PARTNER, "--set", "launch.nproc=3"],
    )  # fmt: skip
    return (base / "pair", pair), (base / "trio", trio)


def test_a_compute_error_is_blamed_on_its_rank_and_a_consistent_one_is_caught_by_the_partner(
    compute_flips, faulted_runs
):
    (run, proc), _ = compute_flips
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["attempts"] == 2
    recs = {(r["attempt"], r["step"], r["rank"]): r for r in metrics(run) if "sdc_partner" in r}
    # step 5: rank 1's own contribution differed between its runs; both records name it
    assert recs[(1, 5, 1)]["sdc_recheck_contrib"] == 1
    assert recs[(1, 5, 0)]["sdc_recheck_contrib"] == 0
    assert recs[(1, 5, 0)]["sdc_recheck_compute"] == recs[(1, 5, 1)]["sdc_recheck_compute"] == [1]
    # step 10: every same-rank run agrees (the device is wrong the same way), the partner does not;
    # the attempt ends on the first record that says so: the other rank's may never be handled
    tenth = [recs[(1, 10, r)] for r in (0, 1) if (1, 10, r) in recs]
    assert tenth
    for rec in tenth:
        assert rec["sdc_recheck"] == rec["sdc_recheck_contrib"] == 0
        assert rec["sdc_partner"] == 2 and rec["sdc_partner_suspects"] == [0, 1]
    assert all(r["sdc_partner"] == 0 for k, r in recs.items() if k[0] == 2)  # attempt 2: clean
    found = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert [(e["rank"], e["step"], e["severity"]) for e in found] == [
        (1, 5, "warning"),  # contained: a third run outvoted the corrupt contribution
        (None, 5, "critical"),  # since the last clean partner check
    ]
    assert found[0]["detail"].startswith("recompute transient: rank 1's computation at step 5")
    assert found[1]["detail"].startswith("partner unattributed: ranks 0 and 1")
    (rb,) = events(run, "rollback")
    assert (rb["from_step"], rb["skip_batches"], rb["lr_factor"]) == (5, 0, 1.0)
    assert not events(run, "exclude_node")
    assert final_digest(run) == final_digest(faulted_runs.get("reference").run)


def test_a_consistently_wrong_device_among_three_is_named_by_the_partner_and_struck(compute_flips):
    _, (run, proc) = compute_flips
    assert proc.returncode == 3, proc.stderr
    recs = [r for r in metrics(run) if r.get("step") == 10 and "sdc_partner" in r]
    assert recs  # every rank's that was handled before the attempt ended on the first
    assert all(r["sdc_partner_suspects"] == [1] and r["sdc_recheck"] == 0 for r in recs)
    (found,) = [e for e in events(run, "anomaly") if e["monitor"] == "sdc"]
    assert (found["rank"], found["step"], found["value"]) == (1, 5, 2)
    assert found["detail"].startswith("partner persistent: rank 1 computes differently")
    (ex,) = events(run, "exclude_node")
    assert (ex["rank"], ex["host"], ex["acted"]) == (1, socket.gethostname(), False)
    diag = json.loads(run_ptops("diagnose", str(run), "--json", check=True).stdout)
    (inc,) = [i for i in diag["incidents"] if i["kind"] == "sdc"]
    assert inc["rank"] == 1 and inc["details"]["kind"] == "partner"
    assert inc["details"]["persistent"] is True and "struck" in inc["action"]
