"""RL early warning: ptops' first alert vs rldoctor 0.2.0 and rlwatch 0.5.1 on the same traces.

    .venv/bin/python bench/rl_early_warning.py [--seeds 5] [--tune] [--json OUT]
    .venv/bin/python bench/rl_early_warning.py --cost     # the RL monitors' cost per record only
    .venv/bin/python bench/rl_early_warning.py --tune-hacking [--only 10,25]  # tuning set
                                                  # of reward hacking (seeds 1000-1059), ptops alone
    PYTHONPATH=/tmp/rld-site .venv/bin/python bench/rl_early_warning.py --target
        # issue 49 point 7, per cadence: ptops vs rldoctor 0.2.0 (run here: it must be importable)
        # vs the 0 % false-alarm oracle on held-out seeds (7000..), >= 100 controls a cadence;
        # bench/results/rl_early_warning_target.json
    .venv/bin/python bench/rl_early_warning.py --bound    # reward hacking: how early could any
        # detector be at 0 / 1 / 5 % false alarms (an oracle that knows the generator's model
        # but the onset), vs ptops and rldoctor; bench/results/rl_early_warning_bound.json

Scenarios (TRL GRPO metric names, one rank, 200 steps), each over ``--seeds`` seeds:

- collapse: entropy decays exponentially from a random onset to 5 % of its level,
  speeds fast / medium / slow (time constants 8 / 25 / 60 steps), scales: early
  entropy 0.5 / 1.5 / 5.0 and multiplicative noise 2 % / 6 %. Ground truth: the
  step the noiseless curve falls under 30 % of its early level ("crossing");
- healthy: flat, slowly declining (-30 % linear over the run), sharpening to a
  plateau at 60 % (time constant 60), dips of 25-35 % for 2-6 steps that recover
  (1-2 per run), each at the three entropy scales, plus the recorded real tiny GRPO
  runs tests/data/traces/trl-grpo-*.jsonl (10 runs, 2 ranks);
- reward hacking (300 steps, so that a score logged every 25 steps has 7-8 values after
  the onset): from a random onset (step 80-120) the training reward climbs while the held-out
  score falls, with the held-out score dense (every step) or sparse (an ``eval/accuracy``
  record every 10 or 25 steps); and a healthy control where both rise (sparse, every 10).

Tools, driven the way their docs say, on the same records:

- ptops: ``replay`` of every record through ``build_monitors()`` (defaults);
- rldoctor 0.2.0: ``rl_doctor.live.LiveMonitor`` (its live API; defaults except
  ``check_every=5``, five times more often than its default 25, so that its detection
  step is not quantised coarsely; the first alert step is then refined to the exact
  step by re-diagnosing the 4 prefixes before it). Held-out score as ``eval/accuracy``
  (its alias for the eval score), merged into the step's dict;
- rlwatch 0.5.1: ``rlwatch.detectors.DetectorSuite(RLWatchConfig())`` fed per step
  through ``check_step`` (what ``RLWatch.log_step`` calls, without its SQLite store),
  with entropy, kl_divergence, reward_mean, reward_std.

An alert counts for a scenario when it comes from the tool's detector for that failure
(entropy_collapse / reward_hacking); healthy runs count every alert of every detector of
each tool as a false positive (``fp_any``), and the matched detectors separately (``fp``).

Seeds: the thresholds were tuned on seeds 1000-1004 (``--tune`` runs those; reward hacking's on
``hacking()`` over seeds 1000-1059); the default run evaluates seeds 0..N-1, which no tuning saw.
The generator is this file's, not tests/data/traces/synth.py (the unit tests' traces).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO / "tests" / "data" / "traces"
T = 200
REWARD_NOISE = 0.03  # the training reward's Gaussian noise (every trace)

from ptops.monitors import build_monitors, replay  # noqa: E402

# ---------------------------------------------------------------- traces


def _base(
    rng: random.Random, t: int, h: float, noise: float, reward: float, extra: dict | None = None
) -> dict:
    rec = {
        "step": t,
        "rank": 0,
        "attempt": 1,
        "entropy": round(h * (1 + rng.gauss(0, noise)), 6),
        "reward": round(reward + rng.gauss(0, REWARD_NOISE), 6),
        "reward_std": round(0.2 + rng.gauss(0, 0.01), 6),
        "kl": round(0.01 + 0.00005 * t + abs(rng.gauss(0, 0.001)), 6),
        "frac_reward_zero_std": round(min(1.0, max(0.0, 0.2 + rng.gauss(0, 0.05))), 6),
        "completions_mean_length": round(100 + rng.gauss(0, 5), 3),
        "clip_ratio_region_mean": round(abs(rng.gauss(0.01, 0.004)), 6),
        "loss": round(rng.gauss(0, 0.01), 6),
        "grad_norm": round(0.5 + abs(rng.gauss(0, 0.1)), 6),
    }
    if extra:
        rec.update(extra)
    return rec


def collapse(seed: int, tau: float, h0: float, noise: float) -> tuple[list[dict], int, int]:
    """(records, onset, crossing): exponential decay to 5 % from the onset."""
    rng = random.Random(seed * 7919 + int(tau * 10) + int(h0 * 100) + int(noise * 1000))
    at = rng.randint(50, 90)
    out, crossing = [], None
    for t in range(1, T + 1):
        g = 1.0 if t < at else 0.05 + 0.95 * math.exp(-(t - at) / tau)
        h = h0 * (1 - 0.05 * t / T) * g
        if crossing is None and h < 0.3 * h0:
            crossing = t
        r = 1.0 - 0.3 * math.exp(h / h0) * (1.0 if t < at else 1.0)  # R = -a e^H + b (Cui et al.)
        out.append(_base(rng, t, h, noise, r))
    return out, at, crossing or T + 1


def healthy(seed: int, kind: str, h0: float, noise: float = 0.04) -> list[dict]:
    rng = random.Random(
        seed * 104729
        + {"flat": 1, "declining": 2, "plateau": 3, "dip": 4}[kind] * 101
        + int(h0 * 100)
    )
    dips = []
    if kind == "dip":
        for _ in range(rng.randint(1, 2)):
            dips.append(
                (
                    rng.randint(40, 170),
                    rng.uniform(0.25, 0.35),
                    rng.randint(1, 3),
                    rng.randint(2, 6),
                    rng.randint(2, 5),
                )
            )
    out = []
    for t in range(1, T + 1):
        if kind == "flat":
            f = 1.0
        elif kind == "declining":
            f = 1 - 0.3 * t / T
        elif kind == "plateau":
            f = 0.6 + 0.4 * math.exp(-t / 60)
        else:
            f = 1.0
            for start, depth, ramp, hold, rec in dips:
                d = t - start
                if 0 <= d < ramp:
                    f = min(f, 1 - depth * (d + 1) / ramp)
                elif ramp <= d < ramp + hold:
                    f = min(f, 1 - depth)
                elif ramp + hold <= d < ramp + hold + rec:
                    f = min(f, 1 - depth * (1 - (d - ramp - hold + 1) / rec))
        h = h0 * f
        reward = 0.3 + 0.2 * t / T
        out.append(_base(rng, t, h, noise, reward))
    return out


def hacking(seed: int, every: int, hacked: bool = True, steps: int = 300) -> tuple[list[dict], int]:
    """(records, onset): reward climbs while the held-out score falls; held-out every ``every``
    steps (1: on the step's record as ``rewards_verifier_mean``; N: an ``eval/accuracy`` record of
    its own)."""
    rng = random.Random(seed * 15485863 + every * 31 + hacked)
    at = rng.randint(80, 120)
    rises = HACKED_RISES if hacked else HEALTHY_RISES
    return _trace(rng, at, steps, every, *rises, HELD_NOISE), at


# hacking()'s model, named so that --bound's oracle reads the generator's numbers, not copies
HACKED_RISES = (0.004, -0.002)  # from the onset, a step: training reward, held-out score
HEALTHY_RISES = (0.002, 0.0015)  # the healthy control: both rise
HELD_NOISE = 0.02  # the held-out score's Gaussian noise


def held_base(t: float) -> float:
    """The held-out score's noiseless level at step ``t`` before any onset (``_trace``)."""
    return 0.25 + 0.08 * t / T


def reward_base(t: float) -> float:
    """The training reward's noiseless level at step ``t`` before any onset (``_trace``)."""
    return 0.3 + 0.1 * t / T


def _trace(
    rng: random.Random,
    at: int,
    steps: int,
    every: int,
    reward_rise: float,
    held_rise: float,
    noise: float,
) -> list[dict]:
    """From the onset ``at`` the reward climbs ``reward_rise`` a step and the held-out score
    ``held_rise`` under ``noise``: on each step's record (``every`` 1) or as an eval record every
    ``every`` steps."""
    out = []
    for t in range(1, steps + 1):
        d = max(0, t - at)
        reward = reward_base(t) + reward_rise * d
        held = held_base(t) + held_rise * d + rng.gauss(0, noise)
        rec = _base(rng, t, 1.2, 0.03, reward)
        if every == 1:
            rec["rewards_verifier_mean"] = round(held, 6)
            out.append(rec)
        else:
            out.append(rec)
            if t % every == 0:
                out.append({"step": t, "rank": 0, "attempt": 1, "eval/accuracy": round(held, 6)})
    return out


def hacking_variant(
    seed: int, every: int, held_rise: float, noise: float, reward_rise: float = 0.002
) -> tuple[list[dict], int]:
    """(records, onset): a healthy variant for tuning (``--tune-hacking``): from the onset the
    reward climbs by ``reward_rise`` a step and the held-out score by ``held_rise`` under
    ``noise``."""
    rng = random.Random(seed * 7919 + every * 13 + int(held_rise * 1e5) + int(noise * 1e3))
    at = rng.randint(80, 120)
    return _trace(rng, at, 300, every, reward_rise, held_rise, noise), at


def tune_hacking(seeds: list[int], cadences: tuple[int, ...] = (1, 10, 25)) -> None:
    """ptops alone on the reward-hacking tuning set: ``hacking()`` hacked and its healthy control,
    and healthy variants (held-out rising 0.0005-0.0015 a step under 0.02-0.04 noise, the reward
    0.002 or 0.004), each at every 1 / 10 / 25 steps; prints delays and false positives."""
    from ptops.monitors import RewardHackingMonitor

    def rh(recs: list[dict]) -> list[tuple[int, str, str]]:
        return [(f.step, f.monitor, f.severity) for f in replay(recs, [RewardHackingMonitor()])]

    t0 = time.process_time()
    for every in cadences:
        delays, missed = [], 0
        for s in seeds:
            recs, at = hacking(s, every)
            f = first(rh(recs), "reward_hacking")
            if f is None:
                missed += 1
            else:
                delays.append(f - at)
        q = sorted(delays)
        print(
            f"hack every {every:2d}: {len(delays)}/{len(seeds)} median {statistics.median(q):+.0f} "
            f"(q25 {q[len(q) // 4]:+d}, q75 {q[3 * len(q) // 4]:+d}, min {q[0]:+d}, "
            f"max {q[-1]:+d}), before onset {sum(d < 0 for d in q)}"
        )
        fams = [("control", None)] + [
            (f"held +{hr:g} noise {nz:g} reward +{rr:g}", (hr, nz, rr))
            for hr in (0.0005, 0.001, 0.0015)
            for nz in (0.02, 0.04)
            for rr in (0.002, 0.004)
        ]
        for label, v in fams:
            fp = 0
            for s in seeds:
                recs = (
                    hacking(s, every, hacked=False)[0]
                    if v is None
                    else hacking_variant(s, every, *v)[0]
                )
                fp += first(rh(recs), "reward_hacking") is not None
            if fp or v is None:
                print(f"   healthy {label}: FP {fp}/{len(seeds)}")
    print(f"({time.process_time() - t0:.0f} s CPU)")


def recorded() -> list[tuple[str, list[dict]]]:
    out = []
    for p in sorted(TRACES.glob("trl-grpo-*.jsonl")):
        out.append(
            (p.stem, [json.loads(line) for line in p.read_text().splitlines() if line.strip()])
        )
    return out


# ---------------------------------------------------------------- tools

RL_MONITORS = {"entropy_collapse", "kl_drift", "reward_hacking", "mode_collapse", "stale_rollout"}


def run_ptops(recs: list[dict]) -> list[tuple[int, str, str]]:
    return [
        (f.step, f.monitor, f.severity)
        for f in replay(recs, build_monitors())
        if f.phase != "resolved" and f.family == "rl"
    ]


def _merged(recs: list[dict]) -> list[dict]:
    """One dict per step (rank 0), eval records merged in, held-out as ``eval/accuracy``; TRL's key
    spelling."""
    by: dict[int, dict] = {}
    for r in recs:
        if r.get("rank", 0) != 0:
            continue
        d = by.setdefault(int(r["step"]), {})
        for k, v in r.items():
            if k in ("rank", "attempt", "ts"):
                continue
            k = {
                "rewards_verifier_mean": "eval/accuracy",
                "completions_mean_length": "completions/mean_length",
                "clip_ratio_region_mean": "clip_ratio/region_mean",
            }.get(k, k)
            d[k] = v
    return [by[s] for s in sorted(by)]


def run_rldoctor(recs: list[dict], check_every: int = 5) -> list[tuple[int, str, str]]:
    from rl_doctor.detectors.base import Severity
    from rl_doctor.diagnosis import diagnose
    from rl_doctor.ingest.base import run_from_records
    from rl_doctor.live import LiveMonitor

    steps = _merged(recs)
    mon = LiveMonitor(check_every=check_every, on_finding=lambda f: None)
    out: list[tuple[int, str, str]] = []
    first: dict[str, int] = {}
    for i, r in enumerate(steps):
        for f in mon.log(r, step=r["step"]):
            if f.detector not in first:  # refine: the first prefix that already shows it
                s = r["step"]
                for j in range(max(mon.min_steps, i + 1 - check_every + 1), i + 1):
                    run = run_from_records(steps[:j], config=None, name="x", source="live")
                    d = diagnose(run)
                    if any(
                        p.detector == f.detector and p.severity >= Severity.WARNING
                        for p in d.problems
                    ):
                        s = steps[j - 1]["step"]
                        break
                first[f.detector] = s
                out.append((s, f.detector, f.severity.label))
            else:
                out.append((r["step"], f.detector, f.severity.label))
    return out


def run_rlwatch(recs: list[dict]) -> list[tuple[int, str, str]]:
    from rlwatch.config import RLWatchConfig
    from rlwatch.detectors import DetectorSuite

    suite = DetectorSuite(RLWatchConfig())
    out = []
    for r in _merged(recs):
        for a in suite.check_step(
            r["step"],
            entropy=r.get("entropy"),
            kl_divergence=r.get("kl"),
            reward_mean=r.get("reward"),
            reward_std=r.get("reward_std"),
            loss=r.get("loss"),
            grad_norm=r.get("grad_norm"),
        ):
            out.append((int(r["step"]), a.detector, a.severity))
    return out


TOOLS = {"ptops": run_ptops, "rldoctor": run_rldoctor, "rlwatch": run_rlwatch}


def first(alerts: list[tuple[int, str, str]], detector: str) -> int | None:
    return min((s for s, d, _ in alerts if d == detector), default=None)


# ---------------------------------------------------------------- the run


def scenarios(seeds: list[int]) -> list[dict[str, Any]]:
    out = []
    for speed, tau in (("fast", 8), ("medium", 25), ("slow", 60)):
        for h0 in (0.5, 1.5, 5.0):
            for noise in (0.02, 0.06):
                for s in seeds:
                    recs, at, cross = collapse(s, tau, h0, noise)
                    out.append(
                        {
                            "group": f"collapse {speed}",
                            "name": f"collapse-{speed}-H{h0}-n{noise}-s{s}",
                            "kind": "collapse",
                            "detector": "entropy_collapse",
                            "recs": recs,
                            "onset": at,
                            "truth": cross,
                        }
                    )
    for kind in ("flat", "declining", "plateau", "dip"):
        for h0 in (0.5, 1.5, 5.0):
            for s in seeds:
                out.append(
                    {
                        "group": f"healthy {kind}",
                        "name": f"healthy-{kind}-H{h0}-s{s}",
                        "kind": "healthy",
                        "recs": healthy(s, kind, h0),
                    }
                )
    for name, recs in recorded():
        out.append(
            {"group": "healthy recorded GRPO", "name": name, "kind": "healthy", "recs": recs}
        )
    for every, label in ((1, "dense"), (10, "sparse/10"), (25, "sparse/25")):
        for s in seeds:
            recs, at = hacking(s, every)
            out.append(
                {
                    "group": f"reward hacking {label}",
                    "name": f"hack-{label}-s{s}",
                    "kind": "hacking",
                    "detector": "reward_hacking",
                    "recs": recs,
                    "onset": at,
                    "truth": at,
                }
            )
    for s in seeds:
        recs, _ = hacking(s, 10, hacked=False)
        out.append(
            {
                "group": "healthy reward+held-out rising (sparse/10)",
                "name": f"healthy-heldout-s{s}",
                "kind": "healthy",
                "recs": recs,
            }
        )
    return out


def cost(reps: int = 7) -> dict[str, float]:
    """Microseconds of process CPU time per record (best of ``reps``; CPU time, so that other
    processes on a shared machine do not count) of each RL monitor and of every default monitor
    together, on healthy synthetic GRPO records of 8 ranks x 1000 steps
    (tests/data/traces/synth.py)."""
    sys.path.insert(0, str(TRACES))
    import synth

    from ptops.monitors import MONITOR_CLASSES
    from ptops.ops.supervisor.monitorfeed import MonitorFeed

    recs = []
    for seed in range(4):
        for r in synth.grpo(1000, seed, ranks=2):
            recs.append({**r, "rank": r["rank"] + 2 * seed})
    recs.sort(key=lambda r: (r["step"], r["rank"]))
    best: dict[str, float] = {}
    for _ in range(reps):
        for name in sorted(RL_MONITORS):
            m = MONITOR_CLASSES[name]()
            t0 = time.process_time()
            for r in recs:
                m.feed(r)
            best[name] = min(best.get(name, 1e9), (time.process_time() - t0) / len(recs) * 1e6)
        feed = MonitorFeed(
            build_monitors()
        ).feed  # the supervisor's live path (one parse per record)
        t0 = time.process_time()
        for r in recs:
            feed(r)
        best["all default monitors"] = min(
            best.get("all default monitors", 1e9), (time.process_time() - t0) / len(recs) * 1e6
        )
    best["RL monitors together"] = sum(best[n] for n in RL_MONITORS)
    return best


# ---------------------------------------------------------------- the evidence bound (--bound)

CADENCES = ((1, "dense"), (10, "sparse/10"), (25, "sparse/25"))
ALPHAS = (0.0, 0.01, 0.05)  # the false-alarm rates the table shows
CAL_SEED0 = 5000  # calibration seeds: disjoint from the table's (0..), the tuning set's (1000..)
# the healthy families the oracle is calibrated on, as (held rise, reward rise) from the onset:
# the table's control, and --tune-hacking's variants at the hacked runs' noise (its 0.04-noise
# variants are left out: they would only raise the oracle's threshold, so the bound stays a bound)
CAL_FAMILIES: tuple[tuple[float, float], ...] = (HEALTHY_RISES[::-1],) + tuple(
    (hr, rr) for hr in (0.0005, 0.001, 0.0015) for rr in (0.002, 0.004)
)


def _lse(x: Any, axis: Any) -> Any:
    """log(sum(exp(x))) over ``axis``, without overflow."""
    import numpy as np

    m = np.max(x, axis=axis, keepdims=True)
    return np.log(np.sum(np.exp(x - m), axis=axis)) + np.squeeze(m, axis=axis)


def evidence(recs: list[dict], onset: int | None = None) -> tuple[list[int], dict[str, Any]]:
    """(steps, {oracle: log odds of "hacked" over "healthy" at every step}) on a trace, for an
    oracle that knows hacking()'s whole model but the onset: the levels before it, both noises,
    the hacked held-out fall after it, and the healthy families' held-out rises (CAL_FAMILIES).

    Bayes factors, the onset uniform over every step (``onset`` given: that step only): hacked
    = the held-out score falls from the onset; healthy = no onset yet (prior 1/2) or an onset
    after which the held-out score rises at one of the families' rates. ``held``: from the
    held-out score alone; ``joint`` (and ``known``, the onset given): the training reward's bend
    at the onset is evidence for both (its slope after it fitted, >= 0, since the healthy
    families' reward climbs as fast as the hacked one's): it says when, the held-out score says
    what. For a fixed onset the likelihood ratio is the most powerful test (Neyman-Pearson), so a
    detector that does not know the model should not beat this one by much; it is a reference
    to measure against, not a proof."""
    import numpy as np

    n = max(int(r["step"]) for r in recs)
    ry, rm, hx, hm = (np.zeros(n) for _ in range(4))
    for r in recs:
        i = int(r["step"]) - 1
        if "reward" in r:
            ry[i], rm[i] = float(r["reward"]) - reward_base(i + 1), 1.0
        v = r.get("rewards_verifier_mean", r.get("eval/accuracy"))
        if v is not None:
            hx[i], hm[i] = float(v) - held_base(i + 1), 1.0
    steps = np.arange(1, n + 1, dtype=float)
    taus = np.arange(n, dtype=float) if onset is None else np.array([float(onset)])
    d = np.clip(steps[None, :] - taus[:, None], 0.0, None)  # steps since the onset tau
    s_yd = np.cumsum(rm * ry * d, axis=1)
    s_rdd = np.cumsum(rm * d * d, axis=1)
    bend = np.where(s_yd > 0, s_yd**2 / (2 * REWARD_NOISE**2 * np.maximum(s_rdd, 1e-12)), 0.0)
    s_xd = np.cumsum(hm * hx * d, axis=1)
    s_hdd = np.cumsum(hm * d * d, axis=1)
    var = HELD_NOISE**2

    def held(slope: float) -> Any:  # log likelihood ratio: slope from tau vs no change
        return (slope / var) * s_xd - (slope * slope / (2 * var)) * s_hdd

    rises = sorted({h for h, _ in CAL_FAMILIES})
    fall, rise = held(HACKED_RISES[1]), np.stack([held(c) for c in rises])
    out = {}
    for name, b in (("held", 0.0), ("joint", bend)) if onset is None else (("known", bend),):
        hacked = _lse(b + fall, 0) - math.log(len(taus))
        healthy = _lse(b + rise, (0, 1)) - math.log(len(taus) * len(rises))
        if onset is None:  # healthy: no onset yet, or an onset and a rise
            healthy = np.logaddexp(0.0, healthy)
        out[name] = hacked - healthy
    return list(range(1, n + 1)), out


ORACLES = ("held", "known", "joint")


def oracles(recs: list[dict], onset: int) -> dict[str, tuple[list[int], Any]]:
    """(steps, evidence) of each oracle on a trace: the held-out score alone (``held``), reward
    and held-out score (``joint``), and given the onset (``known``: what locating it exactly,
    e.g. from the reward's bend, is worth)."""
    steps, ev = evidence(recs)
    ev.update(evidence(recs, onset)[1])
    return {k: (steps, v) for k, v in ev.items()}


def threshold(maxima: list[float], fp: int) -> float:
    """The lowest threshold (alarm: evidence > threshold) that at most ``fp`` of the healthy runs,
    whose largest evidence values are ``maxima``, cross: the (fp+1)-th largest maximum."""
    q = sorted(maxima, reverse=True)
    return q[fp] if fp < len(q) else -math.inf


def alarm(steps: list[int], stat: Any, h: float) -> int | None:
    """The step of the first held-out value whose evidence exceeds ``h``."""
    import numpy as np

    i = int(np.searchsorted(np.maximum.accumulate(stat), h, side="right"))
    return steps[i] if i < len(steps) else None


def delays(firsts: list[int | None], onsets: list[int]) -> dict[str, Any]:
    """Median / min / max of first alert minus onset (negative: a false alarm before it), and the
    median of the alerts at or after the onset alone."""
    d = [f - o for f, o in zip(firsts, onsets) if f is not None]
    after = [x for x in d if x >= 0]
    return {
        "traces": len(firsts),
        "detected": len(d),
        "before_onset": sum(x < 0 for x in d),
        "median": statistics.median(d) if d else None,
        "min": min(d, default=None),
        "max": max(d, default=None),
        "median_after_onset": statistics.median(after) if after else None,
    }


def _cell(x: dict[str, Any]) -> str:
    if not x["detected"]:
        return f"0/{x['traces']}"
    s = f"{x['median']:+.0f} ({x['min']:+d}..{x['max']:+d})"
    if x["detected"] < x["traces"]:
        s += f", {x['traces'] - x['detected']} missed"
    if x["before_onset"]:
        after = x["median_after_onset"]
        s += f", {x['before_onset']} before onset"
        s += f" (at/after: {after:+.0f})" if after is not None else " (none at/after)"
    return s


def bound(n_cal: int, n_seeds: int, rld_seeds: int, table_json: Path) -> dict[str, Any]:
    """How early can any detector flag hacking() at a given false-alarm rate: the oracle
    (``evidence``) with its threshold calibrated on ``n_cal`` healthy runs of every family in
    CAL_FAMILIES, at every false-alarm rate; ptops on the same seeds; rldoctor on its first
    ``rld_seeds`` seeds if it is installed, else its alerts from the table's run
    (``table_json``)."""
    try:
        import rl_doctor  # noqa: F401

        have_rld = rld_seeds > 0
    except ImportError:
        have_rld = False
    table = json.loads(table_json.read_text()) if table_json.exists() else {"traces": []}
    out: dict[str, Any] = {"n_cal": n_cal, "cal_seeds": [CAL_SEED0, CAL_SEED0 + n_cal - 1]}
    out["cal_families"] = [{"held_rise": h, "reward_rise": r} for h, r in CAL_FAMILIES]
    out["rldoctor_source"] = (
        f"run here on seeds 0-{rld_seeds - 1}" if have_rld else f"{table_json.name} (seeds 0-4)"
    )
    seed_sets = {"0-4": list(range(5))}
    if have_rld and 5 < rld_seeds < n_seeds:  # rldoctor's own seeds, to compare on the same
        seed_sets[f"0-{rld_seeds - 1}"] = list(range(rld_seeds))
    seed_sets[f"0-{n_seeds - 1}"] = list(range(n_seeds))
    for every, label in CADENCES:
        sc: dict[str, Any] = {}
        # calibration: the largest evidence of every healthy run, per family
        fam_max: dict[str, list[list[float]]] = {k: [] for k in ORACLES}
        for i, (held_rise, reward_rise) in enumerate(CAL_FAMILIES):
            m: dict[str, list[float]] = {k: [] for k in ORACLES}
            for s in range(CAL_SEED0, CAL_SEED0 + n_cal):
                recs, at = (
                    hacking(s, every, hacked=False)
                    if i == 0
                    else hacking_variant(s, every, held_rise, HELD_NOISE, reward_rise)
                )
                for k, (_, stat) in oracles(recs, at).items():
                    m[k].append(float(stat.max()))
            for k in ORACLES:
                fam_max[k].append(m[k])

        def h_at(rate: float, kind: str = "held") -> float:
            """Every family false-alarms on at most ``rate`` of its runs."""
            fp = math.floor(rate * n_cal + 1e-9)
            return max(threshold(m, fp) for m in fam_max[kind])

        traces = []
        for s in range(n_seeds):
            recs, at = hacking(s, every)
            ev = oracles(recs, at)
            traces.append((s, at, *ev["held"], ev, recs))
        ptops_first = [first(run_ptops(t[5]), "reward_hacking") for t in traces]
        ptops_fp = [
            first(run_ptops(hacking(s, every, hacked=False)[0]), "reward_hacking") is not None
            for s in range(n_seeds)
        ]
        # rldoctor: its alerts on the hacked runs and its false alarms on the control
        if have_rld:
            rld_first = [first(run_rldoctor(t[5]), "reward_hacking") for t in traces[:rld_seeds]]
            rld_fp = [
                first(run_rldoctor(hacking(s, every, hacked=False)[0]), "reward_hacking")
                is not None
                for s in range(rld_seeds)
            ]
        else:
            by = {r["name"]: r for r in table.get("traces", [])}
            rld_first = [
                by[f"hack-{label}-s{s}"]["rldoctor"]["first"]
                for s in range(5)
                if f"hack-{label}-s{s}" in by
            ]
            ctrl = [by.get(f"healthy-heldout-s{s}") for s in range(5)] if every == 10 else []
            rld_fp = [bool(c["rldoctor"]["fp"]) for c in ctrl if c]
        rld_on = [t[1] for t in traces[: len(rld_first)]]
        rld = delays(rld_first, rld_on)
        rld["seeds"] = f"0-{len(rld_first) - 1}" if rld_first else "none"
        rld["fp_runs"] = sum(rld_fp)
        rld["fp_traces"] = len(rld_fp)
        rld["fp_rate"] = sum(rld_fp) / len(rld_fp) if rld_fp else None
        rld["firsts"] = rld_first
        sc["rldoctor"] = rld
        sc["thresholds"] = {k: {f"{a:g}": h_at(a, k) for a in ALPHAS} for k in ORACLES}
        sc["calibration_fp"] = {  # what the thresholds give on each family's calibration runs
            k: {f"{a:g}": [sum(x > h_at(a, k) for x in m) for m in fam_max[k]] for a in ALPHAS}
            for k in ORACLES
        }
        for name, seeds in seed_sets.items():
            sub = [t for t in traces if t[0] in seeds]
            onsets = [t[1] for t in sub]
            row: dict[str, Any] = {
                "ptops": delays([ptops_first[t[0]] for t in sub], onsets),
                "ptops_fp_control": [sum(ptops_fp[s] for s in seeds), len(seeds)],
                "ptops_fp_seeds": [s for s in seeds if ptops_fp[s]],
            }
            row["ptops"]["firsts"] = [ptops_first[t[0]] for t in sub]
            for a in ALPHAS:
                f = [alarm(t[2], t[3], h_at(a)) for t in sub]
                row[f"oracle {a:.0%}"] = {**delays(f, onsets), "firsts": f}
                for k in ("known", "joint"):
                    fk = [alarm(*t[4][k], h_at(a, k)) for t in sub]
                    row[f"oracle {k} {a:.0%}"] = {**delays(fk, onsets), "firsts": fk}
            if not set(seeds) <= set(range(len(rld_first))):
                sc[name] = row  # rldoctor did not run on all of them: no comparison
                continue
            rld_sub = delays([rld_first[s] for s in seeds], onsets)
            row["rldoctor"] = rld_sub
            for k in ("held", "joint"):
                if rld["fp_rate"] is not None:
                    f = [alarm(*t[4][k], h_at(rld["fp_rate"], k)) for t in sub]
                    row[f"oracle {k} at rldoctor's FP rate"] = delays(f, onsets)
                # the lowest false-alarm rate at which the oracle's median (its false alarms
                # before the onset counted, a miss as last) is no later than rldoctor's median:
                # counting its alerts before the onset, as the table does, or only those after
                for key, target in (
                    ("median", rld_sub["median"]),
                    ("at/after", rld_sub["median_after_onset"]),
                ):
                    reach = None
                    for fp in range(n_cal + 1) if target is not None else ():
                        f = [alarm(*t[4][k], h_at(fp / n_cal, k)) for t in sub]
                        last = [math.inf if x is None else x - o for x, o in zip(f, onsets)]
                        if statistics.median(last) <= target:
                            reach = {"fp_rate": fp / n_cal, "target": target, **delays(f, onsets)}
                            break
                    row[f"oracle {k} reaches rldoctor's {key} at"] = reach
            sc[name] = row
        out[label] = sc
    return out


def print_bound(res: dict[str, Any]) -> None:
    """Two markdown tables: the delays at 0 / 1 / 5 % false alarms, then rldoctor's."""
    print(
        "| scenario | seeds | ptops (FP on controls) | oracle, held-out: 0 % FP | 1 % | 5 % "
        "| oracle, reward + held-out: 0 % FP | 1 % | 5 % | oracle, onset given: 0 % FP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(label, name, row) for _, label in CADENCES for name, row in res[label].items()]
    rows = [r for r in rows if r[1][0].isdigit()]
    for label, name, row in rows:
        pf, pn = row["ptops_fp_control"]
        print(
            f"| {label} | {name} | {_cell(row['ptops'])} (FP {pf}/{pn} controls) | "
            + " | ".join(_cell(row[f"oracle {a:.0%}"]) for a in ALPHAS)
            + " | "
            + " | ".join(_cell(row[f"oracle joint {a:.0%}"]) for a in ALPHAS)
            + f" | {_cell(row['oracle known 0%'])} |"
        )
    print()
    print(
        "| scenario | seeds | rldoctor (FP on controls) | oracle at rldoctor's FP rate: "
        "held-out; reward + held-out | FP rate at which the oracle's median reaches rldoctor's "
        "(all its alerts; those at/after the onset): held-out; reward + held-out |"
    )
    print("|---|---|---|---|---|")
    for label, name, row in rows:
        if "rldoctor" not in row:
            continue
        rld = res[label]["rldoctor"]
        rate = f"{rld['fp_runs']}/{rld['fp_traces']}" if rld["fp_traces"] else "not measured"
        at = [row.get(f"oracle {k} at rldoctor's FP rate") for k in ("held", "joint")]
        reach = []
        for k in ("held", "joint"):
            r = [row[f"oracle {k} reaches rldoctor's {q} at"] for q in ("median", "at/after")]
            reach.append(
                ", ".join(f"{x['fp_rate']:.1%} for {x['target']:+.0f}" if x else "-" for x in r)
            )
        print(
            f"| {label} | {name} | {_cell(row['rldoctor'])} (FP {rate}, seeds {rld['seeds']}) | "
            + "; ".join(_cell(x) if x else "-" for x in at)
            + " | "
            + "; ".join(reach)
            + " |"
        )


# ---------------------------------------------------------------- the target (--target)

# issue 49 point 7's table: seeds no tuning saw (the reward-hacking rules were tuned on hacked
# seeds 1000-1099, controls and variants 1000-1199, controls 1000-2999; the oracle is calibrated on
# 5000..). The first set, 3000.., was looked at with the previous monitor (its control 3167 was
# flagged): the table is on 7000.., run once, after the monitor was settled
TARGET_SEED0 = 7000
VARIANTS = tuple(
    (hr, nz, rr) for hr in (0.0005, 0.001, 0.0015) for nz in (0.02, 0.04) for rr in (0.002, 0.004)
)


def target(
    seed0: int, n_hacked: int, n_ctrl: int, n_cal: int, n_var: int, rld_ctrl: int
) -> dict[str, Any]:
    """Issue 49 point 7, per cadence: ptops (``build_monitors()`` defaults, its reward_hacking
    findings) and rldoctor 0.2.0 (``run_rldoctor``) on the same hacked runs (seeds ``seed0`` ..
    ``seed0 + n_hacked - 1``) and healthy controls (``hacking(..., hacked=False)``, ``n_ctrl``
    seeds from ``seed0``; rldoctor on the first ``rld_ctrl``), the oracles (``evidence``: reward +
    held-out and held-out alone) at the threshold that none of ``n_cal`` healthy runs of any
    CAL_FAMILIES family crosses, and ptops on ``n_var`` seeds of each of ``--tune-hacking``'s 12
    healthy variants (a stress set, not the target's controls)."""
    out: dict[str, Any] = {
        "seeds_hacked": [seed0, seed0 + n_hacked - 1],
        "seeds_controls": [seed0, seed0 + n_ctrl - 1],
        "rldoctor_controls": rld_ctrl,
        "n_cal": n_cal,
        "cal_seeds": [CAL_SEED0, CAL_SEED0 + n_cal - 1],
    }
    for every, label in CADENCES:
        t0 = time.time()
        fam_max: dict[str, list[list[float]]] = {"held": [], "joint": []}
        for i, (held_rise, reward_rise) in enumerate(CAL_FAMILIES):
            m: dict[str, list[float]] = {"held": [], "joint": []}
            for s in range(CAL_SEED0, CAL_SEED0 + n_cal):
                recs = (
                    hacking(s, every, hacked=False)[0]
                    if i == 0
                    else hacking_variant(s, every, held_rise, HELD_NOISE, reward_rise)[0]
                )
                ev = evidence(recs)[1]
                for k in m:
                    m[k].append(float(ev[k].max()))
            for k in m:
                fam_max[k].append(m[k])
        h0 = {k: max(threshold(m, 0) for m in fam_max[k]) for k in fam_max}
        onsets, firsts = [], {"ptops": [], "rldoctor": [], "oracle": [], "oracle_held": []}
        for s in range(seed0, seed0 + n_hacked):
            recs, at = hacking(s, every)
            onsets.append(at)
            firsts["ptops"].append(first(run_ptops(recs), "reward_hacking"))
            firsts["rldoctor"].append(first(run_rldoctor(recs), "reward_hacking"))
            steps, ev = evidence(recs)
            firsts["oracle"].append(alarm(steps, ev["joint"], h0["joint"]))
            firsts["oracle_held"].append(alarm(steps, ev["held"], h0["held"]))
        ctrl_fp, ctrl_any, rld_fp = [], [], []
        for i, s in enumerate(range(seed0, seed0 + n_ctrl)):
            recs = hacking(s, every, hacked=False)[0]
            alerts = run_ptops(recs)
            if first(alerts, "reward_hacking") is not None:
                ctrl_fp.append(s)
            if alerts:
                ctrl_any.append(s)
            if i < rld_ctrl and first(run_rldoctor(recs), "reward_hacking") is not None:
                rld_fp.append(s)
        var_fp = {}
        for v in VARIANTS:
            n = 0
            for s in range(seed0, seed0 + n_var):
                n += (
                    first(run_ptops(hacking_variant(s, every, *v)[0]), "reward_hacking") is not None
                )
            var_fp[f"held +{v[0]:g} noise {v[1]:g} reward +{v[2]:g}"] = n
        row: dict[str, Any] = {k: {**delays(f, onsets), "firsts": f} for k, f in firsts.items()}
        row["onsets"] = onsets
        row["thresholds_0pct"] = h0
        row["controls"] = n_ctrl
        row["ptops_fp_controls"] = ctrl_fp
        row["ptops_any_rl_finding_controls"] = ctrl_any
        row["rldoctor_fp_controls"] = [len(rld_fp), rld_ctrl]
        row["ptops_fp_variants"] = [sum(var_fp.values()), n_var * len(VARIANTS), var_fp]
        # per trace, against rldoctor's first alert where it came at or after the onset
        pairs = [
            (p, r)
            for p, r, o in zip(firsts["ptops"], firsts["rldoctor"], onsets)
            if r is not None and r >= o and p is not None
        ]
        row["vs_rldoctor_at_after"] = {
            "traces": len(pairs),
            "ptops_earlier": sum(p < r for p, r in pairs),
            "same_step": sum(p == r for p, r in pairs),
            "ptops_later": sum(p > r for p, r in pairs),
        }
        row["elapsed_s"] = time.time() - t0
        out[label] = row
    return out


def print_target(res: dict[str, Any]) -> None:
    """One markdown table: per cadence the target's terms and whether each holds."""
    print(
        "| cadence | controls | ptops FP | ptops median (min..max) | rldoctor: median of its "
        "alerts at/after the onset (traces); all alerts; FP on controls | ptops / rldoctor | "
        "oracle 0 % FP: reward + held-out; held-out alone | gap to the oracle (allowed) | "
        "ptops FP on the 12 healthy variants | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for every, label in CADENCES:
        row = res[label]
        p, r, o, oh = row["ptops"], row["rldoctor"], row["oracle"], row["oracle_held"]
        allowed = 8 if every == 1 else every
        rmed, pmed = r["median_after_onset"], p["median"]
        gap = pmed - o["median"]
        ratio = f"{pmed / rmed:.2f}" if rmed else "-"
        n_after = r["detected"] - r["before_onset"]
        fp = len(row["ptops_fp_controls"])
        vs = row["vs_rldoctor_at_after"]
        ok = fp == 0 and pmed <= rmed and gap <= allowed
        short = []
        if fp:
            short.append(f"{fp} FP")
        if pmed > rmed:
            short.append(f"{pmed - rmed:+.1f} steps after rldoctor")
        if gap > allowed:
            short.append(f"{gap - allowed:+.1f} steps past the oracle's allowance")
        vf = row["ptops_fp_variants"]
        rfp = row["rldoctor_fp_controls"]
        print(
            f"| {label} | {row['controls']} | {fp}/{row['controls']} | {_cell(p)} | "
            f"{rmed:+.1f} ({n_after}); {_cell(r)}; FP {rfp[0]}/{rfp[1]} | {ratio} "
            f"(per trace: earlier {vs['ptops_earlier']}, same {vs['same_step']}, later "
            f"{vs['ptops_later']} of {vs['traces']}) | {_cell(o)}; {_cell(oh)} | "
            f"{gap:+.1f} ({allowed}) | {vf[0]}/{vf[1]} | "
            + ("met" if ok else "not met: " + ", ".join(short))
            + " |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument(
        "--tune",
        action="store_true",
        help="run the tuning seeds (1000-1004) instead of the unseen ones",
    )
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "rl_early_warning.json"))
    ap.add_argument("--only", default="", help="run only scenario groups containing this text")
    ap.add_argument(
        "--tools", default=",".join(TOOLS), help="comma-separated subset of ptops,rldoctor,rlwatch"
    )
    ap.add_argument(
        "--cost", action="store_true", help="only measure the RL monitors' cost per record"
    )
    ap.add_argument(
        "--tune-hacking",
        action="store_true",
        help="ptops alone on the reward-hacking tuning set (seeds 1000-1059)",
    )
    ap.add_argument(
        "--bound",
        action="store_true",
        help="reward hacking: the oracle's delay at 0/1/5 %% false alarms vs ptops and rldoctor",
    )
    ap.add_argument("--bound-cal", type=int, default=300, help="healthy runs per family (--bound)")
    ap.add_argument(
        "--target",
        action="store_true",
        help="issue 49 point 7: ptops vs rldoctor vs the 0 %% oracle on held-out seeds",
    )
    ap.add_argument("--target-seed0", type=int, default=TARGET_SEED0)
    ap.add_argument("--target-hacked", type=int, default=100, help="hacked runs per cadence")
    ap.add_argument("--target-controls", type=int, default=200, help="healthy controls per cadence")
    ap.add_argument(
        "--target-rldoctor-controls", type=int, default=100, help="controls rldoctor runs on"
    )
    ap.add_argument("--target-variants", type=int, default=100, help="seeds per healthy variant")
    ap.add_argument("--bound-seeds", type=int, default=100, help="hacked seeds 0..N-1 (--bound)")
    ap.add_argument(
        "--bound-rldoctor-seeds",
        type=int,
        default=15,
        help="seeds rldoctor runs on (--bound; 0: its alerts from the table's JSON, seeds 0-4)",
    )
    args = ap.parse_args(argv)
    if args.target:
        try:
            import rl_doctor  # noqa: F401
        except ImportError:
            print(
                "--target runs the peer in the same run: rldoctor 0.2.0 is not importable "
                "(pip install --target /tmp/rld-site rldoctor==0.2.0; PYTHONPATH=/tmp/rld-site)",
                file=sys.stderr,
            )
            return 2
        logging.disable(logging.CRITICAL)
        t0, c0 = time.time(), time.process_time()
        res = target(
            args.target_seed0,
            args.target_hacked,
            args.target_controls,
            args.bound_cal,
            args.target_variants,
            args.target_rldoctor_controls,
        )
        res["elapsed_s"] = time.time() - t0
        res["cpu_s"] = time.process_time() - c0
        print_target(res)
        print(f"({res['elapsed_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU)")
        out = REPO / "bench" / "results" / "rl_early_warning_target.json"
        out.write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.bound:
        logging.disable(logging.CRITICAL)
        t0, c0 = time.time(), time.process_time()
        table = REPO / "bench" / "results" / "rl_early_warning.json"
        res = bound(args.bound_cal, args.bound_seeds, args.bound_rldoctor_seeds, table)
        res["elapsed_s"] = time.time() - t0
        res["cpu_s"] = time.process_time() - c0
        print_bound(res)
        print(f"({res['elapsed_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU)")
        out = REPO / "bench" / "results" / "rl_early_warning_bound.json"
        out.write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.tune_hacking:
        logging.disable(logging.CRITICAL)
        tune_hacking(
            list(range(1000, 1000 + 12 * args.seeds)),
            tuple(int(c) for c in args.only.split(",")) if args.only else (1, 10, 25),
        )
        return 0
    if args.cost:
        for k, v in cost().items():
            print(f"{k:24s} {v:6.2f} us/record (process CPU time, best of 7)")
        return 0
    logging.disable(logging.CRITICAL)
    seeds = list(range(1000, 1005)) if args.tune else list(range(args.seeds))
    rows = []
    t0 = time.time()
    for sc in scenarios(seeds):
        if args.only and args.only not in sc["group"]:
            continue
        row = {k: v for k, v in sc.items() if k != "recs"}
        for tool, fn in TOOLS.items():
            alerts = fn(sc["recs"]) if tool in args.tools.split(",") else []
            if sc["kind"] == "healthy":
                mine = [a for a in alerts if a[1] in ("entropy_collapse", "reward_hacking")]
                row[tool] = {"fp": len(mine), "fp_any": len(alerts), "alerts": alerts[:10]}
            else:
                det = sc["detector"]
                f = first(alerts, det)
                row[tool] = {
                    "first": f,
                    "early": f is not None and f < sc["onset"],
                    "alerts": alerts[:10],
                }
        rows.append(row)
    elapsed = time.time() - t0
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    summary = []
    print(
        f"seeds {'1000-1004 (tuning)' if args.tune else f'0-{args.seeds - 1} (unseen)'}; "
        f"{len(rows)} traces; {elapsed:.0f} s"
    )
    print(
        "| scenario | traces | ptops | rldoctor 0.2.0 | rlwatch 0.5.1 | ptops lead over the best "
        "peer |"
    )
    print("|---|---|---|---|---|---|")
    for g, rs in groups.items():
        if rs[0]["kind"] == "healthy":
            cells = []
            for tool in TOOLS:
                runs = sum(1 for r in rs if r[tool]["fp"])
                runs_any = sum(1 for r in rs if r[tool]["fp_any"])
                cells.append(f"FP {runs}/{len(rs)} runs (any detector {runs_any})")
            summary.append(
                {
                    "group": g,
                    "kind": "healthy",
                    "traces": len(rs),
                    **{
                        t: {
                            "fp_runs": sum(1 for r in rs if r[t]["fp"]),
                            "fp_any_runs": sum(1 for r in rs if r[t]["fp_any"]),
                        }
                        for t in TOOLS
                    },
                }
            )
            print(f"| {g} | {len(rs)} | " + " | ".join(cells) + " | - |")
            continue
        cells, s = [], {"group": g, "kind": rs[0]["kind"], "traces": len(rs)}
        for tool in TOOLS:
            delays = [r[tool]["first"] - r["truth"] for r in rs if r[tool]["first"] is not None]
            found = len(delays)
            early = sum(1 for r in rs if r[tool]["early"])
            med = statistics.median(delays) if delays else None
            s[tool] = {
                "detected": found,
                "before_onset": early,
                "median_vs_truth": med,
                "min": min(delays) if delays else None,
                "max": max(delays) if delays else None,
            }
            cells.append(
                f"{found}/{len(rs)}, median {med:+.0f} (min {min(delays):+d}, max {max(delays):+d})"
                + (f", {early} before onset" if early else "")
                if delays
                else f"0/{len(rs)}"
            )
        leads, missed_by_peers, ptops_later = [], 0, 0
        for r in rs:
            p = r["ptops"]["first"]
            # a peer alert before the onset is a false alarm, not a detection
            peers = [
                r[t]["first"]
                for t in ("rldoctor", "rlwatch")
                if r[t]["first"] is not None and r[t]["first"] >= r["onset"]
            ]
            if p is None:
                continue
            if not peers:
                missed_by_peers += 1
                continue
            leads.append(min(peers) - p)
            ptops_later += min(peers) < p
        s["lead"] = {
            "median": statistics.median(leads) if leads else None,
            "min": min(leads) if leads else None,
            "peers_missed": missed_by_peers,
            "ptops_later": ptops_later,
        }
        summary.append(s)
        lead = (
            (
                f"median {statistics.median(leads):+.0f} steps (min {min(leads):+d})"
                if leads
                else "-"
            )
            + (
                f"; no peer alert at or after the onset on {missed_by_peers}"
                if missed_by_peers
                else ""
            )
            + (f"; ptops later on {ptops_later}" if ptops_later else "")
        )
        print(f"| {g} | {len(rs)} | " + " | ".join(cells) + f" | {lead} |")
    print(
        "(detection: step of the first alert minus the ground truth - the 30 % crossing for "
        "collapse, "
        "the onset for reward hacking; negative = before it)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "seeds": seeds,
                    "tuning": args.tune,
                    "elapsed_s": elapsed,
                    "summary": summary,
                    "traces": rows,
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
