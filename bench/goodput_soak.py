"""Goodput under random faults: ptops --supervise vs plain torchrun --max-restarts, side by side.

    .venv/bin/python bench/goodput_soak.py --minutes 30 [--fault-every 90] [--out bench/results/goodput_soak.json]
    .venv/bin/python bench/goodput_soak.py --minutes 3 --fault-every 40       # the short run in bench/README.md

Each peer trains titan-tiny (checkpoint every 20 steps, far more steps than fit) for ``--minutes`` of wall
time, one peer after the other, with a random fault every ~``--fault-every`` seconds (uniform in 0.67-1.33x; kinds from a shuffled bag,
each once per round):

- ptops (``--supervise``, ``supervisor.restart.warm_spare=true``): each fault is armed live with
  ``ptops inject RUN <kind>:...,step=<next step>``, kinds drawn from crash, hang (a Python hang),
  hang by SIGSTOP, slow (rank 1 +0.5 s for 20 steps), nan (rollback); at the end the supervisor is
  asked to stop (SIGINT: it checkpoints and exits 130). ``preempt`` is left out: a preempted ptops run
  stops (exit 143) for its scheduler to requeue, which this single-machine soak has no scheduler for;
- torchrun (``--max-restarts=100 --rdzv-backend c10d``, the peer of bench/supervisor_bench.py): the
  faults are given up front (the probe reads them from the environment; no supervisor to arm them
  live), at the steps the ptops run's median step time puts them, one per restart of the worker group;
  kinds drawn from crash and hang (torchrun has no NaN rollback and no notion of slow).

Goodput, the same formula for both: the step time of each step's last execution on rank 0 (steps
redone after a restart or a rollback count once), summed, over the wall time from launch to the end.
ptops' own account (``ptops status --json`` ``goodput``) is reported next to it, and distinct steps
trained per wall minute (a slowed step counts as productive time in the ratio, not in the steps).

NVIDIA's ft_launcher (nvidia-resiliency-ext 0.4.1 installs here) is not run: it restarts through
torchrun's elastic agent, whose restarted workers do not train on this stack (see bench/README.md),
and it needs per-step heartbeats (``RankMonitorClient``) wired into the training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from supervisor_bench import torchrun_peer_argv, torchrun_peer_env  # noqa: E402  (bench/ is on sys.path)

PTOPS = [sys.executable, "-m", "ptops"]
SETS = ["train.steps=100000", "checkpoint.interval=20", "checkpoint.keep=2"]


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def goodput(run: Path, wall_s: float) -> dict:
    last: dict[int, float] = {}
    for r in read(run / "metrics.jsonl"):
        if r.get("rank") == 0 and isinstance(r.get("step_s"), (int, float)):
            last[int(r["step"])] = float(r["step_s"])  # a redone step: its last execution counts
    productive = sum(last.values())
    return {"steps": max(last, default=0), "productive_s": round(productive, 1), "wall_s": round(wall_s, 1),
            "steps_per_min": round(60 * len(last) / wall_s, 1) if wall_s > 0 else 0.0,
            "goodput": round(productive / wall_s, 3) if wall_s > 0 else 0.0,
            "median_step_s": round(statistics.median(last.values()), 3) if last else None}


def current_step(run: Path) -> int:
    steps = [int(r["step"]) for r in read(run / "metrics.jsonl") if r.get("rank") == 0]
    return max(steps, default=0)


_BAGS: dict[tuple[str, ...], list[str]] = {}


def draw_fault(rng: random.Random, step: int, kinds: tuple[str, ...]) -> str:
    """The next fault: kinds are drawn from a shuffled bag (every kind once per round), so a short run
    still sees each of them."""
    bag = _BAGS.setdefault(kinds, [])
    if not bag:
        bag.extend(rng.sample(kinds, len(kinds)))
    kind = bag.pop()
    rank = rng.choice((0, 1))
    return {
        "crash": f"crash:rank={rank},step={step}",
        "hang": f"hang:rank={rank},step={step}",
        "hang_stop": f"hang:rank={rank},step={step},mode=stop",
        "slow": f"slow:rank=1,step={step},seconds=0.5,steps=20",
        "nan": f"nan:step={step}",
    }[kind]


def ptops_soak(tmp: Path, minutes: float, every: float, rng: random.Random) -> dict:
    run = tmp / "ptops"
    argv = [*PTOPS, "launch", "titan-tiny", "--supervise", "--run-dir", str(run),
            "--set", "supervisor.restart.warm_spare=true", "--set", "supervisor.restart.max_restarts=1000",
            "--set", "supervisor.restart.storm_restarts=1000"]
    for s in SETS:
        argv += ["--set", s]
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    injected: list[dict] = []
    next_fault = t0 + every * rng.uniform(0.67, 1.33)
    try:
        while time.time() - t0 < minutes * 60 and proc.poll() is None:
            time.sleep(1.0)
            if time.time() >= next_fault and current_step(run) > 0:
                spec = draw_fault(rng, current_step(run) + 2, ("crash", "hang", "hang_stop", "slow", "nan"))
                r = subprocess.run([*PTOPS, "inject", str(run), spec], cwd=REPO, capture_output=True, text=True)
                injected.append({"t": round(time.time() - t0, 1), "spec": spec, "ok": r.returncode == 0})
                next_fault = time.time() + every * rng.uniform(0.67, 1.33)
    finally:
        wall = time.time() - t0
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the supervisor stops the ranks (checkpoint) and exits
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = goodput(run, wall)
    st = subprocess.run([*PTOPS, "status", str(run), "--json"], cwd=REPO, capture_output=True, text=True)
    try:
        out["ptops_account"] = json.loads(st.stdout).get("goodput")
    except ValueError:
        out["ptops_account"] = None
    ev = read(run / "events.jsonl")
    out["faults"] = injected
    out["restarts"] = sum(e["kind"] == "restart" for e in ev)
    out["findings"] = {k: sum(e["kind"] == k for e in ev) for k in ("crash", "hang", "rollback", "straggler")}
    return out


def torchrun_soak(tmp: Path, minutes: float, every: float, step_s: float, rng: random.Random) -> dict:
    from ptops.faultinject.spec import parse, to_env
    from ptops.ops.supervisor import launcher
    from ptops.ops.supervisor.procs import run_processes, signal_all
    from ptops.recipes.schema import load

    rec, path = load("titan-tiny", SETS)
    run = launcher.prepare_run(rec, path, tmp / "torchrun")
    run.logs(1).mkdir(parents=True, exist_ok=True)
    # one fault per worker group (attempt = restart count + 1), at the steps ~every seconds apart
    faults, step = [], 0
    for attempt in range(1, 50):
        step += max(1, int(every * rng.uniform(0.67, 1.33) / max(step_s, 1e-3)))
        faults.append(parse(draw_fault(rng, step, ("crash", "hang")) + f",attempt={attempt}"))
    cmd = launcher.rank_command(rec, run, 1, {"PTOPS_FAULTS": to_env(faults)})
    argv = torchrun_peer_argv(cmd.argv, max_restarts=100)
    t0 = time.time()
    with open(run.logs(1) / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(argv, env=torchrun_peer_env(cmd.env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while time.time() - t0 < minutes * 60 and proc.poll() is None:
            time.sleep(1.0)
    finally:
        wall = time.time() - t0
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        signal_all(run_processes(run.path), signal.SIGKILL)
    out = goodput(run.path, wall)
    out["torchrun_exit"] = proc.returncode
    out["faults_planned"] = [str(f) for f in faults[:5]]
    out["fired"] = [e.get("fault") for e in read(run.events) if e.get("kind") == "fault_injected"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="wall time of each peer's run")
    ap.add_argument("--fault-every", type=float, default=90.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "goodput_soak.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": a.minutes,
                 "fault_every_s": a.fault_every, "seed": a.seed}
    with tempfile.TemporaryDirectory(prefix="ptops-goodput-soak-") as d:
        tmp = Path(d)
        res["ptops"] = ptops_soak(tmp, a.minutes, a.fault_every, rng)
        print("ptops", json.dumps(res["ptops"]), flush=True)
        res["torchrun"] = torchrun_soak(tmp, a.minutes, a.fault_every, res["ptops"]["median_step_s"] or 0.2, rng)
        print("torchrun", json.dumps(res["torchrun"]), flush=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: ({"goodput": v.get("goodput"), "steps_per_min": v.get("steps_per_min")} if isinstance(v, dict)
                          else v) for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
