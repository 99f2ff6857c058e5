"""Goodput under random faults: ptops --supervise vs plain torchrun vs NVIDIA's ft_launcher, side by
side.

    .venv/bin/python bench/goodput_soak.py --minutes 30  # the soak of issue 12 (~31 min)
    .venv/bin/python bench/goodput_soak.py --minutes 3 --fault-every 40 \\
        --out bench/results/goodput_soak_smoke.json  # the smoke in bench/README.md
    # its README table
    .venv/bin/python bench/goodput_soak.py --table bench/results/goodput_soak.json

Each peer trains titan-tiny (checkpoint every 20 steps, far more steps than fit) for ``--minutes``
of wall time in its own run directory, on its own free ports. By default the peers run concurrently
(started together, so they share the machine's load; ``--sequential``: one after the other). Every
peer faces the same fault sequence: one list drawn from ``--seed`` of (gap, kind, rank), gaps
uniform in 0.67-1.33x ``--fault-every`` seconds, kinds from a shuffled bag (every kind once per
round) of crash, hang (a Python hang), hang by SIGSTOP, slow (rank 1 +0.5 s for 20 steps) and nan. A
gap is turned into steps of progress (``--step-s`` seconds per step), so every peer meets the same
fault at the same step:

- ptops (``--supervise``, ``supervisor.restart.warm_spare=true``): each fault is armed live with
  ``ptops inject RUN <kind>:...,step=<its step>`` shortly before training reaches that step; at the
  end the supervisor is asked to stop (SIGINT). ``preempt`` is left out: a preempted ptops run stops
  (exit 143) for its scheduler to requeue, which this single-machine soak has no scheduler for;
- torchrun (``--max-restarts=1000 --rdzv-backend c10d``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
  the peer of bench/supervisor_bench.py) and ft_launcher (the same flags plus ``--ft-*`` heartbeat
  timeouts, ranks run through bench/ft_worker.py, which sends one heartbeat per step): no supervisor
  to arm a fault live, so the faults are given up front in ``PTOPS_FAULTS`` at the same steps, each
  keyed to the worker group it falls in (a crash, a hang or a NaN loss, which torchtitan's check
  turns into a dead rank, ends a group; the next fault is for the restarted one: torchrun's restart
  count is the probe's attempt).

Goodput, the same formula for every peer: the step time of each step's last execution on rank 0
(steps redone after a restart or a rollback count once; a step whose loss is NaN/Inf is not
productive), summed, over the wall time from launch to the end. ptops' own account (``ptops status
--json`` ``goodput``) is reported next to it, and distinct steps trained per wall minute. The ft
peer is skipped, with the reason printed, when nvidia-resiliency-ext is not installed in bench/.nvrx
(see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ptops import envnames

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from supervisor_bench import torchrun_peer_argv, torchrun_peer_env  # noqa: E402  (bench/ is on sys.path)

PTOPS = [sys.executable, "-m", "ptops"]
SETS = ["train.steps=100000", "checkpoint.interval=20", "checkpoint.keep=2"]
KINDS = ("crash", "hang", "hang_stop", "slow", "nan")
# under torchrun/ft these end the worker group, so the next fault is for the restarted one; a NaN
# loss too: torchtitan's finite-loss check raises in the step (recipes/titan/trainer.py), the rank
# dies, the agent restarts the group from the last checkpoint (measured: seed 4, nan at step 291 ->
# group 2)
ENDS_GROUP = ("crash", "hang", "hang_stop", "nan")
NVRX = REPO / "bench" / ".nvrx"
FT_LAUNCHER = "nvidia_resiliency_ext.fault_tolerance.launcher"
# what a careful user sets instead of NVIDIA's defaults (3600 s initial, 2700 s after): the first
# beat comes after imports, model build and checkpoint load (~30 s on this loaded machine), the next
# ones every step (~0.1-0.5 s; a checkpoint save ~1-2 s)
FT_INITIAL_TIMEOUT_S = 60.0
FT_TIMEOUT_S = 10.0
PEERS = ("ptops", "torchrun", "ft")
ARM_AHEAD = (
    30  # ptops: a planned fault is injected live this many steps before its step (polled every 1 s)
)


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def goodput(run: Path, wall_s: float) -> dict:
    last: dict[int, float] = {}
    for r in read(run / "metrics.jsonl"):
        if r.get("rank") == 0 and isinstance(r.get("step_s"), (int, float)):
            loss = r.get("loss")
            bad = isinstance(loss, str) or (isinstance(loss, float) and not math.isfinite(loss))
            last[int(r["step"])] = (
                0.0 if bad else float(r["step_s"])
            )  # a redone step: its last execution counts
    productive = sum(last.values())
    good = [v for v in last.values() if v > 0]
    return {
        "steps": max(last, default=0),
        "productive_s": round(productive, 1),
        "wall_s": round(wall_s, 1),
        "steps_per_min": round(60 * len(good) / wall_s, 1) if wall_s > 0 else 0.0,
        "nan_steps": len(last) - len(good),
        "goodput": round(productive / wall_s, 3) if wall_s > 0 else 0.0,
        "median_step_s": round(statistics.median(good), 3) if good else None,
    }


class StepTail:
    """The highest step rank 0 recorded, read incrementally (the soak polls it every second for 30
    min)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step, self.rest = path, 0, 0, b""

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.step
        self.offset += len(chunk)
        *lines, self.rest = (self.rest + chunk).split(b"\n")
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("rank") == 0 and isinstance(r.get("step"), int):
                self.step = max(self.step, r["step"])
        return self.step


def fault_plan(seed: int, every: float, minutes: float) -> list[tuple[float, str, int]]:
    """The sequence every peer faces: (gap in seconds, kind, rank), kinds from a shuffled bag."""
    rng = random.Random(seed)
    plan, bag, t = [], [], 0.0
    while t < minutes * 60 + every:
        if not bag:
            bag = rng.sample(KINDS, len(KINDS))
        gap = every * rng.uniform(0.67, 1.33)
        plan.append((gap, bag.pop(), rng.choice((0, 1))))
        t += gap
    return plan


def spec(kind: str, rank: int, step: int) -> str:
    return {
        "crash": f"crash:rank={rank},step={step}",
        "hang": f"hang:rank={rank},step={step}",
        "hang_stop": f"hang:rank={rank},step={step},mode=stop",
        "slow": f"slow:rank=1,step={step},seconds=0.5,steps=20",
        "nan": f"nan:step={step}",
    }[kind]


def stop_group(proc: subprocess.Popen, sig: int, grace: float, leader_only: bool = False) -> None:
    """Signal the peer's process group (or its leader only); after ``grace``, SIGKILL what is left
    of it."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig) if leader_only else os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived its leader
    except ProcessLookupError:
        pass
    proc.wait()


def ptops_soak(tmp: Path, minutes: float, plan: list, step_s: float) -> dict:
    run = tmp / "ptops"
    argv = [
        *PTOPS,
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--set",
        "supervisor.restart.warm_spare=true",
        "--set",
        "supervisor.restart.max_restarts=1000",
        "--set",
        "supervisor.restart.storm_restarts=1000",
    ]
    for s in SETS:
        argv += ["--set", s]
    t0 = time.time()
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    injected: list[dict] = []
    refused = 0
    todo = plan_steps(plan, step_s)
    current_step = StepTail(run / "metrics.jsonl")
    try:
        while time.time() - t0 < minutes * 60 and proc.poll() is None:
            time.sleep(1.0)
            cur = current_step()
            if todo and cur > 0 and cur >= todo[0][0] - ARM_AHEAD:
                step, kind, rank, _ = todo[0]
                s = spec(
                    kind, rank, max(step, cur + 2)
                )  # the plan's step, or the next one if training passed it
                r = subprocess.run(
                    [*PTOPS, "inject", str(run), s], cwd=REPO, capture_output=True, text=True
                )
                if r.returncode == 0:
                    injected.append({"t": round(time.time() - t0, 1), "spec": s})
                    todo.pop(0)
                else:  # refused (between attempts): armed again on the next poll
                    refused += 1
    finally:
        wall = time.time() - t0
        stop_group(
            proc, signal.SIGINT, 120, leader_only=True
        )  # the supervisor stops the ranks (checkpoint), exits 130
        from ptops.ops.supervisor.procs import run_processes, signal_all

        signal_all(run_processes(run), signal.SIGKILL)
    out = goodput(run, wall)
    st = subprocess.run(
        [*PTOPS, "status", str(run), "--json"], cwd=REPO, capture_output=True, text=True
    )
    try:
        out["ptops_account"] = json.loads(st.stdout).get("goodput")
    except ValueError:
        out["ptops_account"] = None
    ev = read(run / "events.jsonl")
    out["exit"] = proc.returncode
    out["faults"] = injected
    out["inject_refused"] = refused
    out["fired"] = fired(ev, t0)
    out["restarts"] = sum(e["kind"] == "restart" for e in ev)
    out["findings"] = {
        k: sum(e["kind"] == k for e in ev) for k in ("crash", "hang", "rollback", "straggler")
    }
    return out


def fired(events: list[dict], t0: float) -> list[dict]:
    out, seen = [], set()
    for (
        e
    ) in events:  # a fault of every rank (nan) is recorded by each: once per fault and worker group
        if e.get("kind") == "fault_injected" and (e.get("fault"), e.get("attempt")) not in seen:
            seen.add((e.get("fault"), e.get("attempt")))
            out.append({"t": round(float(e.get("ts", t0)) - t0, 1), "fault": e.get("fault")})
    return out


def plan_steps(plan: list, step_s: float) -> list[tuple[int, str, int, int]]:
    """The plan in steps, the same for every peer: (step, kind, rank, worker group under
    torchrun/ft).

    A gap of ``g`` seconds is ``g / step_s`` steps of progress; a crash or a hang ends a torchrun/ft
    worker group, so the next fault is keyed to the restarted one."""
    out, step, attempt = [], 0, 1
    for gap, kind, rank in plan:
        step += max(1, round(gap / max(step_s, 1e-3)))
        out.append((step, kind, rank, attempt))
        attempt += kind in ENDS_GROUP
    return out


def up_front(plan: list, step_s: float) -> list:
    """The plan as faults given at launch (``PTOPS_FAULTS``)."""
    from ptops.faultinject.spec import parse

    return [
        parse(spec(kind, rank, step) + f",attempt={attempt}")
        for step, kind, rank, attempt in plan_steps(plan, step_s)
    ]


def ft_missing() -> str | None:
    """Why the ft peer cannot run here, or None."""
    if not (NVRX / "nvidia_resiliency_ext").is_dir():
        return (
            f"nvidia-resiliency-ext is not installed in {NVRX} (install command: bench/README.md)"
        )
    r = subprocess.run(
        [sys.executable, "-c", f"import {FT_LAUNCHER}"],
        env={**os.environ, "PYTHONPATH": str(NVRX)},
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return f"{FT_LAUNCHER} does not import: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def elastic_soak(peer: str, tmp: Path, minutes: float, plan: list, step_s: float) -> dict:
    """The torchrun or the ft_launcher peer: the ranks' own command, restarted by torch's elastic
    agent."""
    from ptops.faultinject.spec import to_env
    from ptops.ops.supervisor import launcher
    from ptops.ops.supervisor.procs import run_processes, signal_all
    from ptops.recipes.schema import load

    rec, path = load("titan-tiny", SETS)
    run = launcher.prepare_run(rec, path, tmp / peer)
    run.logs(1).mkdir(parents=True, exist_ok=True)
    faults = up_front(plan, step_s)
    cmd = launcher.rank_command(rec, run, 1, {envnames.FAULTS: to_env(faults)})
    argv = torchrun_peer_argv(cmd.argv, max_restarts=1000)
    # ft_launcher's agent shares its store with the workers only for the static rendezvous, so its
    # restarted group trains without torch's opt-out (checked here: crash -> the next group trains)
    env = torchrun_peer_env(cmd.env) if peer == "torchrun" else dict(cmd.env)
    if peer == "ft":
        i = argv.index("torch.distributed.run")
        argv[i] = FT_LAUNCHER
        # torchrun's own rank command (--no-python, the interpreter and its flags, the entry)
        # becomes ft_launcher's worker script, which it runs with its own interpreter
        j = argv.index("ptops.ops.rank.entry")
        argv[argv.index("--no-python") : j + 1] = [
            f"--ft-initial-rank-heartbeat-timeout={FT_INITIAL_TIMEOUT_S}",
            f"--ft-rank-heartbeat-timeout={FT_TIMEOUT_S}",
            str(REPO / "bench" / "ft_worker.py"),
        ]
        (tmp / "ft-tmp").mkdir(exist_ok=True)
        env = {
            **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(NVRX), env.get("PYTHONPATH")])),
            "TMPDIR": str(tmp / "ft-tmp"),
        }  # its IPC sockets go there, not into /tmp
    t0 = time.time()
    with open(run.logs(1) / f"{peer}.log", "wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while time.time() - t0 < minutes * 60 and proc.poll() is None:
            time.sleep(1.0)
    finally:
        wall = time.time() - t0
        stop_group(proc, signal.SIGKILL, 10)
        signal_all(run_processes(run.path), signal.SIGKILL)
    out = goodput(run.path, wall)
    m0 = [r for r in read(run.path / "metrics.jsonl") if r.get("rank") == 0]
    out["exit"] = proc.returncode
    out["argv"] = argv[2:]
    out["faults_planned"] = [str(f) for f in faults if 0 < f.step <= out["steps"] + 200][:40]
    out["fired"] = fired(read(run.events), t0)
    out["groups"] = max(
        (int(r.get("attempt") or 1) for r in m0), default=0
    )  # worker groups that trained
    out["restarts"] = out["groups"] - 1 if out["groups"] else 0
    return out


def orphans(tmp: Path) -> list[str]:
    """Live processes whose command line or environment names this soak's directory."""
    me, hits = os.getpid(), []
    key = str(tmp).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if key in cmd or key in env:
            line = cmd.replace(b"\0", b" ").decode(errors="replace")[:120]
            hits.append(f"{name} {line}")
    return hits


def table(res: dict) -> str:
    """The bench/README.md table of one result file."""
    rows = [
        "| | goodput | distinct steps per wall minute | median step s | faults that fired | "
        "restarts |",
        "|---|---|---|---|---|---|",
    ]
    for peer in PEERS:
        v = res.get(peer)
        if not isinstance(v, dict):
            continue
        if "skipped" in v:
            rows.append(f"| {peer} | skipped: {v['skipped']} | | | | |")
            continue
        acc = v.get("ptops_account") or {}
        own = f" (its own account: {acc.get('ratio', acc.get('goodput'))})" if acc else ""
        fr = "; ".join(f"{f['fault']} at {f['t']:.0f} s" for f in v.get("fired", [])) or "none"
        rows.append(
            f"| {peer} | {v['goodput']}{own} | {v['steps_per_min']} | {v.get('median_step_s')} | "
            f"{fr} | "
            f"{v.get('restarts')} |"
        )
    la = res.get("loadavg") or {}
    lost = ((res.get("ptops") or {}).get("ptops_account") or {}).get("lost_s") or {}
    if lost:
        rows.append("")
        rows.append(
            "Where ptops' wall time went (its account): "
            + ", ".join(f"{k} {v:.1f} s" for k, v in lost.items())
        )
    rows.append("")
    rows.append(
        f"{res.get('mode')}, {res.get('minutes')} min per peer, a fault every "
        f"~{res.get('fault_every_s')} s, "
        f"seed {res.get('seed')}, step_s for up-front faults {res.get('step_s')}; load average "
        "(1 min) "
        f"min {la.get('min')} / median {la.get('median')} / max {la.get('max')}; orphans after: "
        f"{len(res.get('orphans') or [])}"
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="wall time of each peer's run")
    ap.add_argument("--fault-every", type=float, default=90.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--step-s",
        type=float,
        default=0.1,
        help="seconds per step the up-front faults of torchrun/ft assume (titan-tiny, 3 peers "
        "concurrently: median 0.07-0.10 s measured in the smoke)",
    )
    ap.add_argument(
        "--sequential", action="store_true", help="one peer after the other (default: concurrently)"
    )
    ap.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of ptops,torchrun,ft"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "goodput_soak.json")
    ap.add_argument("--table", type=Path, help="print the README table of a result file and exit")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(a.table.read_text())))
        return
    peers = [p for p in a.peers.split(",") if p]
    plan = fault_plan(a.seed, a.fault_every, a.minutes)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "minutes": a.minutes,
        "fault_every_s": a.fault_every,
        "seed": a.seed,
        "step_s": a.step_s,
        "mode": "sequential" if a.sequential else "concurrent",
        "plan": [{"gap_s": round(g, 1), "kind": k, "rank": r} for g, k, r in plan[:60]],
    }
    if "ft" in peers:
        why = ft_missing()
        if why:
            print(f"ft peer skipped: {why}", flush=True)
            res["ft"] = {"skipped": why}
            peers.remove("ft")
    loads: list[float] = []
    done = threading.Event()

    def sample_load() -> None:
        while not done.wait(10.0):
            loads.append(os.getloadavg()[0])

    def one(peer: str, tmp: Path) -> None:
        try:
            if peer == "ptops":
                res[peer] = ptops_soak(tmp, a.minutes, plan, a.step_s)
            else:
                res[peer] = elastic_soak(peer, tmp, a.minutes, plan, a.step_s)
        except Exception as e:  # a peer's harness failing must not lose the other peers' results
            res[peer] = {"error": f"{type(e).__name__}: {e}"}
        print(peer, json.dumps(res[peer]), flush=True)

    threading.Thread(target=sample_load, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="ptops-goodput-soak-") as d:
        tmp = Path(d)
        if a.sequential:
            for p in peers:
                one(p, tmp)
        else:
            threads = [threading.Thread(target=one, args=(p, tmp)) for p in peers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        done.set()
        time.sleep(2.0)
        res["orphans"] = orphans(tmp)
    res["loadavg"] = (
        {
            "min": round(min(loads), 1),
            "median": round(statistics.median(loads), 1),
            "max": round(max(loads), 1),
            "n": len(loads),
        }
        if loads
        else None
    )
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
