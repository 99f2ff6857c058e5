"""The ``hold`` fault (a declared pause before a step) and ``release``: spec, injector, hang
monitor.

Live tests hold a run until what they wait for has been observed, then release it; these pin
the three pieces that makes work without a run: the grammar, the rank side (stops before the
step, waits for release or its bound, reports both) and the hang monitor (a held rank that keeps
pinging is no hang, nor are its peers; budgets restart at the release).
"""

from __future__ import annotations

import threading
import time

import pytest

from ptops.faultinject import inject
from ptops.faultinject.inject import Injector
from ptops.faultinject.spec import (
    HOLD_DEFAULT_S,
    FaultSpecError,
    format_spec,
    from_env,
    parse,
    parse_all,
    to_env,
)
from ptops.monitors.hang import HangConfig, HangMonitor

# ---------------------------------------------------------------- spec


def test_hold_spec():
    f = parse("hold:step=10,attempt=2")
    assert (f.kind, f.step, f.rank, f.attempt, f.params) == ("hold", 10, None, 2, {})
    assert f.applies(0, 2) and f.applies(1, 2) and not f.applies(0, 1)
    f = parse("hold:step=3,rank=1,seconds=2.5")
    assert (f.rank, f.params) == (1, {"seconds": 2.5})
    assert parse(format_spec(f)).params == f.params and from_env(to_env([f])) == [f]
    assert (
        HOLD_DEFAULT_S >= 300
    )  # a forgotten hold ends by itself, but not before a slow test observed it


def test_release_spec_has_no_step():
    f = parse("release")
    assert (f.kind, f.step, f.rank) == ("release", 0, None)
    assert (
        format_spec(f) == "release"
        and format_spec(parse("release:attempt=2")) == "release:attempt=2"
    )
    assert parse("release:rank=1").rank == 1


@pytest.mark.parametrize(
    "spec, words",
    [
        ("hold", ["'step'", "missing"]),
        ("hold:step=0", ["'step'", ">= 1"]),
        ("hold:step=4,seconds=-1", ["'seconds'", ">= 0"]),
        ("hold:step=4,mode=stop", ["'mode'", "unknown key for hold"]),
        ("release:step=3", ["'step'", "unknown key for release"]),
    ],
)
def test_hold_and_release_errors(spec, words):
    with pytest.raises(FaultSpecError) as e:
        parse(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_release_is_not_a_launch_fault():
    with pytest.raises(FaultSpecError, match="live run only"):
        parse_all(["hold:step=3", "release"])
    assert [f.kind for f in parse_all(["hold:step=3"])] == ["hold"]


# ---------------------------------------------------------------- injector


class Rank:
    """An injector with recorders for what the probe would send."""

    def __init__(self, specs, rank=0, attempt=1):
        self.log: list[tuple] = []
        self.inj = Injector(
            [parse(s) for s in specs], rank, attempt,
            emit=lambda f, step: self.log.append(("fault_injected", f.kind, step)),
            on_hold=lambda step: self.log.append(("hold", step)),
            on_release=lambda step, held_s, by: self.log.append(("released", step, by, held_s)),
        )  # fmt: skip

    def step_in_thread(self, step: int) -> threading.Thread:
        t = threading.Thread(target=self.inj.before_step, args=(step,), daemon=True)
        t.start()
        return t

    def wait_held(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e[0] == "hold" for e in self.log):
            assert time.monotonic() < deadline, self.log
            time.sleep(0.01)


def test_hold_waits_before_its_step_until_release():
    r = Rank(["hold:step=3"])
    for s in (1, 2):
        r.inj.before_step(s)
    assert r.log == []
    t = r.step_in_thread(3)
    r.wait_held()
    t.join(0.3)
    assert t.is_alive(), "the hold did not hold"
    assert r.log == [("fault_injected", "hold", 3), ("hold", 3)]
    assert r.inj.add(parse("release"))  # what `ptops inject RUN_DIR release` hands each rank
    t.join(5)
    assert not t.is_alive()
    assert r.log[2][:3] == ("released", 3, "release")
    r.inj.before_step(4)  # fires once
    assert len(r.log) == 3


def test_hold_ends_by_itself_after_seconds():
    r = Rank(["hold:step=2,seconds=0.2"])
    t0 = time.monotonic()
    r.inj.before_step(2)
    assert time.monotonic() - t0 >= 0.2
    assert [e[:3] for e in r.log] == [
        ("fault_injected", "hold", 2),
        ("hold", 2),
        ("released", 2, "timeout"),
    ]
    assert r.log[-1][3] >= 0.2


def test_release_before_the_hold_step_cancels_it():
    r = Rank(["hold:step=5,seconds=30"])
    r.inj.before_step(1)
    r.inj.add(parse("release"))
    t0 = time.monotonic()
    r.inj.before_step(5)
    assert time.monotonic() - t0 < 1 and r.log == []


def test_hold_applies_per_rank_and_attempt():
    assert Rank(["hold:step=2,attempt=2"], attempt=1).inj.pending == []
    assert [f.kind for f in Rank(["hold:step=2,attempt=2"], attempt=2).inj.pending] == ["hold"]
    assert Rank(["hold:step=2,rank=1"], rank=0).inj.pending == []
    assert not Rank([], rank=0).inj.add(parse("release:rank=1"))  # a release for another rank


def test_a_hold_injected_after_a_release_holds_again():
    r = Rank([])
    r.inj.add(parse("release"))
    r.inj.add(parse("hold:step=2,seconds=30"))
    t = r.step_in_thread(7)  # a live fault whose step has passed fires at the next step
    r.wait_held()
    t.join(0.2)
    assert t.is_alive()
    r.inj.add(parse("release"))
    t.join(5)
    assert not t.is_alive() and r.log[-1][:3] == ("released", 7, "release")


def test_until_committed_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    """``hold:until=committed`` ends once the last save this rank began lost its ``.writing``
    marker."""
    ckpt = tmp_path / "checkpoints" / "step-4"
    ckpt.mkdir(parents=True)
    (ckpt / ".writing").touch()  # the async save of step 4 is in flight
    log: list[tuple] = []
    inj = Injector(
        [parse("crash:step=6,code=3"), parse("hold:step=6,until=committed,seconds=30")],
        0,
        1,
        emit=lambda f, step: log.append(("fault_injected", f.kind, step)),
        run_dir=tmp_path,
        on_hold=lambda step: log.append(("hold", step)),
        on_release=lambda step, held_s, by: log.append(("released", step, by)),
    )
    inj.on_checkpoint(4)
    inj.after_checkpoint(4)

    def exit_(code):  # the crash's os._exit, recorded; SystemExit ends only this thread
        log.append(("crash", code))
        raise SystemExit(code)

    monkeypatch.setattr(inject.os, "_exit", exit_)

    def step6():
        try:
            inj.before_step(6)
        except SystemExit:
            pass

    t = threading.Thread(target=step6, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and log == [("fault_injected", "hold", 6), ("hold", 6)]
    (ckpt / ".writing").unlink()  # rank 0 committed it
    t.join(5)
    assert not t.is_alive()
    # the hold went first although given second, and the crash came after the commit
    assert log[2:] == [("released", 6, "committed"), ("fault_injected", "crash", 6), ("crash", 3)]


def test_until_committed_without_a_save_does_not_wait(tmp_path):
    r = Rank(["hold:step=2,until=committed,seconds=30"])
    r.inj.run_dir = tmp_path
    t0 = time.monotonic()
    r.inj.before_step(2)
    assert time.monotonic() - t0 < 1 and r.log[-1][:3] == ("released", 2, "committed")


def test_until_errors():
    with pytest.raises(FaultSpecError, match="'until': expected one of release, committed"):
        parse("hold:step=2,until=forever")
    assert parse("hold:step=2,until=committed").params == {"until": "committed"}


def test_chaos_timings_start_at_the_fault_not_at_a_hold():
    from ptops.faultinject.chaos import analyze

    events = [
        {
            "ts": 10.0,
            "kind": "fault_injected",
            "fault": "hold:step=6,until=committed",
            "rank": 0,
            "step": 6,
        },
        {
            "ts": 14.0,
            "kind": "fault_injected",
            "fault": "crash:rank=1,step=6",
            "rank": 1,
            "step": 6,
        },
        {"ts": 15.0, "kind": "crash", "attempt": 1, "rank": 1},
    ]
    a = analyze(events, [], 12, ("crash",))
    assert a["fired"] and a["detected_by"] == "crash" and a["detect_s"] == 1.0
    assert not analyze(events[:1], [], 12, ("crash",))["fired"]  # a hold alone is no fault


# ---------------------------------------------------------------- hang monitor


def _mon(world=2, **cfg):
    return HangMonitor(world, 0.0, HangConfig(floor_s=5.0, ping_stale_s=4.0, **cfg))


def _steps(m: HangMonitor, upto: int, t: float = 0.0, dt: float = 1.0) -> float:
    """Every rank does steps 1..upto, one per ``dt`` s; returns the time of the last."""
    for s in range(1, upto + 1):
        t += dt
        for r in m.ranks:
            m.observe(
                {
                    "kind": "beat",
                    "rank": r,
                    "step": s,
                    "phase": "step",
                    "stage": "begin",
                    "ts": t - dt / 2,
                }
            )
            m.observe({"kind": "metrics", "rank": r, "step": s, "step_s": dt / 2, "ts": t})
    return t


def _ping(m: HangMonitor, t0: float, t1: float, ranks=None, every: float = 2.0) -> None:
    t = t0
    while t <= t1:
        for r in ranks if ranks is not None else list(m.ranks):
            m.observe({"kind": "ping", "rank": r, "ts": t})
        t += every


def test_every_rank_held_and_pinging_is_no_hang():
    m = _mon()
    t = _steps(m, 9)
    for r in (0, 1):
        m.observe({"kind": "beat", "rank": r, "step": 10, "phase": "hold", "ts": t + 0.1})
    _ping(m, t, t + 1000)
    assert (
        m.check(t + 1000) is None
    )  # far past the 5 s step budget, the startup and checkpoint budgets
    assert m.budget(0)[2] == "hold"


def test_a_held_rank_that_stops_pinging_is_a_hang():
    m = _mon()
    t = _steps(m, 9)
    for r in (0, 1):
        m.observe({"kind": "beat", "rank": r, "step": 10, "phase": "hold", "ts": t})
    _ping(m, t, t + 60, ranks=[0])
    _ping(m, t, t + 3, ranks=[1])  # rank 1 goes silent (SIGSTOP, host gone) while held
    f = m.check(t + 60)
    assert (
        f is not None
        and f.ranks == [1]
        and f.why == "unresponsive"
        and f.phase == "unresponsive in hold"
    )
    assert f.timeout_s == 5.0 and f.as_event(2)["timeout_s"] == 5.0


def test_peers_of_a_held_rank_are_not_hung_and_budgets_restart_at_release():
    m = _mon()
    t = _steps(m, 9)
    m.observe({"kind": "beat", "rank": 1, "step": 10, "phase": "hold", "ts": t})  # rank=1 only
    m.observe(
        {"kind": "beat", "rank": 0, "step": 10, "phase": "step", "stage": "begin", "ts": t}
    )  # waits in a collective
    _ping(m, t, t + 100)
    assert m.check(t + 100) is None
    # release at t+100: rank 1 begins step 10; rank 0, blocked since t, gets a fresh step budget
    m.observe(
        {"kind": "beat", "rank": 1, "step": 10, "phase": "step", "stage": "begin", "ts": t + 100}
    )
    _ping(m, t + 100, t + 104)
    assert m.check(t + 104) is None
    # and a real hang after the release is still found, within the step budget
    _ping(m, t + 104, t + 120)
    f = m.check(t + 120)
    assert f is not None and f.phase == "step" and set(f.stalled) == {0, 1}


def test_a_hold_at_the_first_step_of_an_attempt_is_no_startup_hang():
    m = _mon(startup_s=30.0)
    for r in (0, 1):
        m.observe({"kind": "beat", "rank": r, "step": 0, "phase": "startup", "ts": 1.0})
        m.observe({"kind": "beat", "rank": r, "step": 9, "phase": "hold", "ts": 10.0})
    _ping(m, 10.0, 200.0)
    assert m.check(200.0) is None  # past startup_s: the hold, not the start-up, is what they do
    for r in (0, 1):
        m.observe(
            {"kind": "beat", "rank": r, "step": 9, "phase": "step", "stage": "begin", "ts": 200.0}
        )
    _ping(m, 200.0, 229.0)
    assert m.check(229.0) is None  # the start-up budget counts again from the release
    _ping(m, 229.0, 232.0)
    f = m.check(232.0)
    assert f is not None and f.phase == "startup"
