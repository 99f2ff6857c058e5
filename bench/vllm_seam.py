"""GRPO with a real vLLM engine (vLLM's CPU build, colocate), supervised by ptops, against the same
run without ptops (``bench/plain_grpo_vllm.py`` under torchrun), in the same session, alternating.

Reports per configuration the mean step time of steps 3.. (the engine's warm-up is step 1), the
rollouts' throughput (completion tokens per second inside the engine's generate, measured the same
way on both sides), the ratios to the peer, and for ptops the weight sync's and its check's cost per
step (``engine/sync_s``, ``engine/verify_s``, from the run's records). Also runs the peer once with
TRL's sync as shipped (on the CPU build it fails at the first sync: what a user meets without the
seam). Needs ``.venv-vllm`` (``bash scripts/setup.sh --vllm``):

    .venv-vllm/bin/python bench/vllm_seam.py --reps 2 --json bench/results/vllm_seam.json
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

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
BIN = Path(sys.executable).parent


def plain(steps: int, shipped: bool = False) -> dict:
    argv = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "2",
        str(REPO / "bench" / "plain_grpo_vllm.py"),
    ]
    argv += ["--steps", str(steps)] + (["--as-shipped"] if shipped else [])
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=1200)
    wall = time.monotonic() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith('{"steps"')), None)
    errs = [x for x in proc.stderr.splitlines() if "Error: " in x and "ChildFailedError" not in x]
    err = errs[-1] if errs else ""
    out = {"rc": proc.returncode, "wall_s": wall, "error": err[-200:] if proc.returncode else ""}
    return out | (json.loads(line) if line else {})


def supervised(steps: int, verify: bool, root: Path) -> dict:
    run = root / f"ptops-{'verify' if verify else 'noverify'}-{time.monotonic_ns()}"
    argv = [str(BIN / "ptops"), "launch", "trl-grpo-tiny", "--supervise", "--run-dir", str(run)]
    argv += ["--no-mlflow", "--set", "trl.vllm.mode=colocate", "--set", f"train.steps={steps}"]
    argv += [
        "--set",
        f"checkpoint.interval={steps}",
        "--set",
        f"trl.vllm.verify={str(verify).lower()}",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=1200)
    wall = time.monotonic() - t0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("rank") == 0 and r["step"] >= 3]
    step_s = statistics.mean(r["step_s"] for r in recs)
    sync = statistics.mean(r["engine/sync_s"] for r in recs)
    check = statistics.mean(r["engine/verify_s"] for r in recs)
    gen_s = sum(r.get("engine/generate_s", 0.0) for r in recs)
    tokens = sum(r.get("engine/tokens", 0.0) for r in recs)
    return {
        "tokens_per_s": tokens / gen_s if gen_s else None,
        "generate_s": gen_s / len(recs),
        "rc": proc.returncode,
        "wall_s": wall,
        "steps": len(recs) + 2,
        "step_s": step_s,
        "sync_s": sync,
        "verify_s": check,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"plain": [], "ptops": [], "ptops-noverify": []}
    with tempfile.TemporaryDirectory() as tmp:
        shipped = plain(args.steps, shipped=True)
        print(
            f"peer with TRL's sync as shipped: exit {shipped['rc']} {shipped['error']}", flush=True
        )
        for rep in range(args.reps):
            rows["plain"].append(plain(args.steps))
            rows["ptops"].append(supervised(args.steps, True, Path(tmp)))
            rows["ptops-noverify"].append(supervised(args.steps, False, Path(tmp)))
            print(
                f"rep {rep + 1}: "
                + ", ".join(
                    f"{k} {v[-1]['step_s']:.3f} s/step {v[-1]['tokens_per_s'] or 0:.0f} tok/s"
                    for k, v in rows.items()
                ),
                flush=True,
            )
    base = statistics.mean(r["step_s"] for r in rows["plain"])
    base_tps = statistics.mean(r["tokens_per_s"] for r in rows["plain"])
    table = {}
    for name, rs in rows.items():
        step = statistics.mean(r["step_s"] for r in rs)
        tps = statistics.mean(r["tokens_per_s"] for r in rs)
        table[name] = {
            "step_s": step,
            "ratio_to_plain": step / base,
            "tokens_per_s": tps,
            "tokens_ratio_to_plain": tps / base_tps,
            "runs": rs,
        }
        if name != "plain":
            table[name]["sync_s"] = statistics.mean(r["sync_s"] for r in rs)
            table[name]["verify_s"] = statistics.mean(r["verify_s"] for r in rs)
    v = table["ptops"]
    print(f"\n{'config':16} {'step s':>8} {'x plain':>8} {'tok/s':>8} {'x plain':>8}")
    for name, row in table.items():
        print(
            f"{name:16} {row['step_s']:8.3f} {row['ratio_to_plain']:8.3f} "
            f"{row['tokens_per_s']:8.0f} {row['tokens_ratio_to_plain']:8.3f}"
        )
    share = v["verify_s"] / v["step_s"]
    print(
        f"check per sync: {v['verify_s'] * 1000:.1f} ms = {share:.1%} of a step, "
        f"{v['verify_s'] / v['sync_s']:.2f}x the sync ({v['sync_s'] * 1000:.1f} ms)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"shipped": shipped, "table": table, "steps": args.steps, "reps": args.reps},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
