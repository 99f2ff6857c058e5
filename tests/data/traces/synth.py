"""Synthetic metric traces with known ground truth, for tests/monitors/,
tests/diagnose/test_monitors_diagnose.py and bench/monitors_bench.py.

Every generator is deterministic in ``seed`` and returns ``metrics.jsonl``-style
records (one per step per rank, ranks interleaved as the probe writes them).
``inject`` names a fault and ``at`` its first step; the fault is in the trace
from ``at`` on (or only at ``at`` for one-step faults).
"""

from __future__ import annotations

import math
import random
from typing import Any

PRETRAIN_FAULTS = (
    "nan",
    "none_nan",
    "loss_spike",
    "grad_explosion",
    "straggler_busy",
    "straggler_wait",
    "straggler_data",
)
RL_FAULTS = (
    "entropy_collapse",
    "kl_drift",
    "reward_hacking",
    "length_hacking",
    "mode_collapse",
    "stale_rollout",
)

# the monitor each fault must trigger
FAULT_MONITOR = {
    "nan": "nan",
    "none_nan": "nan",
    "loss_spike": "loss_spike",
    "grad_explosion": "grad_explosion",
    "straggler_busy": "straggler",
    "straggler_wait": "straggler",
    "straggler_data": "straggler",
    "entropy_collapse": "entropy_collapse",
    "kl_drift": "kl_drift",
    "reward_hacking": "reward_hacking",
    "length_hacking": "reward_hacking",
    "mode_collapse": "mode_collapse",
    "stale_rollout": "stale_rollout",
}


def pretrain(
    steps: int = 200,
    seed: int = 0,
    ranks: int = 2,
    inject: str | None = None,
    at: int = 100,
    with_busy: bool = False,
    with_data: bool = False,
) -> list[dict[str, Any]]:
    """A decaying LM loss, a grad norm, per-rank step times (TRL-style begin->end step_s)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        base_loss = 2.0 + 8.0 * math.exp(-step / 30)
        loss = base_loss * (1 + rng.gauss(0, 0.01))
        gn = 0.8 + 2.0 * math.exp(-step / 15) + abs(rng.gauss(0, 0.08))
        if inject == "loss_spike" and step == at:
            loss = base_loss * 1.6
        if inject == "grad_explosion" and step == at:
            gn *= 40
        compute = [0.40 * (1 + rng.gauss(0, 0.03)) for _ in range(ranks)]
        data = [0.02 * (1 + abs(rng.gauss(0, 0.2))) for _ in range(ranks)]
        slow_pre = [0.0] * ranks  # time outside the measured step (sleep/data before the step)
        if step >= at and inject == "straggler_busy":
            compute[ranks - 1] *= 1.5
        if step >= at and inject in ("straggler_wait", "straggler_data"):
            slow_pre[ranks - 1] = 0.3
            if inject == "straggler_data":
                data[ranks - 1] += 0.3
        # synchronous DP: everyone leaves the collective when the slowest arrives
        arrive = [slow_pre[r] + compute[r] for r in range(ranks)]
        done = max(arrive) + 0.01
        for r in range(ranks):
            rec: dict[str, Any] = {
                "step": step,
                "rank": r,
                "attempt": 1,
                "loss": round(loss, 6),
                "grad_norm": round(gn, 6),
                "lr": 3e-4,
                "tokens_per_s": 1000.0,
                "step_s": round(done - slow_pre[r], 6),
            }
            if with_busy:
                rec["compute_s"] = round(compute[r], 6)
            if with_data or inject == "straggler_data":
                rec["data_s"] = round(data[r], 6)
            if inject == "nan" and step == at:
                rec["loss"] = "nan"
                rec["grad_norm"] = "nan"
            if inject == "none_nan" and step == at:
                rec["grad_norm"] = None
            out.append(rec)
    return out


def grpo(
    steps: int = 200, seed: int = 0, ranks: int = 2, inject: str | None = None, at: int = 100
) -> list[dict[str, Any]]:
    """TRL GRPO keys (sanitised spelling, as the ptops adapter writes them) for a healthy, slowly
    improving run."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    entropy0 = 1.6
    for step in range(1, steps + 1):
        entropy = entropy0 * (1 - 0.1 * step / steps) * (1 + rng.gauss(0, 0.03))
        kl = 0.02 * (1 - math.exp(-step / 20)) + abs(rng.gauss(0, 0.002))
        reward = 0.3 + 0.15 * step / steps + rng.gauss(0, 0.04)
        verifier = 0.25 + 0.1 * step / steps + rng.gauss(0, 0.03)
        length = 100 + rng.gauss(0, 6)
        clip = abs(rng.gauss(0.01, 0.005))
        fzs = min(1.0, max(0.0, rng.uniform(0.0, 0.5)))
        lag = 1
        d = step - at
        if d >= 0:
            if inject == "entropy_collapse":
                entropy *= math.exp(-d / 10)
            elif inject == "kl_drift":
                kl += 0.02 * d
            elif inject == "reward_hacking":
                reward += 0.02 * d
                verifier -= 0.01 * d
            elif inject == "length_hacking":
                reward += 0.02 * d
                length += 4 * d
            elif inject == "mode_collapse":
                fzs = 1.0
            elif inject == "stale_rollout":
                lag = 8
        loss = rng.gauss(0, 0.01)
        gn = 0.5 + abs(rng.gauss(0, 0.1)) if fzs < 1 else 0.01
        for r in range(ranks):
            out.append(
                {
                    "step": step,
                    "rank": r,
                    "attempt": 1,
                    "loss": round(loss, 6),
                    "grad_norm": round(gn, 6),
                    "lr": 1e-6,
                    "step_s": round(0.3 + rng.gauss(0, 0.01), 6),
                    "tokens_per_s": 500.0,
                    "entropy": round(entropy, 6),
                    "kl": round(kl, 6),
                    "reward": round(reward, 6),
                    "reward_std": 0.2,
                    "frac_reward_zero_std": round(fzs, 6),
                    "completions_mean_length": round(length, 3),
                    "clip_ratio_region_mean": round(clip, 6),
                    "rewards_verifier_mean": round(verifier, 6),
                    "policy_lag": lag,
                }
            )
    return out


def generate(
    fault: str | None, seed: int = 0, steps: int = 200, at: int = 100
) -> list[dict[str, Any]]:
    if fault is None or fault in PRETRAIN_FAULTS:
        return pretrain(steps, seed, inject=fault, at=at, with_busy=fault == "straggler_busy")
    return grpo(steps, seed, inject=fault, at=at)
