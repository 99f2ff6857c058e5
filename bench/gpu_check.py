"""The GPU check (``scripts/gpu_check.sh``): float8 + compile + async pinned checkpoints under the
supervisor on a real GPU, with a crash and a hang injected. Writes bench/results/gpu_check.json.

Runs (each a real ``ptops launch --supervise`` of ``bench/gpu_check.toml`` on every local GPU):

1. ``sync``:  synchronous checkpoints (titan.async_checkpoint=false): step time, MFU, blocking per save
2. ``async``: async saves staged in pinned memory: blocking per save (against ``sync``)
3. ``crash``: rank 0 SIGKILLed at step 25 (held until the step-20 save commits): detection, restart, recovery
4. ``hang``:  rank 0 hangs at step 25: found by the hang monitor, stacks taken, restarted

Without a CUDA GPU it prints one line and exits 0 (tests/test_gpu_check.py). Never run on a GPU in
the session that wrote it: the first GPU session should run it and keep its JSON.
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


def gpus() -> int:
    """CUDA GPUs torch sees (0 without CUDA), asked in a subprocess so this module imports no torch."""
    try:
        p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
                           capture_output=True, text=True, timeout=120)
        return int(p.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def launch(run: Path, n: int, *args: str) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ptops", "launch", str(RECIPE), "--supervise", "--run-dir", str(run),
                        "--no-mlflow", "--json", "--set", f"launch.nproc={n}", *args],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    ev, recs = _jsonl(run / "events.jsonl"), _jsonl(run / "metrics.jsonl")
    r0 = [r for r in recs if r.get("rank") == 0 and r.get("step", 0) > 3]  # after compile warm-up
    last = max((r.get("step", 0) for r in recs), default=0)
    ck = [e for e in ev if e["kind"] == "checkpoint" and e.get("step") != last]  # the final save is always sync
    from ptops.ops.runrecord.goodput import account

    out = {
        "exit": p.returncode, "wall_s": round(time.monotonic() - t0, 1),
        "step_s_median": statistics.median(r["step_s"] for r in r0) if r0 else None,
        "mfu_pct_median": statistics.median(r["mfu"] for r in r0 if "mfu" in r) if any("mfu" in r for r in r0) else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in r0 if "tokens_per_s" in r) if r0 else None,
        "checkpoint_blocking_s": [e["blocking_s"] for e in ck],
        "checkpoint_modes": sorted({e.get("mode", "") for e in ev if e["kind"] == "checkpoint"}),
        "goodput": account(ev, recs),
        "restarts": len([e for e in ev if e["kind"] == "restart"]),
        "stderr_tail": p.stderr.strip().splitlines()[-3:],
    }
    fail = next((e for e in ev if e["kind"] in ("crash", "hang")), None)
    inj = next((e for e in ev if e["kind"] == "fault_injected" and not e["fault"].startswith("hold")), None)
    nxt = next((e for e in ev if e["kind"] == "launch" and e.get("attempt") == 2), None)
    first2 = next((r for r in recs if r.get("attempt") == 2), None)
    if fail and inj:
        out["detect_s"] = round(fail["ts"] - inj["ts"], 3)
    if fail and nxt:
        out["restart_s"] = round(nxt["ts"] - fail["ts"], 3)
    if first2 is not None:
        out["recovered_at_step"] = first2["step"]
    return out


def main() -> int:
    n = gpus()
    if n == 0:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is false): nothing run")
        return 0
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/ptops-gpu-check")
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    res: dict = {"gpus": n, "recipe": str(RECIPE.relative_to(REPO)), "when": stamp}
    res["sync"] = launch(root / f"sync-{stamp}", n, "--set", "titan.async_checkpoint=false")
    res["async"] = launch(root / f"async-{stamp}", n)
    res["crash"] = launch(root / f"crash-{stamp}", n, "--fault", "crash:rank=0,step=25",
                          "--fault", "hold:step=25,until=committed,seconds=300")
    res["hang"] = launch(root / f"hang-{stamp}", n, "--fault", "hang:rank=0,step=25")
    sync_b, async_b = res["sync"]["checkpoint_blocking_s"], res["async"]["checkpoint_blocking_s"]
    res["summary"] = {
        "step_s": res["async"]["step_s_median"], "mfu_pct": res["async"]["mfu_pct_median"],
        "sync_blocking_s": statistics.median(sync_b) if sync_b else None,
        "async_pinned_blocking_s": statistics.median(async_b) if async_b else None,
        "crash_detect_s": res["crash"].get("detect_s"), "crash_restart_s": res["crash"].get("restart_s"),
        "hang_detect_s": res["hang"].get("detect_s"), "hang_restart_s": res["hang"].get("restart_s"),
        "all_completed": all(res[k]["exit"] == 0 for k in ("sync", "async", "crash", "hang")),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["all_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
