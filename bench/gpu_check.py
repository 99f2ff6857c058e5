"""The GPU check (``scripts/gpu_check.sh``): float8 + compile + async pinned checkpoints under the
supervisor on a real GPU, with a crash and a hang injected. Writes bench/results/gpu_check.json.

Two real ``ptops launch --supervise`` runs of ``bench/gpu_check.toml`` on every local GPU (two, not
four, so that torch.compile runs four times in all and the check stays under 10 minutes):

1. ``sync``:    synchronous checkpoints (titan.async_checkpoint=false), no fault: step time, MFU,
                blocking per save
2. ``faulted``: async saves staged in pinned memory (blocking per save, against ``sync``); rank 0
                SIGKILLed at step 15 (held until the step-10 save commits), then in attempt 2 rank 0
                hangs at step 25: detection and restart times of each, completed after two restarts

Without a CUDA GPU it prints one line and exits 0 (tests/install/test_gpu_check.py). Never run on a
GPU in the session that wrote it: the first GPU session should run it and keep its JSON.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "bench" / "gpu_check.toml"
OUT = REPO / "bench" / "results" / "gpu_check.json"
# --cpu-smoke: the same two runs and figures on titan-tiny (2 CPU ranks, float8 emulated, no compile
# or pinned memory) so the driver itself is tested without a GPU (tests/install/test_gpu_check.py)
SMOKE_SETS = [
    "train.steps=30",
    "checkpoint.interval=5",
    "titan.float8.enabled=true",
    "titan.float8.emulate=true",
    "supervisor.hang.floor_s=5",
    "supervisor.hang.ping_stale_s=4",
    "supervisor.restart.backoff_s=0.5",
]
EXTRA: list[str] = []


def gpus() -> int:
    """CUDA GPUs torch sees (0 without CUDA), asked in a subprocess so this module imports no
    torch."""
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else "
                "0)",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return int(p.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _fault_times(ev: list[dict], kind: str) -> dict:
    """Injection -> detection (crash / hang event) -> next launch, for the first fault of
    ``kind``."""
    inj = next(
        (e for e in ev if e["kind"] == "fault_injected" and e["fault"].startswith(kind)), None
    )
    if inj is None:
        return {}
    fail = next((e for e in ev if e["kind"] == kind and e["ts"] >= inj["ts"]), None)
    if fail is None:
        return {"injected_at_step": inj.get("step")}
    nxt = next((e for e in ev if e["kind"] == "launch" and e["ts"] >= fail["ts"]), None)
    out = {"injected_at_step": inj.get("step"), "detect_s": round(fail["ts"] - inj["ts"], 3)}
    if nxt is not None:
        out["restart_s"] = round(nxt["ts"] - fail["ts"], 3)
        out["resumed_from_step"] = nxt.get("from_step")
    return out


def launch(run: Path, n: int, *args: str) -> dict:
    from ptops.ops.runrecord.goodput import account

    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptops",
            "launch",
            str(RECIPE),
            "--supervise",
            "--run-dir",
            str(run),
            "--no-mlflow",
            "--json",
            "--set",
            f"launch.nproc={n}",
            *EXTRA,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    ev, recs = _jsonl(run / "events.jsonl"), _jsonl(run / "metrics.jsonl")
    r0 = [
        r for r in recs if r.get("rank") == 0 and r.get("step", 0) > 3 and r.get("attempt", 1) == 1
    ]  # after compile
    last = max((r.get("step", 0) for r in recs), default=0)
    ck = [
        e for e in ev if e["kind"] == "checkpoint" and e.get("step") != last
    ]  # the final save is always sync

    def med(key: str):
        vals = [r[key] for r in r0 if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    # pinned-memory staging runs on while training goes on; TorchTitan waits for it before the next
    # optimizer step, so that wait shows in the step after a save, not in the save's blocking_s
    saved = {e.get("step") for e in ck}
    after = [
        r["step_s"]
        for r in r0
        if r.get("step", 0) - 1 in saved and isinstance(r.get("step_s"), (int, float))
    ]
    base = med("step_s")
    return {
        "post_save_step_extra_s": (statistics.median(after) - base)
        if after and base is not None
        else None,
        "exit": p.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "step_s_median": med("step_s"),
        "mfu_pct_median": med("mfu"),
        "tokens_per_s_median": med("tokens_per_s"),
        "memory_max_reserved_gib": med("memory_max_reserved_gib"),
        "checkpoint_blocking_s": [e["blocking_s"] for e in ck],
        "checkpoint_modes": sorted({e.get("mode", "") for e in ev if e["kind"] == "checkpoint"}),
        "crash": _fault_times(ev, "crash"),
        "hang": _fault_times(ev, "hang"),
        "restarts": len([e for e in ev if e["kind"] == "restart"]),
        "goodput": account(ev, recs),
        "stderr_tail": p.stderr.strip().splitlines()[-3:],
    }


def main() -> int:
    global RECIPE, OUT
    argv = sys.argv[1:]
    smoke = "--cpu-smoke" in argv
    argv = [a for a in argv if a != "--cpu-smoke"]
    if smoke:
        RECIPE = REPO / "recipes" / "titan-tiny.toml"
        for s in SMOKE_SETS:
            EXTRA.extend(["--set", s])
        n = 2
    else:
        n = gpus()
        if n == 0:
            print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is false): nothing run")
            return 0
    root = Path(argv[0]) if argv else Path("/tmp/ptops-gpu-check")
    if smoke:
        OUT = root / "gpu_check.json"
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    res: dict = {"gpus": n, "recipe": str(RECIPE.relative_to(REPO)), "when": stamp}
    # 1. synchronous saves, no fault: the baseline step time, MFU and blocking per save
    res["sync"] = launch(root / f"sync-{stamp}", n, "--set", "titan.async_checkpoint=false")
    # 2. async saves staged in pinned memory; rank 0 SIGKILLed at step 15 (held until the step-10
    #    save commits), then in attempt 2 rank 0 hangs at step 25: both found, restarted, completed
    res["faulted"] = launch(
        root / f"faulted-{stamp}",
        n,
        "--fault",
        "crash:rank=0,step=15",
        "--fault",
        "hold:step=15,until=committed,seconds=300",
        "--fault",
        "hang:rank=0,step=25,attempt=2",
    )
    f = res["faulted"]
    sync_b, async_b = res["sync"]["checkpoint_blocking_s"], [b for b in f["checkpoint_blocking_s"]]
    res["summary"] = {
        "step_s": res["sync"]["step_s_median"],
        "mfu_pct": res["sync"]["mfu_pct_median"],
        "sync_blocking_s": statistics.median(sync_b) if sync_b else None,
        "async_pinned_blocking_s": statistics.median(async_b) if async_b else None,
        "async_modes": f["checkpoint_modes"],
        "sync_post_save_step_extra_s": res["sync"]["post_save_step_extra_s"],
        "async_post_save_step_extra_s": f["post_save_step_extra_s"],
        "crash_detect_s": f["crash"].get("detect_s"),
        "crash_restart_s": f["crash"].get("restart_s"),
        "hang_detect_s": f["hang"].get("detect_s"),
        "hang_restart_s": f["hang"].get("restart_s"),
        "restarts": f["restarts"],
        "all_completed": res["sync"]["exit"] == 0 and f["exit"] == 0 and f["restarts"] == 2,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["all_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
