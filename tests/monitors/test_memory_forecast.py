"""Memory seen coming (issue 26, item 4): each rank reports its memory every step, the pure
``memory`` monitor forecasts the step a rank's trend reaches its limit, and ``leak:rank=R,mb=M``
makes one rank leak for real.

One real launch (titan-tiny, 2 ranks, a module fixture): rank 1 leaks 40 MB a step under an
artificial host limit (``monitors.memory.limit_mb``) set above the healthy reference run's peak,
then dies of an OOM; the warning must name rank 1 and a forecast step before its RSS crosses the
limit, and ``ptops diagnose`` shows the OOM with the rank's memory curve. The healthy
reference run (shared with the other tests through ``tests/faulted.py``) replays through the same
monitor and limit without a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_ptops

from ptops.faultinject.inject import Injector
from ptops.faultinject.spec import FaultSpecError, parse
from ptops.monitors import MemoryConfig, MemoryMonitor, MonitorsSection, build_monitors, replay
from ptops.ops.rank import memory

LEAK_MB = 40
STEPS = 20
OOM_STEP = 19  # the leaking rank's OOM, well after it crossed the limit (so the warning came first)
HEADROOM_STEPS = 12  # the limit sits this many leaked steps above the healthy peak


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _recs(
    rank: int, rss: list[float], limit: float = 1000.0, attempt: int = 1, start: int = 1
) -> list[dict]:
    return [
        {
            "step": start + i,
            "rank": rank,
            "attempt": attempt,
            "mem_rss_mb": v,
            "mem_limit_mb": limit,
        }
        for i, v in enumerate(rss)
    ]


# ---------------------------------------------------------------- the pure monitor


def test_a_linear_leak_is_forecast_once_with_the_step_it_reaches_the_limit():
    # 100 MB + 10 MB per step: reaches 1000 MB at step 90; horizon 50 -> first warned at step 40
    recs = _recs(1, [100.0 + 10 * s for s in range(1, 80)])
    found = replay(recs, [MemoryMonitor()])
    assert len(found) == 1, found
    f = found[0]
    assert (f.monitor, f.rank, f.phase, f.severity) == ("memory", 1, "open", "warning")
    assert f.value == 90.0 and f.step == 40 and "rank 1" in f.detail and "step 90" in f.detail
    # the evidence: the record at the warning step was still below the limit
    assert 100 + 10 * f.step < 1000


def test_flat_noisy_memory_is_not_a_trend_and_a_stopped_leak_resolves():
    flat = _recs(0, [500.0 + (3 if s % 2 else -3) for s in range(60)])
    assert replay(flat, [MemoryMonitor()]) == []
    rise = [500.0 + 20 * s for s in range(12)]
    stop = [rise[-1]] * 20
    found = replay(_recs(0, rise + stop), [MemoryMonitor()])
    assert [f.phase for f in found] == ["open", "resolved"] and found[1].severity == "info"
    assert found[0].episode == found[1].episode == 1


def test_a_jump_is_not_a_trend_but_steady_growth_after_it_is():
    # the first checkpoint's buffers: +36 MB at one step, flat around it (seen on titan-tiny rank 0)
    jump = [540.0] * 5 + [577.0] * 10
    assert replay(_recs(0, jump, limit=1000.0), [MemoryMonitor()]) == []
    leak = jump + [577.0 + 20 * s for s in range(1, 12)]
    found = replay(_recs(0, leak, limit=1000.0), [MemoryMonitor()])
    assert [f.phase for f in found] == ["open"] and found[0].step > 15


def test_the_limit_override_and_a_rewind():
    recs = _recs(0, [100.0 + 5 * s for s in range(1, 30)], limit=100_000.0)
    assert replay(recs, [MemoryMonitor()]) == []  # 100 GB away: nothing soon
    found = replay(recs, [MemoryMonitor(MemoryConfig(limit_mb=300))])
    assert (
        len(found) == 1 and found[0].value == 40.0 and "monitors.memory.limit_mb" in found[0].detail
    )
    # a resume rewinds: the redone steps are judged afresh (a new episode may open)
    m = MemoryMonitor(MemoryConfig(limit_mb=300))
    again = replay(recs + _recs(0, [100.0 + 5 * s for s in range(1, 30)], attempt=2), [m])
    assert [f.phase for f in again] == ["open", "open"] and again[1].attempt == 2


def test_the_monitor_is_registered_and_configurable():
    names = [m.name for m in build_monitors(MonitorsSection())]
    assert "memory" in names
    section = MonitorsSection.model_validate({"memory": {"limit_mb": 123, "horizon_steps": 7}})
    mon = next(m for m in build_monitors(section) if m.name == "memory")
    assert mon.cfg.limit_mb == 123 and mon.cfg.horizon_steps == 7


# ---------------------------------------------------------------- the rank side, real


def test_the_probe_stamps_memory_on_every_record(tmp_path):
    from ptops.ops.rank.probe import Probe

    probe = Probe(run_dir=tmp_path, rank=0, attempt=1)
    rec = probe.step(1, {"loss": 1.0})
    assert rec["mem_rss_mb"] > 1 and rec["mem_limit_mb"] >= rec["mem_rss_mb"]
    assert memory.limit_mb() == rec["mem_limit_mb"]
    assert "cuda_reserved_mb" not in rec  # no CUDA initialised in this process


def test_leak_spec_defaults_and_errors():
    f = parse("leak:rank=1,mb=40")
    assert (f.kind, f.rank, f.step, f.params) == ("leak", 1, 1, {"mb": 40.0})
    assert parse("leak").params == {"mb": 64.0}
    with pytest.raises(FaultSpecError, match="key 'mb'"):
        parse("leak:mb=0")
    with pytest.raises(FaultSpecError, match="key 'mb'"):
        parse("leak:mb=lots")


def test_the_leak_fault_keeps_resident_memory_every_step():
    fired = []
    inj = Injector([parse("leak:mb=16,step=2")], 0, 1, lambda f, s: fired.append((f.kind, s)))
    inj.before_step(1)
    before = memory.rss_mb()
    for step in (2, 3, 4):
        inj.before_step(step)
    grown = memory.rss_mb() - before
    assert fired == [("leak", 2)] and len(inj._leaked) == 3
    assert 44 <= grown <= 80, grown  # 3 x 16 MB resident (pages written), plus noise


# ---------------------------------------------------------------- one real leaking run


@pytest.fixture(scope="module")
def leak(faulted_runs, tmp_path_factory):
    ref = faulted_runs.get("reference")
    peak = max(r["mem_rss_mb"] for r in _read(ref.run / "metrics.jsonl") if r.get("mem_rss_mb"))
    limit = round(peak + LEAK_MB * HEADROOM_STEPS)
    run = tmp_path_factory.mktemp("leak") / "run"
    proc = run_ptops(
        "launch",
        "titan-tiny",
        "--run-dir",
        str(run),
        "--set",
        f"train.steps={STEPS}",
        "--set",
        f"monitors.memory.limit_mb={limit}",
        "--no-mlflow",
        "--fault",
        f"leak:rank=1,mb={LEAK_MB}",
        "--fault",
        f"oom:rank=1,step={OOM_STEP}",
        "--json",
        timeout=900,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the OOM at the end: a plain launch fails
    return run, limit, ref


def test_the_leaking_rank_is_warned_before_it_crosses_the_limit(leak):
    run, limit, _ = leak
    warns = [
        e
        for e in _read(run / "events.jsonl")
        if e["kind"] == "anomaly" and e.get("monitor") == "memory"
    ]
    assert [(e["rank"], e["phase"]) for e in warns] == [(1, "open")], warns
    w = warns[0]
    rss = {r["step"]: r["mem_rss_mb"] for r in _read(run / "metrics.jsonl") if r["rank"] == 1}
    crossed = min((s for s, v in rss.items() if v >= limit), default=None)
    assert rss[w["step"]] < limit, (w, rss)  # warned while still under the limit
    assert w["value"] > w["step"] and f"step {int(w['value'])}" in w["detail"]
    assert crossed is not None and w["step"] < crossed, (w, crossed, rss)
    assert abs(w["value"] - crossed) <= 2, (w["value"], crossed)  # the forecast is the crossing
    assert [e for e in _read(run / "events.jsonl") if e["kind"] == "fault_injected"][0]["rank"] == 1


def test_a_healthy_run_gets_no_memory_warning_under_the_same_limit(leak):
    _, limit, ref = leak
    recs = _read(ref.run / "metrics.jsonl")
    assert all(r.get("mem_rss_mb") for r in recs)
    assert replay(recs, [MemoryMonitor(MemoryConfig(limit_mb=limit))]) == []
    assert replay(recs, [MemoryMonitor()]) == []  # and under the limit the ranks reported
    live = [e for e in _read(ref.run / "events.jsonl") if e.get("monitor") == "memory"]
    assert live == []


def test_diagnose_shows_the_memory_curve_of_an_oom(leak, ptops):
    run, limit, _ = leak
    diag = ptops("diagnose", str(run), "--json")
    assert diag.returncode == 0, diag.stderr
    crash = [i for i in json.loads(diag.stdout)["incidents"] if i["kind"] == "crash"]
    assert len(crash) == 1 and crash[0]["rank"] == 1, crash
    curve = crash[0]["details"]["memory_curve"]
    steps = [r["step"] for r in curve]
    assert steps == sorted(steps) and steps[-1] == OOM_STEP - 1 and len(curve) == 12
    assert curve[-1]["mem_rss_mb"] > limit > curve[0]["mem_rss_mb"]  # the climb up to the crash
    assert any(line.startswith("memory of rank 1") for line in crash[0]["evidence"])
    # beside what `ptops plan` estimated for the recipe on its 2 ranks (a GPU's memory: the line
    # says this run measured the host's)
    plan = crash[0]["details"]["plan"]
    assert (plan["recipe"], plan["world"], plan["measured"]) == ("titan-tiny", 2, "host RSS")
    assert plan["memory_gib"]["total_gib"] > 0 and plan["measured_gib"] > limit / 1024 * 0.99
    # the ratio of the unrounded figures: within the rounding of the two shown
    shown = plan["measured_gib"] / plan["memory_gib"]["total_gib"]
    assert plan["ratio"] == pytest.approx(shown, abs=1e-3)
    human = ptops("diagnose", str(run))
    assert f"step {OOM_STEP - 1}: RSS" in human.stdout, human.stdout[-3000:]
    assert "ptops plan for titan-tiny on 2 x h100" in human.stdout, human.stdout[-3000:]


def test_memory_curve_is_only_for_memory_crashes():
    from ptops.diagnostics.memcurve import about_memory, curve_lines, memory_curve

    recs = _recs(0, [100.0, 110.0, 120.0]) + _recs(1, [5.0])
    assert [r["step"] for r in memory_curve(recs, 1, 0, n=2)] == [2, 3]
    assert curve_lines(memory_curve(recs, 1, 1)) == ["step 1: RSS 5 MB of 1000 MB"]
    assert about_memory({"words": "SIGKILL", "cause": "probably the OOM killer"})
    assert about_memory({"exception": {"type": "torch.OutOfMemoryError", "message": "x"}})
    assert not about_memory({"words": "exit code 1", "exception": {"type": "ValueError"}})


def test_the_running_fit_equals_the_direct_least_squares():
    import random

    from ptops.monitors.memory import _Series, fit

    rng = random.Random(7)
    s, pts = _Series(10), []
    for step in range(100_000, 100_040):
        v = rng.uniform(0, 80_000)
        s.add(step, v)
        pts.append((step, v))
        if len(pts) >= 2:
            (a, b), (c, d) = s.fit(), fit(pts[-10:])
            assert abs(a - c) < 1e-6 * max(1, abs(c)) and abs(b - d) < 1e-6 * max(1, abs(d))
