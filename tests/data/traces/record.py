"""Trim a real run's metrics.jsonl to the keys the monitors read, for tests/data/traces/.

    .venv/bin/python tests/data/traces/record.py RUN_DIR OUT.jsonl

How the recorded traces were made (one at a time, 2 CPU ranks, OMP_NUM_THREADS=1):

    ptops launch trl-grpo-tiny --run-dir /tmp/mon_grpo_sN --set train.steps=30 --set train.seed=N
    ptops launch trl-grpo-tiny --run-dir /tmp/mon_grpo100_sN --set train.steps=100 \\
        --set train.seed=N --set checkpoint.interval=50
    ptops launch trl-sft-tiny  --run-dir /tmp/mon_sft_sN  --set train.steps=30 --set train.seed=N
    ptops launch trl-dpo-tiny  --run-dir /tmp/mon_dpo_sN  --set train.steps=30 --set train.seed=N
    ptops launch titan-tiny    --run-dir /tmp/mon_titan_sN --set train.steps=30 --set train.seed=N

ddp_sleep_rank1.jsonl / ddp_slowcompute_rank1.jsonl come from ddp_slow_recorder.py
(``OMP_NUM_THREADS=1 MODE=sleep|compute OUT=... torchrun --standalone --nproc-per-node 2
ddp_slow_recorder.py``).
"""

import json
import math
import sys

KEEP = (
    "step",
    "rank",
    "attempt",
    "loss",
    "grad_norm",
    "step_s",
    "compute_s",
    "wait_s",
    "data_s",
    "data_loading_s",
    "time_metrics_data_loading_s",
    "entropy",
    "kl",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions_mean_length",
    "clip_ratio_region_mean",
    "rewards_correct_mean",
    "rewards_format_mean",
)


def _round(v):
    if isinstance(v, float) and math.isfinite(v) and v != 0:
        return float(f"{v:.6g}")
    return v


def main(run_dir: str, out: str) -> None:
    lines = []
    with open(f"{run_dir}/metrics.jsonl") as f:
        for raw in f:
            r = json.loads(raw)
            lines.append(
                json.dumps({k: _round(r[k]) for k in KEEP if k in r}, separators=(",", ":"))
            )
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
