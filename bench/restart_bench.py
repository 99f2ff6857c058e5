"""Fast restart: crash -> the restarted attempt's first productive step, ptops warm vs ptops cold vs
plain torchrun.

    .venv/bin/python bench/restart_bench.py [--repeat 3] [--out bench/results/restart_bench.json]

One bench run, same recipe (titan-tiny, 16 steps, checkpoint every 5) and the same fault (rank 1
SIGKILLs itself at step 12), side by side:

- ``ptops_cold``: ``ptops launch --supervise`` as shipped (a new torchrun per attempt; every rank
  imports torch and torchtitan again);
- ``ptops_warm``: the same with ``supervisor.restart.warm_spare=true`` (the ranks of the restart are
  forked from a pool that imported the engine during the first attempt, without a new torchrun:
  ops/rank/warm.py, ops/rank/warmlaunch.py);
- ``torchrun``: plain ``torchrun --max-restarts=1 --rdzv-backend c10d`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (bench/supervisor_bench.py's peer), in every round.

Every run is held 45 s before step 12 (a ``hold`` fault, in all three) so that the crash comes once
the pool is warm, as it would hours into a real run (the pool starts with the first attempt and
takes 20-45 s to import on this shared box). The figure: from the crash's ``fault_injected`` to rank
0's first metrics record of the restarted worker group; ``repeat`` rounds of (torchrun, cold, warm),
medians and the per-round ratios warm/torchrun, cold/torchrun and warm/cold (the box is shared: only
ratios within a round compare like with like). Final digests must equal an uninterrupted run's
(exact recovery).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
SETS = ["--set", "train.steps=16", "--set", "checkpoint.interval=5"]
CRASH = "crash:rank=1,step=12"
HOLD = "hold:step=12,seconds=45"


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def ptops_run(run: Path, warm: bool, faults: bool = True) -> dict:
    argv = [
        sys.executable,
        "-m",
        "ptops",
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        *SETS,
    ]
    if faults:
        argv += ["--fault", CRASH, "--fault", HOLD]
    if warm:
        argv += ["--set", "supervisor.restart.warm_spare=true"]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1200)
    out: dict = {"exit_code": p.returncode, "wall_s": round(time.monotonic() - t0, 1)}
    from ptops.ckpt import digest

    out["digest"] = (
        digest(run / "checkpoints" / "step-16")
        if (run / "checkpoints" / "step-16").exists()
        else None
    )
    if not faults:
        return out
    ev = read(run / "events.jsonl")
    inj = next(e for e in ev if e["kind"] == "fault_injected" and e["fault"].startswith("crash"))
    crash = next(e for e in ev if e["kind"] == "crash")
    launch = next(e for e in ev if e["kind"] == "launch" and e["attempt"] == 2)
    first = next(r for r in read(run / "metrics.jsonl") if r.get("attempt") == 2 and r["rank"] == 0)
    log = (run / "logs" / "attempt-2" / "rank-0.log").read_text(errors="replace")
    out.update(
        {
            "detect_s": round(crash["ts"] - inj["ts"], 2),
            "fault_to_relaunch_s": round(launch["ts"] - inj["ts"], 2),
            "fault_to_first_productive_step_s": round(first["ts"] - inj["ts"], 2),
            "ranks_warm": "warm rank: forked from pool" in log,
        }
    )
    return out


def _ratio(a: dict, b: dict) -> float | None:
    x, y = a.get("fault_to_first_productive_step_s"), b.get("fault_to_first_productive_step_s")
    return round(x / y, 3) if x is not None and y else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "restart_bench.json")
    ap.add_argument("--no-torchrun", action="store_true")
    a = ap.parse_args()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="ptops-restart-bench-") as d:
        tmp = Path(d)
        res["reference"] = ptops_run(tmp / "ref", warm=False, faults=False)
        print("reference", json.dumps(res["reference"]), flush=True)
        for i in range(a.repeat):
            rnd: dict = {}
            if not a.no_torchrun:
                import supervisor_bench as sb

                rnd["torchrun"] = sb.torchrun_fault(
                    "titan-tiny", tmp, f"crash-{i}", CRASH, give_up_s=150
                )
            rnd["cold"] = ptops_run(tmp / f"cold-{i}", warm=False)
            rnd["warm"] = ptops_run(tmp / f"warm-{i}", warm=True)
            rnd["ratio_warm_over_cold"] = _ratio(rnd["warm"], rnd["cold"])
            if "torchrun" in rnd:
                rnd["ratio_warm_over_torchrun"] = _ratio(rnd["warm"], rnd["torchrun"])
                rnd["ratio_cold_over_torchrun"] = _ratio(rnd["cold"], rnd["torchrun"])
            res["rounds"].append(rnd)
            print(f"round {i + 1}", json.dumps(rnd), flush=True)
    for k in ("torchrun", "cold", "warm"):
        xs = [r[k]["fault_to_first_productive_step_s"] for r in res["rounds"] if k in r]
        if xs and None not in xs:
            res[f"median_{k}_s"] = round(statistics.median(xs), 2)
    for k in ("warm_over_cold", "warm_over_torchrun", "cold_over_torchrun"):
        xs = [r[f"ratio_{k}"] for r in res["rounds"] if r.get(f"ratio_{k}") is not None]
        if xs:
            res[f"median_ratio_{k}"] = statistics.median(xs)
    ref = res["reference"]["digest"]
    res["digests_equal_reference"] = all(
        r[k]["digest"] == ref for r in res["rounds"] for k in ("cold", "warm")
    )
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
