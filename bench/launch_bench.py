"""Launch to the first step and to the end: a standing warm pool (``ptops warm``) vs a cold
``ptops launch`` vs plain torchrun on the same ranks.

    .venv/bin/python bench/launch_bench.py [--recipe titan-tiny --recipe trl-dpo-tiny] \\
        [--steps 4] [--repeat 3] [--out bench/results/launch_bench.json]

In each round, for each recipe, one after another on the same box:

- ``torchrun``: the ranks' own torchrun command (``launcher.rank_command``), no supervisor: what a
  user without ptops runs (``bench/supervisor_bench.py``'s peer);
- ``ptops_cold``: ``ptops launch --supervise`` as shipped (torchrun under the supervisor; every rank
  imports torch and the engine);
- ``ptops_standing``: the same with ``PTOPS_STANDING_POOL`` naming a ``ptops warm`` started once
  before the rounds (its import time is reported on its own, ``pool_ready_s``).

Figures: wall time of the command (``total_s``) and from its start to rank 0's first step record
(``first_step_s``); medians over rounds and the per-round ratios standing/torchrun and
cold/torchrun (the box is shared: only ratios within a round compare like with like). Every run's
final digest must equal the torchrun run's (the pool changes where ranks come from, not what they
compute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptops import envnames

REPO = Path(__file__).resolve().parent.parent
PTOPS = [sys.executable, "-m", "ptops"]
STANDING = envnames.STANDING_POOL


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def first_step_s(run: Path, t0: float) -> float | None:
    ts = [r["ts"] for r in read(run / "metrics.jsonl") if r.get("rank") == 0 and "ts" in r]
    return round(min(ts) - t0, 2) if ts else None


def digest(run: Path) -> str:
    from ptops.ckpt import digest as d
    from ptops.ckpt import latest_good

    good = latest_good(run)
    return d(good.path) if good is not None else ""


def ptops_run(recipe: str, steps: int, run: Path, pool: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != STANDING}
    if pool:
        env[STANDING] = pool
    argv = [*PTOPS, "launch", recipe, "--supervise", "--run-dir", str(run), "--no-mlflow"]
    argv += ["--set", f"train.steps={steps}"]
    t0 = time.time()
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    total = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr[-2000:]}")
    launches = [e for e in read(run / "events.jsonl") if e["kind"] == "launch"]
    return {
        "total_s": round(total, 2),
        "first_step_s": first_step_s(run, t0),
        "ranks_from": [e["ranks_from"] for e in launches],
        "digest": digest(run),
    }


def torchrun_run(recipe: str, steps: int, run: Path) -> dict:
    from ptops.ops.supervisor import launcher
    from ptops.recipes.schema import load

    rec, path = load(recipe, [f"train.steps={steps}"])
    rd = launcher.prepare_run(rec, path, run)
    rd.logs(1).mkdir(parents=True, exist_ok=True)
    cmd = launcher.rank_command(rec, rd, 1)
    env = {k: v for k, v in cmd.env.items() if k != STANDING}
    t0 = time.time()
    with open(rd.logs(1) / "torchrun.log", "wb") as log:
        rc = subprocess.run(cmd.argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    total = time.time() - t0
    if rc.returncode != 0:
        raise RuntimeError(f"torchrun exited {rc.returncode}: {rd.logs(1) / 'torchrun.log'}")
    return {
        "total_s": round(total, 2),
        "first_step_s": first_step_s(run, t0),
        "digest": digest(run),
    }


def start_pool(name: str, logs: Path) -> tuple[subprocess.Popen, float]:
    t0 = time.time()
    proc = subprocess.Popen(
        [*PTOPS, "warm", "titan", "trl", "--name", name, "--log-dir", str(logs), "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if not proc.stdout.readline():
        raise RuntimeError(f"`ptops warm` exited {proc.wait()}: see {logs}")
    return proc, round(time.time() - t0, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", action="append")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "launch_bench.json")
    a = ap.parse_args()
    recipes = a.recipe or ["titan-tiny", "trl-dpo-tiny"]
    tmp = Path(tempfile.mkdtemp(prefix="ptops-launch-bench-"))
    name = f"ptops-bench-{os.getpid()}"
    pool, ready_s = start_pool(name, tmp / "warm")
    print(f"pool ready in {ready_s} s", file=sys.stderr)
    rounds: dict[str, list[dict]] = {r: [] for r in recipes}
    try:
        for i in range(a.repeat):
            for recipe in recipes:
                got = {
                    "torchrun": torchrun_run(recipe, a.steps, tmp / f"{recipe}-{i}-torchrun"),
                    "ptops_cold": ptops_run(recipe, a.steps, tmp / f"{recipe}-{i}-cold", None),
                    "ptops_standing": ptops_run(recipe, a.steps, tmp / f"{recipe}-{i}-pool", name),
                }
                ref = got["torchrun"]["digest"]
                got["digests_equal"] = bool(ref) and all(v["digest"] == ref for v in got.values())
                for k in ("ptops_cold", "ptops_standing"):
                    got[f"{k}/torchrun"] = round(got[k]["total_s"] / got["torchrun"]["total_s"], 3)
                rounds[recipe].append(got)
                print(f"round {i + 1} {recipe}: " + json.dumps(
                    {k: v["total_s"] if isinstance(v, dict) else v for k, v in got.items()}
                ), file=sys.stderr)  # fmt: skip
    finally:
        pool.terminate()
        pool.wait(timeout=30)
    summary = {}
    for recipe, rs in rounds.items():
        row = {}
        for k in ("torchrun", "ptops_cold", "ptops_standing"):
            row[f"{k}_total_s"] = statistics.median(r[k]["total_s"] for r in rs)
            row[f"{k}_first_step_s"] = statistics.median(r[k]["first_step_s"] for r in rs)
        for k in ("ptops_cold/torchrun", "ptops_standing/torchrun"):
            row[k] = round(statistics.median(r[k] for r in rs), 3)
        row["digests_equal"] = all(r["digests_equal"] for r in rs)
        row["standing_ranks_from"] = sorted(
            {x for r in rs for x in r["ptops_standing"]["ranks_from"]}
        )
        summary[recipe] = row
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "steps": a.steps,
        "repeat": a.repeat,
        "pool_ready_s": ready_s,
        "summary": summary,
        "rounds": rounds,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print("| recipe | torchrun s | ptops cold s | ptops standing s | standing/torchrun | digests |")
    print("|---|---|---|---|---|---|")
    for recipe, r in summary.items():
        print(
            f"| {recipe} | {r['torchrun_total_s']} | {r['ptops_cold_total_s']} | "
            f"{r['ptops_standing_total_s']} | {r['ptops_standing/torchrun']} | "
            f"{'equal' if r['digests_equal'] else 'DIFFER'} |"
        )
    return 0 if all(r["digests_equal"] for r in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
