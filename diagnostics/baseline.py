"""``diagnose --baseline OTHER``: is this run's convergence a regression against a reference run of
the same recipe, beyond seed-to-seed noise?

Curves: for each step, the value that counts (the last record written for that step and rank: a
resumed run redoes steps), averaged over ranks, for every metric in :data:`CURVES` both runs log.

Noise, per metric and per step (a difference is judged against the noise at that step):
- one baseline: step-to-step jitter plus a drift allowance. The jitter is measured, robust to the
  curve's trend: the median absolute second difference (y[i-1] - 2 y[i] + y[i+1]) of the baseline
  times 1.4826 / sqrt(6) (a Gaussian standard deviation), times sqrt(2) (two runs' noise in a
  difference). Seeds also drift apart slowly (another init, another data order), which one run
  cannot measure: the allowance is ``REL`` (15 %) of how far the baseline has moved from its first
  step so far (measured on titan-tiny, seeds 42 and 7: 0.21 apart after a 1.0 loss drop; a 5x
  learning rate: 1.4-1.7 apart). noise = sqrt(jitter^2 + (REL * moved)^2);
- several baselines (``--baseline`` repeated, other seeds of the same recipe): seed-to-seed noise is
  measured: per step the largest distance of a baseline from their mean, times sqrt(2), the running
  maximum over 5 steps, floored at the jitter. ``noise_method`` in the report says which one was
  used.
The noise is floored at 1e-3 of the curve's median magnitude, so a perfectly smooth curve does not
make every tiny difference significant.

Divergence: the difference (run - baseline mean), both as is and smoothed by a running median over 5
steps (so one odd step does not count), exceeds ``K`` (4) noise on the same side for ``SUSTAIN`` (3)
consecutive steps; the first of those steps is the first step of divergence.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

CURVES = ("loss", "grad_norm", "reward", "entropy", "kl")
K = 4.0
REL = 0.15
SUSTAIN = 3
WINDOW = 5


class BaselineError(Exception):
    """One line for the user (exit 2)."""


def slim(r: dict[str, Any]) -> dict[str, Any]:
    """A record cut to what :func:`curves` reads."""
    return {k: r[k] for k in ("step", "rank", *CURVES) if k in r}


def curves(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """metric -> step -> mean over ranks of the last value written for that step and rank."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for r in records:
        s = r.get("step")
        if isinstance(s, int) and not isinstance(s, bool):
            last[(s, r.get("rank", 0) if isinstance(r.get("rank", 0), int) else 0)] = r
    out: dict[str, dict[int, list[float]]] = {}
    for (s, _rank), r in last.items():
        for m in CURVES:
            v = r.get(m)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                out.setdefault(m, {}).setdefault(s, []).append(float(v))
    return {m: {s: sum(v) / len(v) for s, v in sorted(d.items())} for m, d in out.items()}


def _running_median(xs: list[float], w: int = WINDOW) -> list[float]:
    h = w // 2
    return [statistics.median(xs[max(0, i - h) : i + h + 1]) for i in range(len(xs))]


def _noise_one(ys: list[float]) -> float:
    """Step-to-step noise of one curve, robust to its trend: second differences y[i-1] - 2y[i] +
    y[i+1] cancel a smooth trend and carry 6 sigma^2 of white noise; their MAD * 1.4826 / sqrt(6) is
    sigma. Times sqrt(2): the difference of two runs carries both runs' noise."""
    if len(ys) < 3:
        return 0.0
    d2 = [abs(ys[i - 1] - 2 * ys[i] + ys[i + 1]) for i in range(1, len(ys) - 1)]
    return 1.4826 * statistics.median(d2) / math.sqrt(6) * math.sqrt(2)


def _read(run_dir: Path) -> list[dict[str, Any]]:
    from ptops.ops.runrecord.metrics import MetricsIndexError
    from ptops.ops.runrecord.rundir import RunDir

    run = RunDir(Path(run_dir))
    if not Path(run_dir).is_dir():
        raise BaselineError(f"{run_dir}: no such baseline run directory")
    if not run.has_metrics():
        raise BaselineError(f"{run.metrics}: the baseline has no metrics.jsonl")
    try:  # the curves' keys only (a baseline may be large)
        return [slim(r) for r in run.iter_metrics()]
    except MetricsIndexError as e:
        raise BaselineError(str(e)) from None


def compare(
    run_records: list[dict[str, Any]],
    baselines: dict[str, list[dict[str, Any]]],
    *,
    k: float = K,
    sustain: int = SUSTAIN,
) -> dict[str, Any]:
    """The ``baseline`` key of the diagnose report (see the module docstring for the method)."""
    mine = curves(run_records)
    refs = {name: curves(recs) for name, recs in baselines.items()}
    compared = [m for m in CURVES if m in mine and all(m in c for c in refs.values())]
    per_metric: dict[str, Any] = {}
    firsts: list[int] = []
    for m in compared:
        steps = sorted(set(mine[m]).intersection(*(set(c[m]) for c in refs.values())))
        if len(steps) < sustain + 2:
            per_metric[m] = {
                "steps": len(steps),
                "diverged": False,
                "first_divergent_step": None,
                "note": "too few common steps to compare",
            }
            continue
        ref_mean = [sum(c[m][s] for c in refs.values()) / len(refs) for s in steps]
        jitter = _noise_one(ref_mean)
        floor = 1e-3 * max(1e-12, statistics.median(abs(x) for x in ref_mean))
        if len(refs) > 1:
            spread = [
                max(abs(c[m][s] - mu) for c in refs.values()) * math.sqrt(2)
                for s, mu in zip(steps, ref_mean)
            ]
            h = WINDOW // 2
            noise_s = [
                max(jitter, floor, max(spread[max(0, i - h) : i + h + 1]))
                for i in range(len(steps))
            ]
            method = (
                f"spread of {len(refs)} baselines (running max over {WINDOW} steps), "
                "floored at their jitter"
            )
        else:
            moved, noise_s = 0.0, []
            for mu in ref_mean:
                moved = max(moved, abs(mu - ref_mean[0]))
                noise_s.append(max(floor, math.hypot(jitter, REL * moved)))
            method = (
                f"baseline jitter (MAD of second differences) + {REL:.0%} of its movement so far"
            )
        noise = statistics.median(noise_s)
        diff = [mine[m][s] - mu for s, mu in zip(steps, ref_mean)]
        smooth = _running_median(diff)
        z = [d / n for d, n in zip(smooth, noise_s)]
        first, run_len = None, 0
        for s, zz, d, n in zip(steps, z, diff, noise_s):
            # smoothed and raw both beyond, same side: the window cannot pull a later jump earlier
            run_len = run_len + 1 if abs(zz) > k and abs(d) > k * n and d * zz > 0 else 0
            if run_len >= sustain:
                first = steps[steps.index(s) - sustain + 1]
                break
        peak_i = max(range(len(z)), key=lambda i: abs(z[i]))
        per_metric[m] = {
            "steps": len(steps),
            "noise": noise,
            "noise_method": method,
            "jitter": jitter,
            "noise_final": noise_s[-1],
            "threshold": k * noise,
            "diverged": first is not None,
            "first_divergent_step": first,
            "max_z": z[peak_i],
            "max_z_step": steps[peak_i],
            "final_diff": diff[-1],
            "final": mine[m][steps[-1]],
            "baseline_final": ref_mean[-1],
        }
        if first is not None:
            firsts.append(first)
    return {
        "run_dir": None,
        "baselines": list(baselines),
        "compared": compared,
        "diverged": bool(firsts),
        "first_divergent_step": min(firsts, default=None),
        "k": k,
        "sustain": sustain,
        "per_metric": per_metric,
    }


def against(run_records: list[dict[str, Any]], baseline_dirs: list[Path]) -> dict[str, Any]:
    recs = {str(d): _read(Path(d)) for d in baseline_dirs}
    out = compare(run_records, recs)
    out["run_dir"] = str(baseline_dirs[0])
    if not out["compared"]:
        out["note"] = "no metric in common (loss, grad_norm, reward, entropy, kl)"
    return out
