"""Stage 1 of the GPU check (``scripts/gpu_check.sh``): the own-script engine on CUDA, one rank.
Writes bench/results/gpu_check_script.json (``--cpu-smoke DIR``: DIR/gpu_check_script.json).

Two launches of ``bench/gpu_script.py`` (``ptops launch --supervise --set launch.nproc=1 -- python
bench/gpu_script.py ...``; a declared world of one is no misconfiguration), one after the other
(with ``--cpu-smoke`` side by side: a CPU box of 2 cores is slow enough):

1. ``async``: async DCP saves staged in pinned memory; held before step 3 (``hold`` fault) while the
   driver scrapes the run's Prometheus exporter (``--metrics-port``), then released (``ptops inject
   RUN release``): ``exporter.nvml_families`` are the ``ptops_gpu_*`` families that had samples
2. ``sync``: ``pr.checkpoint`` saves (blocking per save, against ``async``); rank 0 SIGKILLed at
   step 5 (``crash``) and restarted from the warm pool (``warm_spare=true``: the launch event's
   ``ranks_from``), hung at step 7 of attempt 2 (``hang``: stacks written, ``ptops diagnose --json``
   names it), out of CUDA memory at step 9 of attempt 3 (the script allocates until the allocator
   refuses: diagnose classifies it), completed after three restarts

Result keys: ``async`` / ``sync`` (per launch: exit, wall_s, restarts, launches (ranks_from,
from_step), timings (the script's blocking per save), event_blocking_s (ptops' ``checkpoint``
events), stacks, diagnose incidents, ...), ``summary`` (each check and ``ok``), or ``skipped`` with
the reason when the own-script engine (``ptops launch -- CMD``) is not installed.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "gpu_check_script.json"
SCRIPT = REPO / "bench" / "gpu_script.py"
STEPS, INTERVAL, CRASH, HANG, HOLD, OOM = 10, 2, 5, 7, 3, 9
COMMON = [
    "--set",
    "launch.nproc=1",
    "--set",
    f"checkpoint.interval={INTERVAL}",
    "--set",
    "checkpoint.keep=2",
    "--set",
    "supervisor.hang.floor_s=8",
    "--set",
    "supervisor.hang.ping_stale_s=6",
    "--set",
    "supervisor.restart.backoff_s=0.5",
    "--no-mlflow",
    "--json",
]


def _jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


def engine_installed() -> str | None:
    """None when ``ptops launch -- CMD`` (the script engine) is here, else why not."""
    p = subprocess.run(
        [sys.executable, "-c", "import ptops.rank, ptops.recipes.script"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return (
        None
        if p.returncode == 0
        else "own-script engine not installed ("
        + (p.stderr.strip().splitlines() or ["?"])[-1]
        + ")"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_then_release(run: Path, port: int, gpu: bool, deadline: float, out: dict) -> None:
    """Scrape /metrics while the run is held before step HOLD until a step record is exported (on a
    GPU: and the ``ptops_gpu_*`` series, or 3 more scrapes without), then release the hold. Records
    the families that had samples."""
    fams: set[str] = set()
    seen = 0
    while time.monotonic() < deadline:
        try:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
        except OSError:
            time.sleep(0.3)
            continue
        fams = {m.group(1) for m in re.finditer(r"^(ptops_\w+?)(?:_total)?(?:\{| )", text, re.M)}
        out["scrapes"] = out.get("scrapes", 0) + 1
        if (
            "ptops_loss" in fams
        ):  # a step exported; NVML is read at each scrape: a few more, no longer
            seen += 1
            if not gpu or seen > 3 or any(f.startswith("ptops_gpu_") for f in fams):
                break
        time.sleep(0.5)
    out["families"] = sorted(fams)
    out["nvml_families"] = sorted(f for f in fams if f.startswith("ptops_gpu_"))
    r = subprocess.run(
        [sys.executable, "-m", "ptops", "inject", str(run), "release"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    out["released"] = r.returncode == 0
    if r.returncode:
        out["release_error"] = (r.stderr or r.stdout).strip()[-300:]


def launch(
    run: Path,
    script_args: list[str],
    *ptops_args: str,
    scrape: dict | None = None,
    gpu: bool = False,
    timeout: float = 300,
) -> dict:
    timings = run.parent / f"{run.name}-timings.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "ptops",
        "launch",
        "--run-dir",
        str(run),
        *COMMON,
        *ptops_args,
        "--supervise",
        "--",
        sys.executable,
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--interval",
        str(INTERVAL),
        "--keep",
        "2",
        "--timings",
        str(timings),
        *script_args,
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    th = None
    if scrape is not None:
        port = int(ptops_args[ptops_args.index("--metrics-port") + 1])
        th = threading.Thread(
            target=scrape_then_release, args=(run, port, gpu, t0 + timeout / 2, scrape), daemon=True
        )
        th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if th is not None:
        th.join(timeout=30)
    ev, recs = _jsonl(run / "events.jsonl"), _jsonl(run / "metrics.jsonl")
    kinds = [e["kind"] for e in ev]
    steps_s = [
        r["step_s"] for r in recs if isinstance(r.get("step_s"), (int, float)) and r["step"] > 2
    ]
    mem = [
        r["memory_max_allocated_gib"]
        for r in recs
        if isinstance(r.get("memory_max_allocated_gib"), (int, float))
    ]
    stacks = sorted(run.glob("stacks/attempt-*/node-*.txt"))  # one file a node, a local run too
    return {
        "exit": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "restarts": kinds.count("restart"),
        "misconfigured": [e for e in ev if "misconfig" in e["kind"] or "world of" in json.dumps(e)],
        "launches": [
            {k: e.get(k) for k in ("attempt", "ranks_from", "cold_why", "from_step")}
            for e in ev
            if e["kind"] == "launch"
        ],
        "timings": _jsonl(timings),
        "event_blocking_s": [
            {k: e.get(k) for k in ("step", "mode", "blocking_s")}
            for e in ev
            if e["kind"] == "checkpoint"
        ],
        "steps_recorded": sorted({r["step"] for r in recs if isinstance(r.get("step"), int)}),
        "step_s_median": statistics.median(steps_s) if steps_s else None,
        "memory_max_allocated_gib": max(mem, default=None),
        "stacks": [str(p.relative_to(run)) for p in stacks],
        "stacks_show_the_script": any(
            "gpu_script.py" in p.read_text(errors="replace") for p in stacks
        ),
        "stdout_tail": out.strip().splitlines()[-2:],
        "stderr_tail": err.strip().splitlines()[-4:],
    }


def incidents(run: Path) -> list[dict]:
    """``ptops diagnose --json``'s incidents, the fields the checks read."""
    p = subprocess.run(
        [sys.executable, "-m", "ptops", "diagnose", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    try:
        rep = json.loads(p.stdout)
    except ValueError:
        return [{"error": (p.stderr or p.stdout).strip()[-500:]}]
    return [
        {
            "kind": i.get("kind"),
            "title": i.get("title"),
            "attempt": i.get("attempt"),
            "cause": (i.get("details") or {}).get("cause"),
            "patterns": (i.get("details") or {}).get("patterns"),
        }
        for i in rep.get("incidents", [])
    ]


def _median(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def checks(res: dict, gpu: bool) -> dict:
    sy, asy = res["sync"], res["async"]
    sync_b = [t["blocking_s"] for t in sy["timings"] if t["mode"] == "sync" and t["step"] < STEPS]
    async_b = [t["blocking_s"] for t in asy["timings"] if t["mode"].startswith("async")]
    la = sy["launches"]
    inc = {i.get("attempt"): i for i in sy["incidents"]}
    exp = asy["exporter"]
    c = {
        "world_of_one_accepted": not asy["misconfigured"]
        and not sy["misconfigured"]
        and asy["exit"] == 0,
        "async_saves_committed": len(async_b) == STEPS // INTERVAL - 1 and asy["exit"] == 0,
        "exporter_scraped_then_released": "ptops_loss" in exp.get("families", [])
        and bool(exp.get("released")),
        "nvml_series": bool(exp.get("nvml_families")) if gpu else None,
        "completed_after_3_restarts": sy["exit"] == 0
        and sy["restarts"] == 3
        and sy["steps_recorded"][-1:] == [STEPS],
        "warm_restart": len(la) >= 2 and la[1].get("ranks_from") == "warm",
        "crash_resumed_from": la[1].get("from_step") if len(la) >= 2 else None,
        "hang_stacks": sy["stacks_show_the_script"],
        "diagnose_names_hang": (inc.get(2) or {}).get("kind") == "hang",
        "oom_classified": "GPU memory exhausted (CUDA OOM)"
        in ((inc.get(3) or {}).get("patterns") or [])
        and str((inc.get(3) or {}).get("cause", "")).startswith("out of memory"),
    }
    sb, ab = _median(sync_b), _median(async_b)
    return {
        "sync_blocking_s_median": sb,
        "async_blocking_s_median": ab,
        "async_over_sync": round(ab / sb, 4) if sb and ab is not None else None,
        "nvml_families": exp.get("nvml_families"),
        **c,
        "ok": all(v for k, v in c.items() if k != "crash_resumed_from" and v is not None),
    }


def main() -> int:
    global OUT
    argv = sys.argv[1:]
    smoke = "--cpu-smoke" in argv
    argv = [a for a in argv if a != "--cpu-smoke"]
    root = Path(argv[0]) if argv else Path("/tmp/ptops-gpu-check-script")
    if smoke:
        OUT = root / "gpu_check_script.json"
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    res: dict = {"when": stamp, "steps": STEPS, "interval": INTERVAL, "side_by_side": smoke}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def write() -> None:  # after each launch: a stage cut by its budget keeps what it measured
        with lock:
            OUT.write_text(json.dumps(res, indent=2, default=str) + "\n")

    why = engine_installed()
    if why is not None:
        res["skipped"] = why
        write()
        print(f"gpu_check_script: skipped: {why}")
        return 0
    sargs = ["--cpu", "--dim", "64", "--layers", "2", "--batch", "16"] if smoke else []
    gpu = not smoke
    a, s = root / f"async-{stamp}", root / f"sync-{stamp}"

    def run_async() -> None:
        scrape: dict = {}
        res["async"] = launch(
            a,
            [*sargs, "--async-ckpt", "--ckpt-dir", str(a / "checkpoints")],
            "--metrics-port",
            str(_free_port()),
            "--fault",
            f"hold:step={HOLD},seconds=120",
            scrape=scrape,
            gpu=gpu,
            timeout=120,
        )
        res["async"]["exporter"] = scrape
        write()

    def run_sync() -> None:
        res["sync"] = launch(
            s,
            [*sargs, "--oom-at-step", str(OOM), "--oom-once", str(root / f"oom-{stamp}")],
            "--set",
            "supervisor.restart.warm_spare=true",
            "--fault",
            f"crash:rank=0,step={CRASH}",
            "--fault",
            f"hang:rank=0,step={HANG},attempt=2",
        )
        res["sync"]["incidents"] = incidents(s)
        write()

    if smoke:
        th = threading.Thread(target=run_async)
        th.start()
        run_sync()
        th.join()
    else:
        run_async()
        run_sync()
    res["summary"] = checks(res, gpu)
    write()
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
