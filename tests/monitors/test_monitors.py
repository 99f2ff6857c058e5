"""Monitors on synthetic traces with known ground truth: detected within a stated bound, silent when
healthy."""

from __future__ import annotations

import ast
import json
import math
import sys
import tomllib
from pathlib import Path

import pytest
import synth  # tests/data/traces (pytest's pythonpath)
from conftest import REPO, TESTS

from ptops.monitors import (
    EntropyCollapseMonitor,
    Finding,
    GradExplosionMonitor,
    KLDriftMonitor,
    LossSpikeMonitor,
    ModeCollapseMonitor,
    MonitorsSection,
    NanConfig,
    NaNMonitor,
    RewardHackingMonitor,
    StaleRolloutMonitor,
    StragglerConfig,
    StragglerMonitor,
    build_monitors,
    replay,
)

TRACES = TESTS / "data" / "traces"

AT = 100
SEEDS = range(10)
# fault -> the most steps after the fault's first step the first finding may come (measured: see
# bench/README.md)
DETECTION_BOUND = {
    "nan": 0,
    "none_nan": 0,
    "loss_spike": 0,
    "grad_explosion": 0,
    "straggler_busy": 3,  # window 5: the median of the last 5 ratios crosses once 3 are slow
    "straggler_wait": 3,
    "straggler_data": 3,
    # exp decay with tau 10 steps: the forecast warns first, before the 30 % crossing (+12); it
    # waits for the decline to go on under the gate (dips that stop are tolerated)
    "entropy_collapse": 10,
    "kl_drift": 12,
    "reward_hacking": 15,
    "length_hacking": 15,
    "mode_collapse": 9,  # window 10: every value of the window must be >= 0.9
    "stale_rollout": 0,
}


def _only(findings: list[Finding], monitor: str) -> list[Finding]:
    return [f for f in findings if f.monitor == monitor]


@pytest.mark.parametrize("fault", list(DETECTION_BOUND))
def test_fault_detected_within_bound(fault):
    monitor = synth.FAULT_MONITOR[fault]
    for seed in SEEDS:
        findings = replay(synth.generate(fault, seed=seed, at=AT), build_monitors())
        mine = _only(findings, monitor)
        assert mine, f"{fault} seed {seed}: no {monitor} finding"
        assert all(f.step >= AT for f in mine), (
            f"{fault} seed {seed}: fired before the fault: {mine[0]}"
        )
        delay = mine[0].step - AT
        assert delay <= DETECTION_BOUND[fault], (
            f"{fault} seed {seed}: detected {delay} steps late: {mine[0]}"
        )
        others = [f for f in findings if f.monitor != monitor]
        assert not others, f"{fault} seed {seed}: other monitors fired: {others}"


@pytest.mark.parametrize("kind", ["pretrain", "pretrain_keys", "grpo"])
def test_healthy_synthetic_traces_are_silent(kind):
    for seed in range(20):
        if kind == "pretrain":
            recs = synth.pretrain(seed=seed)
        elif kind == "pretrain_keys":
            recs = synth.pretrain(seed=seed, with_busy=True, with_data=True)
        else:
            recs = synth.grpo(seed=seed)
        assert replay(recs, build_monitors()) == [], f"{kind} seed {seed}"


def test_straggler_names_the_slow_rank_not_the_waiting_one():
    for fault in ("straggler_busy", "straggler_wait", "straggler_data"):
        f = _only(replay(synth.generate(fault, seed=1), build_monitors()), "straggler")
        assert {x.rank for x in f} == {1}, (fault, f)
        assert f[0].value >= 1.2


# ---------------------------------------------------------------- NaN details


def _rec(step, rank=0, **kw):
    return {"step": step, "rank": rank, "attempt": 1, **kw}


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "NaN", float("nan"), float("inf")])
def test_nan_encodings(bad):
    recs = [_rec(1, loss=2.0, grad_norm=1.0), _rec(2, loss=bad, grad_norm=1.0)]
    f = replay(recs, [NaNMonitor()])
    assert len(f) == 1 and f[0].monitor == "nan" and f[0].step == 2 and f[0].severity == "critical"
    json.dumps(f[0].to_dict(), allow_nan=False)  # JSON-safe value


def test_none_counts_only_after_numeric():
    never = [_rec(s, loss=2.0, grad_norm=None) for s in range(1, 6)]
    assert replay(never, [NaNMonitor()]) == []
    after = [_rec(1, loss=2.0, grad_norm=1.0), _rec(2, loss=2.0, grad_norm=None)]
    f = replay(after, [NaNMonitor()])
    assert [(x.step, x.value) for x in f] == [(2, None)]
    assert replay(after, [NaNMonitor(NanConfig(none_after_numeric=False))]) == []


def test_nan_once_per_episode_and_across_ranks():
    recs = []
    for s in range(1, 11):
        v = "nan" if s in (3, 4, 5, 8) else 1.0
        recs += [_rec(s, 0, loss=v), _rec(s, 1, loss=v)]
    f = replay(recs, [NaNMonitor()])
    assert [(x.step, x.rank) for x in f] == [(3, 0), (8, 0)]


def test_rewind_rearms_and_restarts_history():
    """A restart redoes steps 10..20: the NaN at 15 is found again in attempt 2."""
    recs = [_rec(s, loss=("nan" if s == 15 else 1.0)) for s in range(1, 21)]
    recs += [{**_rec(s, loss=("nan" if s == 15 else 1.0)), "attempt": 2} for s in range(10, 21)]
    f = replay(recs, [NaNMonitor()])
    assert [(x.step, x.attempt) for x in f] == [(15, 1), (15, 2)]


def test_loss_spike_history_rewinds():
    m = LossSpikeMonitor()
    for s in range(1, 41):
        assert m.feed(_rec(s, loss=2.0 + 0.01 * (s % 3))) == []
    assert m.feed(_rec(41, loss=5.0))  # spike
    # the run rolls back to 35 and redoes it healthily: no finding, and 41 again spikes -> found
    # again
    for s in range(35, 41):
        assert m.feed(_rec(s, loss=2.0 + 0.01 * (s % 3))) == []
    assert m.feed(_rec(41, loss=5.0))


def test_grad_explosion_abs_cap_applies_during_warmup():
    f = replay([_rec(1, grad_norm=1.0), _rec(2, grad_norm=2e4)], [GradExplosionMonitor()])
    assert [x.step for x in f] == [2]


def test_rl_monitors_silent_without_their_keys():
    recs = synth.pretrain(seed=0)
    for m in (
        EntropyCollapseMonitor(),
        KLDriftMonitor(),
        RewardHackingMonitor(),
        ModeCollapseMonitor(),
        StaleRolloutMonitor(),
    ):
        assert replay(recs, [m]) == []


def test_loss_spike_stands_down_on_rl_records():
    recs = [_rec(s, loss=0.001, reward=0.1) for s in range(1, 30)] + [
        _rec(30, loss=5.0, reward=0.1)
    ]
    assert replay(recs, [LossSpikeMonitor()]) == []


def test_reward_hacking_verifier_key_configurable():
    recs = synth.generate("reward_hacking", seed=3)
    renamed = [
        {("rewards_correct_mean" if k == "rewards_verifier_mean" else k): v for k, v in r.items()}
        for r in recs
    ]
    assert (
        _only(replay(renamed, build_monitors()), "reward_hacking") == []
    )  # default key absent: rule off
    sec = MonitorsSection.model_validate(
        {"reward_hacking": {"verifier_key": "rewards/correct/mean"}}
    )
    assert _only(replay(renamed, build_monitors(sec)), "reward_hacking")


# ---------------------------------------------------------------- straggler on recorded DDP timings


def _trace(name):
    return [json.loads(line) for line in (TRACES / name).read_text().splitlines()]


def test_straggler_sleeping_rank_from_step_s_alone():
    """Recorded 2-rank gloo DDP, rank 1 sleeps 0.3 s before each step from step 6: the *other*
    rank's step_s grows."""
    recs = _trace("ddp_sleep_rank1.jsonl")
    r0 = [r["step_s"] for r in recs if r["rank"] == 0 and r["step"] >= 6]
    r1 = [r["step_s"] for r in recs if r["rank"] == 1 and r["step"] >= 6]
    assert (
        min(r0) > 0.25 and max(r1) < 0.1
    )  # the measured fact the monitor's default mode relies on
    f = replay(recs, [StragglerMonitor()])
    assert [(x.rank, x.step) for x in f] == [(1, 8)]
    # read as busy time, step_s accuses the waiting rank: the documented reason for the default
    wrong = replay(recs, [StragglerMonitor(StragglerConfig(step_s_mode="busy"))])
    assert {x.rank for x in wrong} == {0}


def test_straggler_slow_compute_needs_compute_s():
    recs = _trace("ddp_slowcompute_rank1.jsonl")
    f = replay(recs, [StragglerMonitor()])
    assert [(x.rank, x.step) for x in f] == [(1, 8)] and "compute_s" in f[0].detail
    stripped = [{k: v for k, v in r.items() if k != "compute_s"} for r in recs]
    assert (
        replay(stripped, [StragglerMonitor()]) == []
    )  # documented miss: equal step_s on both ranks


def test_straggler_step_s_minus_wait_s():
    recs = []
    for s in range(1, 21):
        for r in (0, 1):
            busy = 0.6 if (r == 1 and s >= 10) else 0.4
            recs.append(_rec(s, r, step_s=0.61, wait_s=round(0.61 - busy, 3)))
    f = replay(recs, [StragglerMonitor()])
    assert [(x.rank, x.step) for x in f] == [(1, 12)]


def test_straggler_restart_starts_over():
    recs = synth.pretrain(steps=60, seed=2, inject="straggler_busy", at=20, with_busy=True)
    again = [
        {**r, "attempt": 2}
        for r in synth.pretrain(steps=60, seed=3, inject="straggler_busy", at=20, with_busy=True)
        if r["step"] >= 10
    ]
    f = replay(recs + again, [StragglerMonitor()])
    assert [(x.rank, x.step, x.attempt) for x in f] == [(1, 22, 1), (1, 22, 2)]


# ---------------------------------------------------------------- contract


def test_replay_is_deterministic_and_equals_live_feeding():
    recs = synth.generate("straggler_wait", seed=4) + []
    a = replay(recs, build_monitors())
    b = replay(recs, build_monitors())
    assert a == b and a
    mons = build_monitors()
    live = [f for r in recs for m in mons for f in m.feed(r)]
    assert (
        live == [f for f in a if f in live] and len(live) >= len(a) - 1
    )  # only the final flush may differ
    for m in mons:
        m.reset()
    assert replay(recs, mons) == a


def test_monitors_survive_odd_records():
    # garbage yields nothing: no step (missing, None, text, inf), values that are no numbers (text,
    # bool, list, None), negative step or step time, a rank that is no number; "kl": "inf" alone is
    # no drift
    garbage = [
        {},
        {"step": "x"},
        {"step": 1},
        {"step": 2, "rank": None, "loss": "oops", "grad_norm": [1]},
        {"step": 3, "rank": 0, "loss": True, "entropy": None, "kl": "inf", "step_s": "nan"},
        {"step": None, "rank": 0, "loss": "nan"},
        {"rank": 0, "loss": float("nan")},
        {"step": 1e400, "rank": 1e400, "loss": 1.0},
        {"step": -5, "rank": 0, "loss": 1.0, "step_s": -3},
        {"step": 4, "rank": "a", "loss": 2.0, "grad_norm": -1, "step_s": "x"},
    ]
    assert replay(garbage, build_monitors()) == []
    for rec in garbage:  # one at a time too: no monitor state hides a finding
        assert replay([rec], build_monitors()) == [], rec
    # a non-finite loss or grad norm is reported whatever else is odd about its record (a NaN is
    # never hidden): exactly one finding each (a healthy record between them ends each NaN episode),
    # from the nan monitor, with the step and rank the record names
    ok = {"step": 8, "rank": 0, "loss": 1.0, "grad_norm": 0.5}
    bad = [
        {"step": -1, "rank": 0, "loss": "nan"},
        ok,
        {"step": "7", "rank": "1", "loss": 1.0, "grad_norm": "inf"},
        ok,
        {"step": 9, "rank": None, "loss": "-Infinity", "entropy": "oops"},
    ]
    found = replay(bad, build_monitors())
    assert [(f.monitor, f.step, f.rank, f.detail) for f in found] == [
        ("nan", -1, 0, "loss is nan at step -1"),
        ("nan", 7, 1, "grad_norm is inf at step 7"),
        ("nan", 9, 0, "loss is -inf at step 9"),
    ]


def test_finding_events():
    s = Finding("straggler", 7, 1.5, "slow", rank=1)
    assert (
        s.to_event()["kind"] == "straggler"
        and s.to_event()["ratio"] == 1.5
        and s.family == "straggler"
    )
    n = Finding("nan", 3, float("nan"), "loss is nan", "critical", rank=0)
    e = n.to_event()
    assert (
        e["kind"] == "anomaly"
        and e["monitor"] == "nan"
        and e["value"] == "nan"
        and n.family == "numeric"
    )


def test_config_defaults_policy_and_strictness():
    sec = MonitorsSection()
    assert sec.action_for("nan") == "rollback" and sec.action_for("straggler") == "alert"
    assert sec.action_for("hang") == "alert"
    assert (
        sec.rollback.max_rollbacks == 3
        and sec.rollback.lr_scale == 1.0
        and sec.rollback.skip_batches == 1
    )
    toml = tomllib.loads(
        '[straggler]\naction = "exclude_node"\nmargin = 0.3\n[rollback]\nlr_scale = 0.5\n'
    )
    sec = MonitorsSection.model_validate(toml)
    assert sec.action_for("straggler") == "exclude_node" and sec.straggler.margin == 0.3
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        MonitorsSection.model_validate({"nan": {"action": "exclude_node"}})  # straggler only
    with pytest.raises(ValidationError):
        MonitorsSection.model_validate({"loss_spike": {"z_treshold": 3}})  # typo: extra key
    assert (
        len(build_monitors(MonitorsSection.model_validate({"kl_drift": {"enabled": False}})))
        == len(build_monitors()) - 1
    )
    assert build_monitors(MonitorsSection(enabled=False)) == []
    # every threshold is documented
    for name in MonitorsSection.model_fields:
        sub = type(getattr(MonitorsSection(), name, None))
        if hasattr(sub, "model_fields"):
            for fname, f in sub.model_fields.items():
                assert f.description or fname in ("enabled", "action"), (
                    f"{name}.{fname} has no description"
                )


PKG = REPO
MONITOR_FILES = sorted(
    str(p.relative_to(PKG / "monitors")) for p in (PKG / "monitors").rglob("*.py")
)
ALLOWED_IMPORTS = {
    "__future__",
    "math",
    "statistics",
    "dataclasses",
    "typing",
    "collections",
    "pydantic",
    "bisect",
    "copy",
    "operator",
    "heapq",
}  # bisect: sorted windows; copy: a shared state's checkpoint; operator:
# itemgetter; heapq: the hang check's deadline heaps (pure, stdlib)
CKPT_FILES = sorted(str(p.relative_to(PKG)) for p in (PKG / "ckpt").rglob("*.py"))
CKPT_THIRD_PARTY = {"torch", "numpy"}


def _imports(path: Path):
    """(top-level module, absolute dotted name, line) of every absolute import; relative ones are
    the package's own."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield (node.module or "").split(".")[0], node.module or "", node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("open", "__import__")
        ):
            yield f"<{node.func.id}()>", node.func.id, node.lineno


def test_purity_lists_cover_the_packages():
    assert {"hang.py", "base.py", "numeric.py", "straggler.py", "__init__.py"} <= set(MONITOR_FILES)
    assert {"rl/__init__.py", "rl/common.py", "rl/trend.py", "rl/reward_hacking.py"} <= set(
        MONITOR_FILES
    )
    assert {"ckpt/__init__.py", "ckpt/manifest.py", "ckpt/verify.py"} <= set(CKPT_FILES)


@pytest.mark.parametrize("name", MONITOR_FILES)
def test_monitors_are_pure(name):
    """No ptops (except relative), torch, I/O or clock imports in ptops.monitors (hang detection
    included)."""
    for top, full, line in _imports(PKG / "monitors" / name):
        assert top in ALLOWED_IMPORTS, f"monitors/{name}:{line} imports {full}"


@pytest.mark.parametrize("name", CKPT_FILES)
def test_ckpt_imports_nothing_else_of_ptops(name):
    """ckpt/ is the checkpoint format's one owner and is used by the supervisor, the engines and the
    CLI: it imports the standard library, torch, numpy and its own modules, nothing else of
    ptops."""
    for top, full, line in _imports(PKG / name):
        if top == "<open()>":
            continue  # ckpt reads and writes files: that is its job
        own = full == "ptops.ckpt" or full.startswith("ptops.ckpt.")
        assert own or top in sys.stdlib_module_names or top in CKPT_THIRD_PARTY, (
            f"{name}:{line} imports {full}"
        )


def test_nan_value_is_nan():
    f = replay([_rec(1, loss=1.0), _rec(2, loss="nan")], [NaNMonitor()])
    assert math.isnan(f[0].value)


def test_train_inference_gap_opens_past_its_bound_and_clears_after_quiet_steps():
    """TRL's per-token gap on the rollouts (sanitised key), read first; ptops' probe gap when TRL
    logs none. One episode: open when the gap passes max_gap (0.05), all clear after 10 steps
    within it; a run at a precision gap of 1e-6 stays silent."""
    from ptops.monitors import TrainInferenceGapMonitor

    trl_key = "sampling_sampling_logp_difference_mean"
    gaps = [0.001] * 5 + [0.2] * 5 + [0.001] * 12
    recs = [_rec(s, rank=r, **{trl_key: g}) for s, g in enumerate(gaps, 1) for r in (0, 1)]
    found = _only(replay(recs, [TrainInferenceGapMonitor()]), "train_inference_gap")
    assert [(f.step, f.severity) for f in found] == [(6, "warning"), (20, "info")], found
    assert "sampling/sampling_logp_difference/mean 0.2 > 0.05" in found[0].detail
    probe = [_rec(s, **{"engine/lp_gap": 4e-7}) for s in range(1, 30)]
    assert replay(probe, [TrainInferenceGapMonitor()]) == []
    bf16 = [_rec(s, **{"engine/lp_gap": 0.09}) for s in range(1, 4)]
    (opened,) = replay(bf16, [TrainInferenceGapMonitor()])
    assert opened.step == 1 and "engine/lp_gap" in opened.detail
