"""Supervision benchmark: overhead, time to detect a hang, time from a crash to the first productive
step.

Side by side with plain ``torchrun --max-restarts=1`` on the same faults.

    .venv/bin/python bench/supervisor_bench.py [--recipe titan-tiny] [--steps 60] [--out \\
        bench/results]

Writes ``supervisor_bench.json`` into ``--out`` and prints a Markdown table.
Everything runs for real (2 ranks, gloo, CPU); ~10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptops import envnames

REPO = Path(__file__).resolve().parent.parent
PTOPS = [sys.executable, "-m", "ptops"]


def torchrun_peer_argv(argv: list[str], max_restarts: int) -> list[str]:
    """The ranks' own torchrun command (``launcher.rank_command``) as a plain-torchrun user would
    run it: ``--max-restarts`` worker restarts, with the c10d rendezvous (run it with
    ``torchrun_peer_env``)."""
    out = [
        a if a != "0" or argv[i - 1] != "--max-restarts" else str(max_restarts)
        for i, a in enumerate(argv)
    ]
    i = out.index("--master-addr")
    port = out[i + 3]
    out[i : i + 4] = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return out


def torchrun_peer_env(env: dict[str, str]) -> dict[str, str]:
    """The peer's environment, with torch's own opt-out of the shared rendezvous store.

    Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` a restarted worker group connects to the
    agent's store, which still holds the dead group's gloo addresses: its ``connectFullMesh`` gets
    "Connection refused" and it never trains (measured here on titan-tiny; pytorch/pytorch#167288).
    With it, each round's rank 0 hosts a fresh store (torch/distributed/elastic/rendezvous/
    dynamic_rendezvous.py) and torchrun's restart trains again: that is the peer a user would run.
    """
    return {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def step_times(run: Path, skip: int = 5) -> list[float]:
    recs = [
        r
        for r in read(run / "metrics.jsonl")
        if r.get("rank") == 0 and isinstance(r.get("step_s"), (int, float))
    ]
    return [r["step_s"] for r in recs if r["step"] > skip]


def ptops(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PTOPS, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def overhead(recipe: str, steps: int, tmp: Path) -> dict:
    out = {}
    for mode in ("plain", "supervised", "plain2", "supervised2"):
        run = tmp / f"ovh-{mode}"
        args = [
            "launch",
            recipe,
            "--run-dir",
            str(run),
            "--set",
            f"train.steps={steps}",
            "--set",
            f"checkpoint.interval={steps}",
        ]
        if mode.startswith("supervised"):
            args.append("--supervise")
        t0 = time.monotonic()
        p = ptops(*args)
        assert p.returncode == 0, p.stderr
        st = step_times(run)
        out[mode] = {
            "median_step_s": statistics.median(st),
            "mean_step_s": statistics.fmean(st),
            "wall_s": time.monotonic() - t0,
            "n": len(st),
        }
    plain = statistics.median([out["plain"]["median_step_s"], out["plain2"]["median_step_s"]])
    sup = statistics.median(
        [out["supervised"]["median_step_s"], out["supervised2"]["median_step_s"]]
    )
    out["overhead_pct"] = 100 * (sup - plain) / plain
    return out


def probe_cost(n: int = 5000) -> dict:
    """Per-step cost of the probe inside a rank: before_step + should_poison + step, channel vs
    file."""
    import threading

    from ptops.ops.node.agent import relay_in_thread
    from ptops.ops.rank.probe import Probe
    from ptops.ops.runrecord.rundir import append_jsonl
    from ptops.ops.supervisor.channel import ChannelServer

    metrics = {
        "loss": 2.5,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "step_s": 0.06,
        "tokens_per_s": 9000.0,
        "mfu": 0.1,
    }
    out = {}
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        server = ChannelServer()
        relay = relay_in_thread(server.address(), server.token)
        agent = relay.__enter__()  # the rank's channel is its node agent
        stop = threading.Event()

        def consume():  # what the supervisor does with each message
            while not stop.is_set():
                try:
                    _, msg, _ = server.inbox.get(timeout=0.1)
                except Exception:
                    continue
                for _, m, _ in msg["items"] if msg.get("t") == "_batch" else [(0, msg, 0)]:
                    if m.get("t") == "metrics":
                        append_jsonl(run / "sup-metrics.jsonl", m["rec"])

        threading.Thread(target=consume, daemon=True).start()
        for mode in ("file", "channel"):
            kw = {"channel": agent.local_address, "token": agent.local_token}
            kw = kw if mode == "channel" else {}
            probe = Probe(run, 0, 1, **kw)
            t0 = time.perf_counter()
            for step in range(1, n + 1):
                probe.profile.at_step(step)
                probe.faults.before_step(step)
                probe.before_step(step)
                probe.faults.should_poison(step)
                probe.step(step, metrics)
            out[f"{mode}_us_per_step"] = (time.perf_counter() - t0) / n * 1e6
            probe.close()
        stop.set()
        relay.__exit__(None, None, None)
        server.close()
    return out


def supervised_fault(recipe: str, tmp: Path, name: str, fault: str, extra: list[str]) -> dict:
    run = tmp / f"sup-{name}"
    p = ptops(
        "launch",
        recipe,
        "--supervise",
        "--run-dir",
        str(run),
        "--set",
        "train.steps=16",
        "--set",
        "checkpoint.interval=5",
        "--fault",
        fault,
        *extra,
    )
    ev = read(run / "events.jsonl")
    injected = next(e for e in ev if e["kind"] == "fault_injected")
    detected = next(e for e in ev if e["kind"] in ("hang", "crash"))
    relaunch = next(e for e in ev if e["kind"] == "launch" and e["attempt"] == 2)
    first = next(r for r in read(run / "metrics.jsonl") if r.get("attempt") == 2 and r["rank"] == 0)
    return {
        "exit_code": p.returncode,
        "detect_s": detected["ts"] - injected["ts"],
        "fault_to_relaunch_s": relaunch["ts"] - injected["ts"],
        "fault_to_first_productive_step_s": first["ts"] - injected["ts"],
        "resumed_from_step": relaunch.get("from_step"),
        "event": detected["kind"],
    }


def torchrun_fault(recipe: str, tmp: Path, name: str, fault: str, give_up_s: float) -> dict:
    """The same recipe and fault under plain torchrun --max-restarts=1 (the probe writes files
    directly)."""
    from ptops.faultinject.spec import parse, to_env
    from ptops.ops.supervisor import launcher
    from ptops.recipes.schema import load

    rec, path = load(recipe, ["train.steps=16", "checkpoint.interval=5"])
    run = launcher.prepare_run(rec, path, tmp / f"torchrun-{name}")
    run.logs(1).mkdir(parents=True, exist_ok=True)
    cmd = launcher.rank_command(rec, run, 1, {envnames.FAULTS: to_env([parse(fault)])})
    argv = torchrun_peer_argv(cmd.argv, max_restarts=1)
    t0 = time.time()
    with open(run.logs(1) / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(
            argv,
            env=torchrun_peer_env(cmd.env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    result = {"detect_s": None, "fault_to_first_productive_step_s": None}
    try:
        while time.time() - t0 < give_up_s and proc.poll() is None:
            time.sleep(0.5)
            ev = read(run.events)
            injected = next((e for e in ev if e["kind"] == "fault_injected"), None)
            if injected is None:
                continue
            # only the restarted worker group's records (attempt 2 = torchrun's restart count 1, see
            # ops/rank/probe.py::attempt_from_env): rank 0 of the failed group may still log the
            # step before the fault just after the fault_injected stamp (an earlier run counted
            # that: 0.004 s)
            restarted = [
                r
                for r in read(run.metrics)
                if r["rank"] == 0 and r.get("attempt") == injected["attempt"] + 1
            ]
            if restarted:
                result["fault_to_first_productive_step_s"] = restarted[0]["ts"] - injected["ts"]
                text = (run.logs(1) / "torchrun.log").read_text(errors="replace")
                result["note"] = "restarted by torchrun" + (
                    " after a collective timeout" if "timeout" in text.lower() else ""
                )
                break
        else:
            pass
        if result["fault_to_first_productive_step_s"] is None:
            result["note"] = (
                f"no productive step after the fault within {give_up_s:g} s (torchrun exit "
                f"{proc.poll()})"
            )
        injected = next((e for e in read(run.events) if e["kind"] == "fault_injected"), None)
        first_failure = _torchrun_first_failure(
            run.logs(1) / "torchrun.log", injected["ts"] if injected else t0
        )
        if injected is not None and first_failure is not None:
            result["detect_s"] = (
                first_failure - injected["ts"]
            )  # torchrun saw a worker fail (not a hang)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        from ptops.ops.supervisor.procs import run_processes, signal_all

        signal_all(run_processes(run.path), signal.SIGKILL)
    return result


def _torchrun_first_failure(log: Path, near_ts: float) -> float | None:
    """Unix time of torchrun's first 'failed (exitcode ...)' line (its glog stamp has no year)."""
    import re
    from datetime import datetime

    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^E(\d{2})(\d{2}) (\d{2}:\d{2}:\d{2}\.\d+) .*failed \(exitcode", text, re.M)
    if not m:
        return None
    year = datetime.fromtimestamp(near_ts).year
    stamp = datetime.strptime(
        f"{year}-{m.group(1)}-{m.group(2)} {m.group(3)}", "%Y-%m-%d %H:%M:%S.%f"
    )
    return stamp.timestamp()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="titan-tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--only", default="probe,overhead,hang,crash")
    a = ap.parse_args()
    only = set(a.only.split(","))
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"recipe": a.recipe, "steps": a.steps}
    with tempfile.TemporaryDirectory(prefix="ptops-bench-") as d:
        tmp = Path(d)
        if "probe" in only:
            res["probe_cost"] = probe_cost()
            print("probe", json.dumps(res["probe_cost"]), flush=True)
        if "overhead" in only:
            res["overhead"] = overhead(a.recipe, a.steps, tmp)
            print("overhead", json.dumps(res["overhead"]), flush=True)
        if "hang" in only:
            res["hang_ptops"] = supervised_fault(
                a.recipe, tmp, "hang", "hang:rank=0,step=8", ["--set", "supervisor.hang.floor_s=5"]
            )
            print("hang ptops", json.dumps(res["hang_ptops"]), flush=True)
            res["hang_torchrun"] = torchrun_fault(
                a.recipe, tmp, "hang", "hang:rank=0,step=8", give_up_s=180
            )
            print("hang torchrun", json.dumps(res["hang_torchrun"]), flush=True)
        if "crash" in only:
            res["crash_ptops"] = supervised_fault(
                a.recipe, tmp, "crash", "crash:rank=1,step=12", []
            )
            print("crash ptops", json.dumps(res["crash_ptops"]), flush=True)
            res["crash_torchrun"] = torchrun_fault(
                a.recipe, tmp, "crash", "crash:rank=1,step=12", give_up_s=180
            )
            print("crash torchrun", json.dumps(res["crash_torchrun"]), flush=True)
    target = a.out / "supervisor_bench.json"
    try:
        old = json.loads(target.read_text())
    except (OSError, ValueError):
        old = {}
    target.write_text(json.dumps({**old, **res}, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
