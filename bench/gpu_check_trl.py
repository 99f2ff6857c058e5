"""The TRL GPU check (``scripts/gpu_check_trl.sh``): the tiny TRL recipes on a CUDA GPU under the
supervisor, each run twice with the same seed (uninterrupted, then rank 0 SIGKILLed after the first
save), and their final weights compared (``ptops ckpt digest``): is recovery exact on a GPU too?
Writes bench/results/gpu_check_trl.json.

Runs where the TorchTitan check cannot (an image whose torch is older than TorchTitan 0.3.0 needs).
``--cpu-smoke`` runs the same driver on CPU (tests/install/test_gpu_check.py); without a GPU and
without ``--cpu-smoke`` it prints one line and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "gpu_check_trl.json"
RECIPES = (
    "trl-sft-tiny",
    "trl-dpo-tiny",
    "trl-grpo-tiny",
    "trl-lora-sft-tiny",
    "trl-reward-tiny",
    "trl-rloo-tiny",
    "trl-gkd-tiny",
    "trl-grpo-math-tiny",
    "trl-grpo-judge-tiny",
    "trl-grpo-code-tiny",
)
STEPS, INTERVAL, KILL = 8, 4, 6


def _jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


def launch(recipe: str, run: Path, *args: str) -> dict:
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptops",
            "launch",
            recipe,
            "--supervise",
            "--run-dir",
            str(run),
            "--no-mlflow",
            "--json",
            "--set",
            f"train.steps={STEPS}",
            "--set",
            f"checkpoint.interval={INTERVAL}",
            "--set",
            "launch.nproc=1",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    ev = _jsonl(run / "events.jsonl")
    recs = [r for r in _jsonl(run / "metrics.jsonl") if r.get("rank") == 0]
    dg = subprocess.run(
        [sys.executable, "-m", "ptops", "ckpt", "digest", str(run)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    losses: dict[int, float] = {}
    for (
        r
    ) in recs:  # the last record of each step (a step re-run after the restart replaces the first)
        if isinstance(r.get("loss"), (int, float)):
            losses[int(r["step"])] = r["loss"]
    return {
        "exit": p.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "digest": dg.stdout.strip().split()[-1] if dg.stdout.strip() else None,
        "restarts": len([e for e in ev if e["kind"] == "restart"]),
        "losses": losses,
        "stderr_tail": p.stderr.strip().splitlines()[-3:],
    }


def main() -> int:
    global OUT
    argv = sys.argv[1:]
    smoke = "--cpu-smoke" in argv
    argv = [a for a in argv if a != "--cpu-smoke"]
    recipes = RECIPES[:1] if smoke else RECIPES
    if "--recipes" in argv:  # --recipes a,b: a subset (a lease's minutes are few)
        i = argv.index("--recipes")
        recipes = tuple(argv[i + 1].split(","))
        del argv[i : i + 2]
    if not smoke:
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu_check_trl: no CUDA GPU here (torch.cuda.is_available() is false): nothing run"
            )
            return 0
    root = Path(argv[0]) if argv else Path("/tmp/ptops-gpu-check-trl")
    if smoke:
        OUT = root / "gpu_check_trl.json"
    root.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "when": time.strftime("%Y%m%d-%H%M%S"),
        "steps": STEPS,
        "interval": INTERVAL,
        "kill_at": KILL,
    }
    if OUT.exists() and not smoke:  # a later lease adds recipes to the earlier results
        res = {**json.loads(OUT.read_text()), **res}
    for name in recipes:
        base = launch(name, root / f"{name}-base")
        hit = launch(name, root / f"{name}-crash", "--fault", f"crash:rank=0,step={KILL}")
        res[name] = {
            "base": base,
            "crash": hit,
            "exact": base["exit"] == 0
            and hit["exit"] == 0
            and hit["restarts"] == 1
            and base["digest"] is not None
            and base["digest"] == hit["digest"]
            and base["losses"] == hit["losses"],
        }
        print(
            f"{name}: exact={res[name]['exact']} base {base['wall_s']} s, crash {hit['wall_s']} s",
            flush=True,
        )
        res["all_exact"] = all(
            res[n]["exact"] for n in res if isinstance(res[n], dict) and "exact" in res[n]
        )
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(
            json.dumps(res, indent=2) + "\n"
        )  # after each recipe: a lease may end mid-list
    return 0 if res["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
