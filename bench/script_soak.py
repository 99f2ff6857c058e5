"""Unchanged scripts, irregular steps: no false hang with the shipped defaults, and a SIGSTOPped
rank found within its budget (issue 47, point 1).

    .venv/bin/python bench/script_soak.py [--profile quick|full] [--configs 60s] [--out DIR]

The script is ``tests/data/scripts/ddp_accum.py`` (the PyTorch tutorial's DDP trainer, gradient
accumulation over 2 micro-batches, no ptops in it), its step time set by its data loader's latency,
with the irregular parts users' scripts have: a first step slower by ``slow_first`` seconds, an
evaluation pass (as long as a step) every ``eval_every`` epochs, a rank-0 snapshot after each epoch.
Step times: 10 ms, 1 s, 10 s (``quick``), and 60 s (``full``). For each:

- **torchrun**: the script under plain ``torchrun`` (the peer: no hang detection at all), wall time;
- **healthy**: ``ptops launch --supervise --`` of the same command: must complete with 0 ``hang``
  events; wall time against torchrun's;
- **sigstop**: the same with ``hang:rank=1,step=S,mode=stop`` (SIGSTOP at a step past the first
  evaluation): the ``hang`` event must name rank 1; delay = its ``found_ts`` minus the fault's,
  against the budget it was judged by (the event's ``timeout_s``). torchrun is not run with the
  SIGSTOP: it would wait for gloo's 30-minute timeout.

Configurations run side by side (their ranks mostly sleep in the data loader); writes
``script_soak.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ptops.ops.supervisor.launcher import free_port

REPO = Path(__file__).resolve().parent.parent
PTOPS = [sys.executable, "-m", "ptops"]
SCRIPT = REPO / "tests" / "data" / "scripts" / "ddp_accum.py"
SAMPLES_PER_STEP = 8  # 2 micro-batches of 4 samples

# name -> (step s, epochs, micro-batches an epoch, eval every, slow first step s, SIGSTOP step)
CONFIGS = {
    "10ms": (0.01, 10, 40, 2, 2.0, 150),
    "1s": (1.0, 10, 4, 3, 10.0, 12),
    "10s": (10.0, 4, 4, 2, 20.0, 6),
    "60s": (60.0, 2, 4, 1, 60.0, 3),
}
PROFILES = {"quick": ("10ms", "1s", "10s"), "full": ("10ms", "1s", "10s", "60s")}


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def command(name: str) -> list[str]:
    step_s, epochs, batches, eval_every, slow_first, _ = CONFIGS[name]
    return [
        str(SCRIPT),
        "--epochs", str(epochs),
        "--batches", str(batches),
        "--io-latency", str(step_s / SAMPLES_PER_STEP),
        "--eval-every", str(eval_every),
        "--slow-first", str(slow_first),
    ]  # fmt: skip


def run(argv: list[str], cwd: Path) -> tuple[int, float, str]:
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=7200)
    return p.returncode, time.monotonic() - t0, p.stderr[-2000:]


def one(name: str, kind: str, root: Path) -> dict:
    cwd = root / f"{name}-{kind}"
    cwd.mkdir()
    if kind == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                *command(name)]  # fmt: skip
    else:
        fault = ["--fault", f"hang:rank=1,step={CONFIGS[name][5]},mode=stop"]
        argv = [*PTOPS, "launch", "--supervise", "--no-mlflow", "--run-dir", str(cwd / "run"),
                *(fault if kind == "sigstop" else []), "--", "python", *command(name)]  # fmt: skip
    code, wall, err = run(argv, cwd)
    out = {"config": name, "kind": kind, "exit": code, "wall_s": round(wall, 2)}
    if kind == "torchrun":
        return out
    events = read(cwd / "run" / "events.jsonl")
    hangs = [e for e in events if e["kind"] == "hang"]
    steps = [r["step_s"] for r in read(cwd / "run" / "metrics.jsonl") if r.get("rank") == 0]
    out.update(
        hangs=len(hangs),
        steps=len(steps),
        step_s_max=round(max(steps, default=0.0), 3),
        step_s_median=round(sorted(steps)[len(steps) // 2], 3) if steps else None,
    )
    if kind == "sigstop" and hangs:
        fault = next(e for e in events if e["kind"] == "fault_injected")
        h = hangs[0]
        out.update(
            named=h["ranks"],
            why=h["why"],
            delay_s=round(h["found_ts"] - fault["ts"], 2),
            budget_s=h["timeout_s"],
            within=h["found_ts"] - fault["ts"] <= h["timeout_s"] + 2.0,
        )
    if code != 0:
        out["stderr"] = err
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--configs", help="comma-separated step times to run instead (e.g. 60s)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    names = args.configs.split(",") if args.configs else PROFILES[args.profile]
    jobs = [(n, k) for n in names for k in ("torchrun", "healthy", "sigstop")]
    with tempfile.TemporaryDirectory(prefix="script-soak-") as tmp:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(pool.map(lambda j: one(*j, Path(tmp)), jobs))
    by = {(r["config"], r["kind"]): r for r in results}
    for n in names:
        ref, ok = by[(n, "torchrun")], by[(n, "healthy")]
        if ref["exit"] == 0 and ok["exit"] == 0:
            ok["wall_vs_torchrun"] = round(ok["wall_s"] / ref["wall_s"], 3)
    summary = {
        "configs": list(names),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "false_hangs": sum(r.get("hangs", 0) for r in results if r["kind"] == "healthy"),
        "healthy_completed": all(r["exit"] == 0 for r in results if r["kind"] == "healthy"),
        "sigstops_found_within_budget": all(
            r.get("within") and r.get("named") == [1] for r in results if r["kind"] == "sigstop"
        ),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "script_soak.json" if not args.configs else f"script_soak_{'_'.join(names)}.json"
    (args.out / name).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "stderr"}))


if __name__ == "__main__":
    main()
