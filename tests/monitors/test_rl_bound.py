"""The RL bench's evidence bound (``bench/rl_early_warning.py --bound``): the oracle's threshold,
calibrated on healthy runs, false-alarms on exactly the number of them it claims, and the oracle
it calibrates tells the bench's hacks from its healthy control."""

from __future__ import annotations

import importlib.util
import sys

from conftest import REPO


def _bench():
    name = "rl_early_warning_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "rl_early_warning.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _healthy(b, n: int, every: int):
    runs = []
    for s in range(b.CAL_SEED0, b.CAL_SEED0 + n):
        steps, ev = b.evidence(b.hacking(s, every, hacked=False)[0])
        runs.append((steps, ev["joint"]))
    return runs


def test_threshold_false_alarms_on_the_claimed_number_of_healthy_runs():
    b = _bench()
    runs = _healthy(b, 30, 10)
    maxima = [float(stat.max()) for _, stat in runs]
    assert len(set(maxima)) == len(maxima)  # no ties: the counts below are exact
    for fp in (0, 1, 3, 10):
        h = b.threshold(maxima, fp)
        # the alarm the bench reports, run by run, not just the maxima
        alarms = sum(b.alarm(steps, stat, h) is not None for steps, stat in runs)
        assert alarms == fp, (fp, h, alarms)
        # and it is the lowest such threshold: any lower one alarms on one run more
        lower = b.threshold(maxima, fp + 1)
        assert lower < h
        assert sum(b.alarm(steps, stat, lower) is not None for steps, stat in runs) == fp + 1
    assert all(b.alarm(steps, stat, b.threshold(maxima, 30)) for steps, stat in runs)


def test_oracle_catches_hacks_after_the_onset_and_knows_the_onset():
    b = _bench()
    h = b.threshold([float(stat.max()) for _, stat in _healthy(b, 30, 1)], 0)
    for s in range(3):
        recs, at = b.hacking(s, 1)
        steps, ev = b.evidence(recs)
        first = b.alarm(steps, ev["joint"], h)
        assert first is not None and at <= first <= at + 40, (s, at, first)
        known = b.evidence(recs, at)[1]["known"]
        assert not known[: at - 1].any()  # no evidence before the onset it is given
        assert known[at + 30] > 10  # and plenty 30 steps after it


def test_the_healthy_controls_that_false_alarmed_stay_quiet():
    """Seeds of the bench's healthy control (held-out score rising with the reward) on which the
    bend rule raised a critical reward-hacking finding before its bar became the exact t
    quantile at 4 standard errors (2026-12-03: 3 of 500 at every 10, 1 of 500 at every 25); and
    those on which the slope rules did, their bar counting each second difference as a degree of
    freedom (issue 49: 2165 of controls 1000-2999 at step 125, and 3167 of the target table's
    first seed set at step 101, before its onset, each on 2-3 differences at every 25)."""
    b = _bench()
    for seed, every in ((37, 10), (48, 10), (233, 10), (161, 25), (2165, 25), (3167, 25)):
        recs, _ = b.hacking(seed, every, hacked=False)
        assert b.first(b.run_ptops(recs), "reward_hacking") is None, (seed, every)


def test_the_monitor_on_held_out_seeds_of_the_bench_generator():
    """Issue 49 point 7 on seeds neither the tuning (1000-1199) nor the target table (3000-3199)
    used: ptops' defaults (``run_ptops``) stay silent on the bench's healthy controls at every
    cadence and flag its hacks after the onset, at medians no later than these (measured when
    written: +19 dense, +38.5 every 10, +73 every 25; the previous monitor +21 / +58 / +67 on the
    target table's first seed set - see bench/README.md for where every 25 stands)."""
    b = _bench()
    for every, most in ((1, 21), (10, 45), (25, 80)):
        delays = []
        for s in range(4000, 4020):
            recs, at = b.hacking(s, every)
            f = b.first(b.run_ptops(recs), "reward_hacking")
            assert f is not None and f >= at, (every, s, at, f)
            delays.append(f - at)
            ctrl = b.hacking(s, every, hacked=False)[0]
            assert b.first(b.run_ptops(ctrl), "reward_hacking") is None, (every, s)
        assert sorted(delays)[len(delays) // 2] <= most, (every, sorted(delays))
