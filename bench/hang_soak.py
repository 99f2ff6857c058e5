"""Hang-detection soak: zero false hangs with the shipped defaults, and how fast real hangs are
found.

    .venv/bin/python bench/hang_soak.py [--minutes 30] [--out bench/results] [--readme]

Everything runs for real on ``titan-tiny`` (2 ranks, gloo, CPU) under ``ptops launch --supervise``
with no ``[supervisor.hang]`` key set:

1. **soak** (``--minutes``, split in two runs): run A saves asynchronously, run B synchronously
   (``titan.async_checkpoint=false``); both have a slow first step (``slow:step=1,seconds=30``), an
   eval-like pause the engine declares (``hold:phase=eval``: rank 0 pauses 40 s before a step while
   rank 1 waits in the collective), and a 3x straggler (``slow`` on rank 1: +2x the step time, for
   the rest of the run), checkpoints every 10 steps. Each run is stopped with SIGINT when its time
   is up (the ranks save and stop). Counted: ``hang`` events (false detections; must be 0), crashes.
2. **detect**: one short run: attempt 1, rank 0 stops in Python at a step start and rank 1 blocks in
   the collective (``hang:rank=0``); attempt 2, rank 1 is SIGSTOPped from outside (held before the
   step until then). Delay = the hang finding's time (``found_ts``) minus the fault
   (``fault_injected`` / the SIGSTOP), against the bound max(10 x p99 step time of the run, 5 s).

Writes ``hang_soak.json`` into ``--out``; ``--readme`` also rewrites the table in
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTOPS = [sys.executable, "-m", "ptops"]
BEGIN, END = "<!-- hang_soak:begin -->", "<!-- hang_soak:end -->"


def read(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def events(run: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read(run / "events.jsonl") if kind is None or e["kind"] == kind]


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)] if s else float("nan")


def step_times(run: Path) -> list[float]:
    return [
        r["step_s"]
        for r in read(run / "metrics.jsonl")
        if isinstance(r.get("step_s"), (int, float)) and r.get("step", 0) > 1
    ]


def launch(run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *PTOPS,
            "launch",
            "titan-tiny",
            "--supervise",
            "--run-dir",
            str(run),
            "--no-mlflow",
            "--json",
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait(pred, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise RuntimeError(
                f"supervisor exited {proc.returncode} while waiting for "
                f"{what}:\n{proc.stderr.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def soak_run(run: Path, seconds: float, sync: bool) -> dict:
    faults = [
        "slow:step=1,seconds=30",  # a slow first step (every rank)
        "hold:rank=0,step=40,seconds=40,phase=eval",  # an eval-like pause declared by the engine
        "slow:rank=1,step=60,seconds=0.25,steps=100000",
    ]  # a 3x straggler from step 60 on
    sets = [
        "train.steps=100000",
        "checkpoint.interval=10",
        "checkpoint.keep=2",
        "supervisor.restart.backoff_s=0.5",
    ]
    if sync:
        sets.append("titan.async_checkpoint=false")
    args = [a for s in sets for a in ("--set", s)] + [a for f in faults for a in ("--fault", f)]
    t0 = time.monotonic()
    proc = launch(run, *args)
    try:
        while time.monotonic() - t0 < seconds and proc.poll() is None:
            time.sleep(1.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ck = events(run, "checkpoint")
    st = step_times(run)
    return {
        "mode": "sync" if sync else "async",
        "wall_s": round(time.monotonic() - t0, 1),
        "exit_code": proc.returncode,
        "steps": max((r.get("step", 0) for r in read(run / "metrics.jsonl")), default=0),
        "checkpoints": len(ck),
        "checkpoint_modes": sorted({c.get("mode", "?") for c in ck}),
        "faults_fired": [e["fault"] for e in events(run, "fault_injected")],
        "false_hangs": len(events(run, "hang")),
        "hangs": events(run, "hang"),
        "crashes": len(events(run, "crash")),
        "step_p50_s": round(sorted(st)[len(st) // 2], 4) if st else None,
        "step_p99_s": round(p99(st), 4) if st else None,
        "run": str(run),
    }


def detect_run(run: Path) -> dict:
    proc = launch(
        run,
        "--set",
        "train.steps=30",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "supervisor.restart.backoff_s=0.5",
        "--fault",
        "hang:rank=0,step=20",
        "--fault",
        "hold:step=20,attempt=2",
    )
    try:
        wait(
            lambda: (
                len([e for e in events(run, "fault_injected") if e["fault"].startswith("hold")])
                >= 2
            ),
            proc,
            900,
            "both ranks held in attempt 2",
        )
        st = json.loads((run / "status.json").read_text())
        victim = next(r["pid"] for r in st["ranks"] if r["rank"] == 1)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        subprocess.run(
            [*PTOPS, "inject", str(run), "release"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    hangs = events(run, "hang")
    fault = next(e for e in events(run, "fault_injected") if e["fault"].startswith("hang"))
    st = step_times(run)
    bound = max(10 * p99(st), 5.0)
    rows = []
    for name, ev, t_fault in (
        ("collective-blocked rank (hang fault)", hangs[0] if hangs else None, fault["ts"]),
        ("SIGSTOPped rank", hangs[1] if len(hangs) > 1 else None, stopped_at),
    ):
        rows.append(
            {
                "case": name,
                "detected": ev is not None,
                "delay_s": round(ev["found_ts"] - t_fault, 2) if ev else None,
                "budget_s": ev and ev["timeout_s"],
                "phase": ev and ev["phase"],
                "why": ev and ev["why"],
                "ranks": ev and ev["ranks"],
                "stacks_s": ev and ev.get("stacks_s"),
                "bound_s": round(bound, 2),
            }
        )
    return {
        "exit_code": proc.returncode,
        "step_p99_s": round(p99(st), 4),
        "bound_s": round(bound, 2),
        "cases": rows,
        "completed": bool(events(run, "completed")),
        "run": str(run),
    }


def table(res: dict) -> str:
    lines = [
        f"Results ({res['date']}, `--minutes {res['minutes']:g}`, 2 cores shared with other jobs; "
        f"shipped `[supervisor.hang]` defaults):",
        "",
        "| soak run | wall | steps | checkpoints | faults fired | false hangs | crashes | step "
        "p50 / p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["soak"]:
        lines.append(
            f"| {r['mode']} checkpoints | {r['wall_s']:.0f} s | {r['steps']} | {r['checkpoints']} "
            f"({', '.join(r['checkpoint_modes'])}) | {len(r['faults_fired'])} | "
            f"**{r['false_hangs']}** | {r['crashes']} | "
            f"{r['step_p50_s']} / {r['step_p99_s']} s |"
        )
    d = res["detect"]
    lines += [
        "",
        "| injected hang | detected after | budget | bound max(10 x p99 step, 5 s) | how |",
        "|---|---|---|---|---|",
    ]
    for c in d["cases"]:
        lines.append(
            f"| {c['case']} | **{c['delay_s']} s** | {c['budget_s']} s | {c['bound_s']} s (p99 "
            f"step {d['step_p99_s']} s) | "
            f"{c['why']} ({c['phase']}), ranks {c['ranks']}; stacks took {c['stacks_s']} s more |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--minutes", type=float, default=30.0, help="length of the soak (split over the two runs)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument(
        "--readme", action="store_true", help="rewrite the results table in bench/README.md"
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    a = ap.parse_args()
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="ptops-hang-soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    soak = [
        soak_run(tmp / "soak-async", a.minutes * 30, sync=False),
        soak_run(tmp / "soak-sync", a.minutes * 30, sync=True),
    ]
    detect = detect_run(tmp / "detect")
    res = {
        "date": time.strftime("%Y-%m-%d", time.gmtime(t0)),
        "minutes": a.minutes,
        "wall_s": round(time.time() - t0, 1),
        "soak": soak,
        "detect": detect,
        "false_hangs": sum(r["false_hangs"] for r in soak),
        "within_bound": all(
            c["detected"] and c["delay_s"] <= c["bound_s"] + 0.25 for c in detect["cases"]
        ),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hang_soak.json").write_text(json.dumps(res, indent=2) + "\n")
    text = table(res)
    print(text)
    if a.readme:
        readme = REPO / "bench" / "README.md"
        body = readme.read_text()
        if BEGIN in body and END in body:
            head, rest = body.split(BEGIN, 1)
            body = head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1]
            readme.write_text(body)
    return 0 if res["false_hangs"] == 0 and res["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
