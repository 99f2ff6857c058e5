"""Silent data corruption: what the checks cost in steady state, and how long each kind takes to
catch.

    .venv/bin/python bench/sdc_bench.py [--steps 30] [--out bench/results/sdc_bench.json]

Cost (``cost_*``): a fault-free supervised run with ``monitors.sdc.every=1`` (every step is a check
step: its record carries ``sdc_s``, the time the rank spent fingerprinting its parameters and
optimizer state after the optimizer step plus comparing at the start of the step; ``step_s`` does
not include it). Per check: the median ``sdc_s`` over ranks and steps (the first 3 steps skipped);
per step at cadence N: that / N; the share is against the median ``step_s`` of the same records.
titan-tiny (FSDP2 shards, at rest only) and trl-sft-tiny (DDP: at rest plus the replica
fingerprint).

Time to catch (``catch_*``), checked every 10 steps (``monitors.sdc.every=10``), each a supervised
run held before the step after the one it should be caught at (so the supervisor's reaction is
what is measured, not a race with the end of the run):

- ``catch_at_rest_transient``: titan-tiny, rank 1 flips a parameter bit before step 11 (in the
  window after step 10);
- ``catch_at_rest_persistent``: the same with ``mode=persistent``: caught in attempt 1, then again
  in attempt 2 (the run stops, exit 3);
- ``catch_replica``: trl-sft-tiny, rank 1 flips before step 13 (outside any at-rest window): only
  the replicas' fingerprints at step 20 can see it.

Gradient recheck (FSDP shards: ``monitors.sdc.recheck_every``; ``--recheck-only``: these alone):

- ``cost_recheck``: titan-tiny with ``recheck_every=2`` (at rest off): the rechecked steps'
  ``sdc_s`` (the second forward-backward, the clipping and the gradients' fingerprints; inside
  ``step_s``, unlike the at-rest check) against the median ``step_s`` of the other steps;
- ``catch_recheck_transient``: rank 1 flips a gradient bit at step 10, a recheck step
  (``recheck_every=5``): outvoted in that step, no rollback;
- ``catch_recheck_persistent``: a gradient flip at every step from 11: contained at 15, caught
  again at 20 (the node struck; the run stops, exit 3). Flips between rechecks are not seen: the
  recheck samples steps.

Re-run on another rank (``monitors.sdc.partner_every``; with ``--recheck-only`` too):

- ``cost_partner``: see ``cost_partner`` (2 and 3 ranks);
- ``catch_partner``: 3 ranks, rank 1 wrong the same way in every run from step 11
  (``bitflip target=compute mode=persistent``), ``recheck_every=5``, ``partner_every=5``: the
  rechecks at 15 agree with themselves; the partner run at 15 names rank 1 (struck, exit 3).

Each: the ``fault_injected`` -> ``anomaly {monitor: sdc}`` time (wall clock, the supervisor's
receive time) and steps (the anomaly's record step minus the fault's step), and for the persistent
one the second catch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ptops import envnames

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EVERY = 25  # monitors/config.py SdcConfig.every


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def launch(run: Path, recipe: str, sets: list[str], faults: list[str]) -> int:
    argv = [sys.executable, "-m", "ptops", "launch", recipe, "--supervise", "--run-dir", str(run)]
    argv += ["--no-mlflow", "--json"]
    for s in sets:
        argv += ["--set", s]
    for f in faults:
        argv += ["--fault", f]
    env = {k: v for k, v in os.environ.items() if k != envnames.STANDING_POOL}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    return proc.returncode


def cost(work: Path, recipe: str, steps: int) -> dict:
    run = work / f"cost-{recipe}"
    rc = launch(run, recipe, [f"train.steps={steps}", "monitors.sdc.every=1"], [])
    recs = [r for r in read(run / "metrics.jsonl") if r.get("step", 0) > 3]
    check = [float(r["sdc_s"]) for r in recs if isinstance(r.get("sdc_s"), (int, float))]
    step = [float(r["step_s"]) for r in recs if isinstance(r.get("step_s"), (int, float))]
    if not check or not step:
        return {"recipe": recipe, "rc": rc, "error": "no sdc_s / step_s records"}
    per_check, step_s = statistics.median(check), statistics.median(step)
    return {
        "recipe": recipe,
        "rc": rc,
        "records": len(check),
        "check_ms": round(per_check * 1e3, 3),
        "step_ms": round(step_s * 1e3, 2),
        "share_every_1_pct": round(100 * per_check / step_s, 3),
        "share_every_10_pct": round(100 * per_check / 10 / step_s, 3),
        "default_every": DEFAULT_EVERY,
        "share_default_pct": round(100 * per_check / DEFAULT_EVERY / step_s, 3),
        "replica_fp": any("sdc_fp" in r for r in recs),
        # a fault-free run must never be caught: the fingerprints are exact, so any is a bug
        "false_positives": sum(
            1
            for e in read(run / "events.jsonl")
            if e["kind"] == "anomaly" and e.get("monitor") == "sdc"
        ),
    }


def cost_recheck(work: Path, steps: int) -> dict:
    run = work / "cost-recheck"
    sets = [f"train.steps={steps}", "monitors.sdc.every=0", "monitors.sdc.recheck_every=2"]
    rc = launch(run, "titan-tiny", sets, [])
    recs = [r for r in read(run / "metrics.jsonl") if r.get("step", 0) > 3]
    checked = [float(r["sdc_s"]) for r in recs if r.get("sdc_recheck") is not None]
    plain = [float(r["step_s"]) for r in recs if r.get("sdc_recheck") is None and "step_s" in r]
    if not checked or not plain:
        return {"recipe": "titan-tiny", "rc": rc, "error": "no recheck / plain records"}
    per, step_s = statistics.median(checked), statistics.median(plain)
    default = 200  # monitors/config.py SdcConfig.recheck_every
    return {
        "recipe": "titan-tiny",
        "rc": rc,
        "rechecks": len(checked),
        "recheck_ms": round(per * 1e3, 2),
        "step_ms": round(step_s * 1e3, 2),
        "recheck_vs_step": round(per / step_s, 3),
        "default_recheck_every": default,
        "share_default_pct": round(100 * per / default / step_s, 3),
        "false_positives": sum(1 for r in recs if r.get("sdc_recheck")),
    }


def cost_partner(work: Path, steps: int) -> dict:
    """The re-run on another rank alone (``partner_every=2``, recheck and at rest off): the
    partner steps' ``sdc_s`` (the batch passed along the ring, one forward-backward without the
    reduce, the gradients kept aside and put back, the fingerprints exchanged) against the
    other steps' ``step_s``; titan-tiny on 2 and on 3 ranks."""
    out = {"recipe": "titan-tiny", "runs": []}
    for nproc in (2, 3):
        run = work / f"cost-partner-{nproc}"
        sets = [
            f"train.steps={steps}", "monitors.sdc.every=0", "monitors.sdc.recheck_every=0",
            "monitors.sdc.partner_every=2", f"launch.nproc={nproc}",
        ]  # fmt: skip
        rc = launch(run, "titan-tiny", sets, [])
        recs = [r for r in read(run / "metrics.jsonl") if r.get("step", 0) > 3]
        paired = [float(r["sdc_s"]) for r in recs if r.get("sdc_partner") is not None]
        plain = [float(r["step_s"]) for r in recs if r.get("sdc_partner") is None and "step_s" in r]
        if not paired or not plain:
            out["runs"].append({"nproc": nproc, "rc": rc, "error": "no partner / plain records"})
            continue
        per, step_s = statistics.median(paired), statistics.median(plain)
        default = 1000  # monitors/config.py SdcConfig.partner_every
        out["runs"].append(
            {
                "nproc": nproc,
                "rc": rc,
                "partner_runs": len(paired),
                "partner_ms": round(per * 1e3, 2),
                "step_ms": round(step_s * 1e3, 2),
                "partner_vs_step": round(per / step_s, 3),
                "default_partner_every": default,
                "share_default_pct": round(100 * per / default / step_s, 3),
                "false_positives": sum(1 for r in recs if r.get("sdc_partner")),
            }
        )
    return out


def catch(
    work: Path, name: str, recipe: str, steps: int, faults: list[str], sets: tuple = ()
) -> dict:
    run = work / name
    sets = [f"train.steps={steps}", "checkpoint.interval=5", "monitors.sdc.every=10", *sets]
    rc = launch(run, recipe, sets, faults)
    events = read(run / "events.jsonl")
    flips = [e for e in events if e["kind"] == "fault_injected" and "bitflip" in e["fault"]]
    found = [e for e in events if e["kind"] == "anomaly" and e.get("monitor") == "sdc"]
    out: dict = {"name": name, "recipe": recipe, "rc": rc, "faults": faults, "catches": []}
    if not flips:
        out["error"] = "the fault never fired"
        return out
    by_attempt = {e["attempt"]: e for e in flips}
    for f in found:
        inj = by_attempt.get(f.get("attempt")) or flips[0]
        rec_step = f["step"] + 1 if f["detail"].startswith("at_rest") else None
        if f["detail"].startswith("partner"):  # the record of the partner step it names
            rec_step = int(f["detail"].split(" batch(es) of step ")[1].split(" ")[0])
        elif rec_step is None:  # replica: caught at the record of the step it names in its detail
            rec_step = int(f["detail"].split(" at step ")[1].split(" ")[0])
        out["catches"].append(
            {
                "attempt": f.get("attempt"),
                "rank": f.get("rank"),
                "kind": f["detail"].split(":", 1)[0],
                "seconds": round(float(f["ts"]) - float(inj["ts"]), 3),
                "steps": rec_step - int(inj["step"]),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sdc_bench.json"))
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--cost-only", action="store_true", help="skip the time-to-catch runs")
    ap.add_argument("--recheck-only", action="store_true", help="the gradient recheck runs only")
    a = ap.parse_args()
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="sdc-bench-"))
    out: dict = {"work_dir": str(work), "cost": [], "catch": []}
    out["cost"].append(cost_recheck(work, a.steps))
    print(json.dumps(out["cost"][-1]), flush=True)
    out["cost"].append(cost_partner(work, a.steps))
    print(json.dumps(out["cost"][-1]), flush=True)
    recheck = ("monitors.sdc.recheck_every=5",)
    for name, faults in (
        ("catch_recheck_transient", ["bitflip:rank=1,step=10,target=grad"]),
        (
            "catch_recheck_persistent",
            ["bitflip:rank=1,step=11,target=grad,mode=persistent", "hold:step=21,seconds=60"],
        ),
    ):
        if not a.cost_only:
            out["catch"].append(catch(work, name, "titan-tiny", 24, faults, recheck))
            print(json.dumps(out["catch"][-1]), flush=True)
    if not a.cost_only:
        partner = (*recheck, "monitors.sdc.partner_every=5", "launch.nproc=3")
        bad = "bitflip:rank=1,step=11,target=compute,mode=persistent"
        faults = [bad, "hold:step=16,seconds=60"]
        out["catch"].append(catch(work, "catch_partner", "titan-tiny", 24, faults, partner))
        print(json.dumps(out["catch"][-1]), flush=True)
    for recipe in () if a.recheck_only else ("titan-tiny", "trl-sft-tiny"):
        out["cost"].append(cost(work, recipe, a.steps))
        print(json.dumps(out["cost"][-1]), flush=True)
    hold = "hold:step=12,seconds=60"
    for name, recipe, steps, faults in (
        ("catch_at_rest_transient", "titan-tiny", 16, ["bitflip:rank=1,step=11", hold]),
        (
            "catch_at_rest_persistent",
            "titan-tiny",
            16,
            ["bitflip:rank=1,step=11,mode=persistent", hold.replace("60", "60,attempt=0")],
        ),
        (
            "catch_replica",
            "trl-sft-tiny",
            24,
            ["bitflip:rank=1,step=13", "hold:step=21,seconds=60"],
        ),
    ):
        if a.cost_only or a.recheck_only:
            break
        out["catch"].append(catch(work, name, recipe, steps, faults))
        print(json.dumps(out["catch"][-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
