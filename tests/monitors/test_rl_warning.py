"""RL early warning: findings are episodes, dips that recover are tolerated, sparse held-out
scores catch reward hacking, the entropy forecast comes before the threshold, replay = live."""

from __future__ import annotations

import json
import math
import random

from conftest import TESTS

from ptops.monitors import (
    EntropyCollapseMonitor,
    MonitorsSection,
    RewardHackingMonitor,
    build_monitors,
    replay,
)
from ptops.ops.runrecord.events import reduce
from ptops.ops.supervisor.policy import FindingPolicy

TRACES = TESTS / "data" / "traces"


def _ent(fn, steps=220, seed=0, noise=0.03, extra=None):
    rng = random.Random(seed)
    out = []
    for t in range(1, steps + 1):
        rec = {"step": t, "rank": 0, "attempt": 1, "entropy": fn(t) * (1 + rng.gauss(0, noise))}
        if extra:
            rec.update(extra(t, rng))
        out.append(rec)
    return out


def _collapse_then_recover(t):
    if t < 60:
        return 1.5
    if t < 110:
        return 1.5 * (0.05 + 0.95 * math.exp(-(t - 60) / 12))
    return 1.5  # the fix landed (say, a higher temperature): back to its level


def test_collapse_then_recover_is_one_episode_warning_escalation_all_clear():
    found = replay(_ent(_collapse_then_recover), [EntropyCollapseMonitor()])
    assert [(f.phase, f.severity, f.episode) for f in found] == [
        ("open", "warning", 1),
        ("escalate", "critical", 1),
        ("resolved", "info", 1),
    ], found
    warn, crit, clear = found
    assert 60 < warn.step < crit.step < 110 <= clear.step
    # the all-clear is recorded but never acted on, even where the monitor's action is rollback
    pol = FindingPolicy(
        MonitorsSection.model_validate({"entropy_collapse": {"action": "rollback"}})
    )
    assert pol.decide(warn).action == "rollback" and pol.decide(clear).action == "alert"
    # and it closes the episode's open findings in the run's view
    events = [{"ts": 0, "kind": "launch", "attempt": 1}] + [
        {"ts": 1, **f.to_event()} for f in found
    ]
    assert reduce(events[:3]).open_findings and reduce(events).open_findings == []


def test_dip_that_recovers_gives_no_warning():
    for seed in range(10):
        for depth, ramp, hold in ((0.3, 1, 4), (0.35, 3, 6), (0.3, 2, 3)):

            def f(t):
                d = t - 90
                if 0 <= d < ramp:
                    return 1.5 * (1 - depth * (d + 1) / ramp)
                if ramp <= d < ramp + hold:
                    return 1.5 * (1 - depth)
                return 1.5

            assert replay(_ent(f, seed=seed), build_monitors()) == [], (seed, depth, ramp, hold)


def test_forecast_fires_before_the_threshold_is_crossed():
    for seed in range(10):
        recs = _ent(lambda t: 1.0 if t < 60 else 0.05 + 0.95 * math.exp(-(t - 60) / 25), seed=seed)
        crossing = 60 + math.ceil(25 * math.log(0.95 / 0.25))  # noiseless curve under 30 %
        (warn, *rest) = replay(recs, [EntropyCollapseMonitor()])
        assert (
            warn.severity == "warning" and warn.phase == "open" and 60 < warn.step < crossing - 10
        ), warn
        forecast_step = int(warn.detail.split(" at step ")[1].split()[0])
        assert abs(forecast_step - crossing) <= 25, (forecast_step, crossing, warn.detail)


def _hacking(every: int, seed: int, fall: float = 0.003, noise: float = 0.015):
    rng = random.Random(seed)
    out = []
    for t in range(1, 201):
        d = max(0, t - 100)
        out.append(
            {"step": t, "rank": 0, "reward": 0.3 + 0.0005 * t + 0.006 * d + rng.gauss(0, 0.03)}
        )
        held = 0.3 + 0.0004 * t - fall * d + rng.gauss(0, noise)
        if every == 1:
            out[-1]["rewards_verifier_mean"] = held
        elif t % every == 0:
            out.append({"step": t, "rank": 0, "eval/accuracy": held})  # an eval record of its own
    return out


def test_reward_hacking_fires_with_dense_and_sparse_held_out_scores():
    for every in (1, 5, 10):
        for seed in range(5):
            found = replay(_hacking(every, seed), [RewardHackingMonitor()])
            assert found and all(f.step > 100 for f in found), (every, seed, found)
            assert any(f.severity == "critical" for f in found), (every, seed, found)
            assert len([f for f in found if f.phase == "open"]) == 1, (every, seed, found)


def test_healthy_recorded_grpo_traces_give_no_rl_findings():
    for p in sorted(TRACES.glob("trl-grpo-*.jsonl")):
        recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        assert [f for f in replay(recs, build_monitors()) if f.family == "rl"] == [], p.name


def test_replay_gives_the_same_findings_as_live_feeding_with_two_ranks():
    recs = []
    for r in _ent(_collapse_then_recover):
        recs += [r, {**r, "rank": 1}]
    mons = build_monitors()
    live = [f for rec in recs for m in mons for f in m.feed(rec)]
    assert (
        live == replay(recs, build_monitors()) and len(live) == 3
    )  # one finding per transition, not per rank


def test_rewind_starts_the_redone_timeline_without_an_open_episode():
    recs = _ent(_collapse_then_recover, steps=100)
    redo = [dict(r, attempt=2) for r in recs if r["step"] >= 40]
    found = replay(recs + redo, [EntropyCollapseMonitor()])
    opens = [f for f in found if f.phase == "open"]
    assert len(opens) == 2 and opens[1].episode == 2 and opens[1].attempt == 2


def test_eval_records_before_after_or_late_never_rewind_the_training_series():
    base = _hacking(10, 1)
    before, late = [], []
    for r in base:
        if "eval/accuracy" in r:
            before.insert(
                len(before) - 1, r
            )  # the eval record just before its step's training record
            late.append(dict(r, step=r["step"]))
        else:
            before.append(r)
            late.append(r)
    late = [r for r in late if "eval/accuracy" not in r]
    for r in base:  # each eval record one training step late
        if "eval/accuracy" in r:
            i = (
                next(j for j, x in enumerate(late) if x["step"] == r["step"] + 1)
                if r["step"] < 200
                else len(late)
            )
            late.insert(i + 1, r)
    want = [(f.phase, f.severity) for f in replay(base, [RewardHackingMonitor()])]
    assert ("open", "critical") in want or ("escalate", "critical") in want
    for variant in (before, late):
        got = replay(variant, [RewardHackingMonitor()])
        assert [(f.phase, f.severity) for f in got] == want, got


def test_kl_and_stale_rollout_findings_are_episodes_too():
    from ptops.monitors import KLDriftMonitor, StaleRolloutMonitor

    def kl(t):
        return 0.02 if t < 40 else min(0.02 * 1.08 ** (t - 40), 3.0) if t < 120 else 0.02

    recs = [
        {"step": t, "rank": r, "kl": kl(t), "policy_lag": 8 if 50 <= t < 90 else 1}
        for t in range(1, 160)
        for r in (0, 1)
    ]
    found = replay(recs, [KLDriftMonitor(), StaleRolloutMonitor()])
    by = {
        m: [(f.phase, f.severity) for f in found if f.monitor == m]
        for m in ("kl_drift", "stale_rollout")
    }
    assert by["kl_drift"] == [
        ("open", "warning"),
        ("escalate", "critical"),
        ("resolved", "info"),
    ], found
    assert by["stale_rollout"] == [("open", "warning"), ("resolved", "info")], found
    clear = [f for f in found if f.monitor == "stale_rollout"][1]
    assert clear.step == 99  # 10 steps within the bound after step 89


def test_diagnose_tells_an_rl_episode_as_one_incident_ended_by_its_all_clear(tmp_path):
    """The warning, the escalation and the all-clear of one episode are one incident, not three."""
    from ptops.diagnostics.diagnose import diagnose

    run = tmp_path / "run"
    run.mkdir()
    recs = _ent(_collapse_then_recover)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = diagnose(run)
    rl = [i for i in rep["incidents"] if i["kind"] == "rl"]
    assert len(rl) == 1, rl
    (inc,) = rl
    assert inc["severity"] == "critical" and inc["details"]["episode"] == 1
    assert (
        60 < inc["step"] < 110 <= inc["details"]["resolved_step"]
        and "all clear at step" in inc["title"]
    )
    assert {f["phase"] for f in rep["findings"] if f["monitor"] == "entropy_collapse"} == {
        "open",
        "escalate",
        "resolved",
    }


def _run(seed: int, every: int, hacked: bool, steps: int = 300):
    """A fresh trace (not the bench's generator): from a random onset the reward climbs faster while
    the held-out score falls (hacked) or rises with it (healthy); the score on every step or every
    ``every``."""
    rng = random.Random(seed * 1009 + every * 7 + hacked)
    at = rng.randint(70, 130)
    rise, fall, noise = (
        rng.uniform(0.003, 0.006),
        rng.uniform(0.0015, 0.003),
        rng.uniform(0.01, 0.025),
    )
    out = []
    for t in range(1, steps + 1):
        d = max(0, t - at)
        out.append(
            {"step": t, "rank": 0, "reward": 0.3 + 0.0005 * t + rise * d + rng.gauss(0, 0.03)}
        )
        held = 0.3 + 0.0004 * t + (-fall if hacked else 0.5 * rise) * d + rng.gauss(0, noise)
        if every == 1:
            out[-1]["rewards_verifier_mean"] = held
        elif t % every == 0:
            out.append({"step": t, "rank": 0, "eval/accuracy": held})
    return out, at


def test_reward_hacking_is_flagged_soon_after_its_onset_dense_or_sparse():
    # the fall is judged against the held-out noise (second differences): 3 sparse values can be
    # enough
    within = {1: 35, 10: 70, 25: 100}
    for every, most in within.items():
        delays = []
        for seed in range(12):
            recs, at = _run(seed, every, hacked=True)
            found = [f for f in replay(recs, [RewardHackingMonitor()]) if f.phase != "resolved"]
            assert found and found[0].step >= at, (every, seed, at, found[:1])
            assert any(f.severity == "critical" for f in found), (every, seed, found)
            delays.append(found[0].step - at)
        assert sorted(delays)[len(delays) // 2] <= most, (every, delays)


def test_no_reward_hacking_finding_when_the_held_out_score_rises_with_the_reward():
    for every in (1, 10, 25):
        for seed in range(12):
            recs, _ = _run(seed, every, hacked=False)
            assert replay(recs, [RewardHackingMonitor()]) == [], (every, seed)


def _first_open(recs, cfg=None):
    from ptops.monitors.config import RewardHackingConfig

    mon = RewardHackingMonitor(cfg or RewardHackingConfig())
    return next((f for f in replay(recs, [mon]) if f.phase == "open"), None)


def test_the_bend_rule_flags_a_sparse_hack_earlier_than_the_slope_rules_alone():
    """The bend rule (issue 23 point 5): where the reward starts climbing faster, the held-out
    score's slope after that step on a line bent there; the values before the bend pin where the
    fall starts, so 1-2 sparse values after it can be enough. Removing it (bend_z=0) makes the
    same traces' findings later, never earlier."""
    from ptops.monitors.config import RewardHackingConfig

    off = RewardHackingConfig(bend_z=0)
    gains = []
    for every in (10, 25):
        for seed in range(12):
            recs, at = _run(seed, every, hacked=True)
            on, old = _first_open(recs), _first_open(recs, off)
            assert on is not None and old is not None and at <= on.step <= old.step, (
                every,
                seed,
                at,
                on,
                old,
            )
            gains.append(old.step - on.step)
    # at 4 standard errors on the exact t bar for its noise's honest degrees of freedom (since
    # 2026-12-03, _bend_noise; bench/README.md: the bar of 3 that count seemed to allow
    # false-alarmed on held-out healthy seeds) it gains on one trace of these 24 (a score every 10
    # steps, 10 steps), never loses; before that count (4 standard errors on n - 1 + k - 3 degrees
    # of freedom) it gained on more traces and false-alarmed on healthy variants (bench/README.md)
    assert sum(1 for g in gains if g > 0) >= 1 and sum(gains) >= 10, gains
    recs, at = _run(1, 10, hacked=True)
    on, old = _first_open(recs), _first_open(recs, off)
    assert on.severity == "critical" and old.step - on.step >= 10, (at, on.step, old.step)


def test_the_bend_rule_speaks_for_itself_on_a_stark_sparse_hack():
    """The turn rule's own finding, end to end through the monitor: the reward bends at step 100,
    the held-out score (every 10 steps, noise 0.01) falls 0.006 a step after it; the rule names
    the bend (found on every reward value: within a few steps of 100) and is reported on the eval
    record that completes the evidence (step 110, not the next training record), 20 steps before
    the slope rules alone would be."""
    from ptops.monitors.config import RewardHackingConfig

    recs = _hacking(10, 3, fall=0.006, noise=0.01)
    on, old = _first_open(recs), _first_open(recs, RewardHackingConfig(bend_z=0))
    assert on.severity == "critical" and "climbs faster from step" in on.detail, on.detail
    tau = int(on.detail.split("climbs faster from step ")[1].split()[0])
    assert abs(tau - 100) <= 3, on.detail
    assert on.step == 110 and old.step - on.step >= 20, (on.step, old.step)


def test_the_turn_rule_warns_earlier_dense_or_sparse_and_never_before_the_onset():
    """Issue 49 point 7, on this file's generator (random onset, reward rise, held-out fall and
    noise: not the bench's): the turn rule (the held-out slope after the dense reward's bend,
    bend_z) makes the monitor's first finding earlier, never later, and never before the onset.
    Measured when written: median delay 15 steps dense (17 without it), 35 every 10 (47)."""
    from ptops.monitors.config import RewardHackingConfig

    off = RewardHackingConfig(bend_z=0)
    for every, most, gained in ((1, 16, 15), (10, 38, 150)):
        delays, gains = [], []
        for seed in range(12):
            recs, at = _run(seed, every, hacked=True)
            on, old = _first_open(recs), _first_open(recs, off)
            assert on is not None and old is not None, (every, seed)
            assert at <= on.step <= old.step, (every, seed, at, on, old)
            delays.append(on.step - at)
            gains.append(old.step - on.step)
        assert sorted(delays)[len(delays) // 2] <= most, (every, sorted(delays))
        assert sum(gains) >= gained, (every, gains)


def test_the_reward_bend_is_found_where_the_reward_starts_climbing_faster():
    """``_reward_bend``: on a noisy reward that starts climbing 0.004 a step faster at a random
    step, the bend is found within 5 steps, well above 3 standard errors; on the same reward
    without a bend the best bend is under 3 standard errors on nearly every seed."""
    from ptops.monitors.rl.trend import _reward_bend

    near, quiet = 0, 0
    for seed in range(40):
        rng = random.Random(seed)
        at = rng.randint(60, 140)
        xs = list(range(1, 201))
        noise = [rng.gauss(0, 0.03) for _ in xs]
        bent = [0.3 + 0.0005 * t + 0.004 * max(0, t - at) + e for t, e in zip(xs, noise)]
        tau, t, g = _reward_bend(xs, bent)
        near += abs(tau - at) <= 5 and t > 6 and abs(g - 0.004) < 0.001
        straight = [0.3 + 0.0005 * t + e for t, e in zip(xs, noise)]
        quiet += _reward_bend(xs, straight)[1] < 3.0
    assert near >= 38 and quiet >= 36, (near, quiet)


def test_the_turn_rule_forgets_the_rewound_steps():
    """A run that rewinds (resume, rollback) redoes its steps: the turn rule's reward and held-out
    values from the rewound steps are dropped, so a hack on the abandoned timeline is not
    reported again on a healthy redo, and a redo that hacks is found."""
    hacked, at = _run(2, 10, hacked=True)
    healthy, _ = _run(2, 10, hacked=False)
    cut = at + 60
    first = [r for r in hacked if r["step"] < cut]
    redo = [dict(r, attempt=2) for r in healthy if at - 40 <= r["step"]]
    found = [f for f in replay(first + redo, [RewardHackingMonitor()]) if f.phase == "open"]
    assert len(found) == 1 and found[0].step < cut, found  # the first timeline's, once
    redo_h = [dict(r, attempt=2) for r in hacked if at - 40 <= r["step"]]
    again = [f for f in replay(first + redo_h, [RewardHackingMonitor()]) if f.phase == "open"]
    assert len(again) == 2 and again[1].attempt == 2 and again[1].step >= at, again


def test_the_bend_rules_bar_is_students_t_exactly():
    """The bend rule's noise comes from few values; its bar is the exact t quantile (the
    first-order expansion it replaced was 4.9 where the quantile is 6.6 at 3 standard errors and
    4 degrees of freedom: false alarms on healthy sparse runs)."""
    from ptops.monitors.rl.trend import _t_bar, _t_tail

    known = {1: 12.706, 2: 4.303, 3: 3.182, 5: 2.571, 10: 2.228, 30: 2.042}  # t at 0.975
    for dof, q in known.items():
        assert abs(_t_bar(1.959964, dof) - q) < 1e-3, (dof, _t_bar(1.959964, dof))
    for dof in (1, 2, 4, 7, 40):
        assert abs(_t_tail(0.0, dof) - 0.5) < 1e-12
        assert abs(_t_tail(_t_bar(4.0, dof), dof) / 3.16712e-5 - 1) < 1e-3  # far out, few dof
        assert abs(_t_tail(_t_bar(3.0, dof), dof) / 0.0013499 - 1) < 1e-3
    assert _t_bar(3.0, 4) > 3.0 * (1 + 10 / 16) + 1.5  # far above the expansion at few values


def _slow_rise(seed: int, every: int, frac: float):
    """Healthy: from a random onset the reward climbs faster and the sparse held-out score rises
    with it, ``frac`` as fast."""
    rng = random.Random(seed * 31 + every)
    at = rng.randint(70, 130)
    rise, noise = rng.uniform(0.003, 0.006), rng.uniform(0.01, 0.025)
    out = []
    for t in range(1, 301):
        d = max(0, t - at)
        r = 0.3 + 0.0005 * t + rise * d + rng.gauss(0, 0.03)
        out.append({"step": t, "rank": 0, "reward": r})
        if t % every == 0:
            held = 0.3 + 0.0004 * t + frac * rise * d + rng.gauss(0, noise)
            out.append({"step": t, "rank": 0, "eval/accuracy": held})
    return out, at


def test_the_bend_rule_never_flags_a_held_out_score_that_rises_after_the_bend():
    from ptops.monitors.rl.trend import _bend

    found_bend = 0
    for frac in (0.1, 0.5):
        for every in (5, 10, 25):
            for seed in range(12):
                recs, at = _slow_rise(seed, every, frac)
                assert replay(recs, [RewardHackingMonitor()]) == [], (frac, every, seed)
                # not vacuous: around the onset the reward's bend is found (the monitor's pairs:
                # each held-out value with the mean reward since the previous one), and the
                # held-out slope after it is positive (a tenth of the reward's rise: within noise)
                means: dict[int, list[float]] = {}
                for r in recs:
                    if "reward" in r:
                        means.setdefault((r["step"] - 1) // every, []).append(r["reward"])
                pts = [
                    (s, sum(means[(s - 1) // every]) / every, r["eval/accuracy"])
                    for r in recs
                    if "eval/accuracy" in r and at - 6 * every <= (s := r["step"]) <= at + 6 * every
                ]
                tau, acc, slope, *_ = _bend(pts, 3.0)
                if tau:
                    found_bend += 1
                    assert slope > 0 or frac < 0.5, (frac, every, seed, tau, slope)
    assert found_bend >= 36, found_bend


def test_the_bend_rules_noise_counts_its_degrees_of_freedom_honestly():
    """The bend rule's noise (``_bend_noise``): the bent line's residuals (k - 3 degrees of
    freedom) pooled with the second differences before its values, each of those worth about half
    a degree of freedom (``_d2_dof``: neighbours share values). On pure noise - a flat score, the
    line's slope after the bend truly 0 - the t bar at 2.5 standard errors is then crossed about
    as often as a normal's 2.5 (0.62 %); counting each difference as one degree of freedom (the
    rule until 2026-12-03) crosses it a third more often: the few-value false alarms it had."""
    from statistics import NormalDist

    from ptops.monitors.rl.trend import _bend_noise, _bent_fit, _d2_dof, _t_bar

    # the Satterthwaite count: 2 E[S]^2 / Var[S] for S the sum of n squared second differences
    rng = random.Random(3)
    for n in (1, 3, 10):
        sums = []
        for _ in range(20000):
            v = [rng.gauss(0, 1) for _ in range(n + 2)]
            sums.append(sum((v[i + 1] - 2 * v[i] + v[i - 1]) ** 2 for i in range(1, n + 1)))
        m = sum(sums) / len(sums)
        var = sum((s - m) ** 2 for s in sums) / (len(sums) - 1)
        assert abs(2 * m * m / var / _d2_dof(n) - 1) < 0.06, (n, 2 * m * m / var, _d2_dof(n))

    def rate(honest: bool) -> float:
        rng = random.Random(5)
        k, runs, hits = 6, 25000, 0
        for _ in range(runs):
            pre = [rng.gauss(0, 1) for _ in range(20)]
            win = [(10.0 * (i + 1), 0.0, rng.gauss(0, 1)) for i in range(k)]
            d2 = [pre[i + 1] - 2 * pre[i] + pre[i - 1] for i in range(1, len(pre) - 1)]
            sb = sum(x * x for x in d2)
            slope, _, vf, sse = _bent_fit(win, 10.0 * (k - 2), 2)  # 2 values after the bend
            if honest:
                var, dof = _bend_noise(sse, k, (sb, len(d2)))
            else:
                dof = k - 3 + len(d2)
                var = (sse + sb / 6) / dof
            hits += slope / math.sqrt(var * vf) <= -_t_bar(2.5, dof)
        return hits / runs

    p = NormalDist().cdf(-2.5)
    assert 0.7 * p <= rate(True) <= 1.15 * p, (rate(True), p)
    assert rate(False) > 1.2 * p  # the naive count: the test can tell them apart


def test_the_noise_keeps_apart_the_differences_before_a_window():
    """``_Noise.before``: the second differences whose three values all precede a step (the bend
    rule pools only those with its window's residuals: the window's own would count its values
    twice); after a rewind the redone values' differences start over, the old ones stay in the
    sums (other evaluations of the same score) but count as before any window."""
    from ptops.monitors.rl.trend import _BEND_VALUES, _Noise

    rng = random.Random(7)
    vals = [(10 * i, rng.gauss(0, 1)) for i in range(1, 41)]
    nz = _Noise()
    for s, v in vals:
        nz.add(v, s)

    def direct(upto: int, series) -> tuple[float, int]:
        v = [x for s, x in series if s < upto]
        d = [v[i + 1] - 2 * v[i] + v[i - 1] for i in range(1, len(v) - 1)]
        return sum(x * x for x in d), len(d)

    for first in (400 - 10 * (_BEND_VALUES - 1), 300, 350, 401):
        ss, n = nz.before(first)
        want = direct(first, vals)
        assert n == want[1] and abs(ss - want[0]) < 1e-9, (first, ss, n, want)
    # rewind to step 300: values 300.. are redone with new noise
    kept = [(s, v) for s, v in vals if s < 300]
    nz.rewind(300, tuple(v for _, v in kept[-2:]))
    redo = [(s, rng.gauss(0, 1)) for s in range(300, 410, 10)]
    for s, v in redo:
        nz.add(v, s)
    old = direct(10**9, vals)[0] - direct(300, vals)[0]  # the rewound-away differences
    for first in (320, 350):
        ss, n = nz.before(first)
        new = direct(first, kept + redo)
        assert abs(ss - (new[0] + old)) < 1e-9, (first, ss, new, old)
