"""Hang budgets learned per section (issue 12): the pure monitor, fed exact timestamps.

What is not a hang (a slow first step, a long checkpoint, a declared eval pause, a 3x straggler,
a peer still importing while another waits in the rendezvous) and what is (a stalled step, a
stalled start-up section, a silent rank), each within the bound the issue states:
max(multiplier x p99 of the section, its floor). Monitors are pure, so the bounds are exact here.
The real runs (shipped defaults, SIGSTOP and a collective-blocked rank) read ``faulted_runs``.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from ptops.monitors.hang import Durations, HangConfig, HangMonitor, Learned

DEFAULTS = HangConfig()


def p99(xs):
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def run_steps(m: HangMonitor, first: int, last: int, t: float, dt, ranks=None) -> float:
    """Every rank (or ``ranks``) does steps first..last; ``dt``: seconds or rank -> seconds."""
    for s in range(first, last + 1):
        for r in ranks if ranks is not None else list(m.ranks):
            d = dt(r) if callable(dt) else dt
            m.observe(
                {"kind": "beat", "rank": r, "step": s, "phase": "step", "stage": "begin", "ts": t}
            )
            m.observe({"kind": "metrics", "rank": r, "step": s, "step_s": d, "ts": t + d})
        t += max(dt(r) for r in m.ranks) if callable(dt) else dt
    return t


def ping(m: HangMonitor, t0: float, t1: float, ranks=None, every: float = 1.0) -> None:
    t = t0
    while t <= t1:
        for r in ranks if ranks is not None else list(m.ranks):
            m.observe({"kind": "ping", "rank": r, "ts": t})
        t += every


def startup(
    m: HangMonitor, t: float, sections=("import", "rendezvous", "build", "load"), dt=1.0, ranks=None
) -> float:
    for sec in sections:
        for r in ranks if ranks is not None else list(m.ranks):
            m.observe(
                {"kind": "beat", "rank": r, "step": 0, "phase": "startup", "section": sec, "ts": t}
            )
        t += dt
    return t


def no_hang_until(m: HangMonitor, t0: float, t1: float, step: float = 0.5) -> None:
    t = t0
    while t <= t1:
        assert m.check(t) is None, (t, m.check(t))
        t += step


# ---------------------------------------------------------------- the estimator


def test_p99_estimate_never_above_the_true_p99_and_close_to_it():
    rng = random.Random(0)
    for n in (1, 3, 50, 1000):
        xs = [rng.lognormvariate(-2, 0.7) for _ in range(n)]
        d = Durations()
        for x in xs:
            d.add(x)
        est, true = d.quantile(0.99), p99(xs)
        assert est <= true and est >= true / 2 ** (1 / 16) - 1e-12, (n, est, true)
    assert Durations().quantile() is None


def test_shipped_step_budget_is_max_of_10x_p99_and_5s():
    for dt, want in ((0.05, 5.0), (0.3, 5.0), (0.9, 9.0), (2.0, 20.0)):
        m = HangMonitor(2, 0.0, DEFAULTS)
        t = run_steps(m, 1, 30, startup(m, 0.0), dt)
        assert m.step_timeout() == pytest.approx(max(10 * dt, 5.0)), dt
        assert m.step_timeout() <= max(10 * dt, 5.0) + 1e-9
        assert m.check(t + want - 0.01) is None
        f = m.check(t + want + 0.01)
        assert f is not None and f.phase == "step" and f.section == "step"


# ---------------------------------------------------------------- not hangs


def test_slow_first_step_is_no_hang_and_does_not_inflate_the_step_budget():
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = startup(m, 0.0)
    for r in (0, 1):
        m.observe(
            {"kind": "beat", "rank": r, "step": 1, "phase": "step", "stage": "begin", "ts": t}
        )
    ping(m, t, t + 250)
    no_hang_until(
        m, t, t + 250, step=5
    )  # a 250 s first step (compilation): first-occurrence budget 300 s
    for r in (0, 1):
        m.observe({"kind": "metrics", "rank": r, "step": 1, "step_s": 250.0, "ts": t + 250})
    t = run_steps(m, 2, 20, t + 250, 0.1)
    assert m.step_timeout() == 5.0  # the first step is its own section
    assert m.learned.p99("first_step") == pytest.approx(250.0, rel=0.05)


def test_long_checkpoint_is_no_hang_and_its_budget_is_learned():
    m = HangMonitor(2, 0.0, DEFAULTS.model_copy(update={"total_steps": 100}))
    t = run_steps(m, 1, 10, startup(m, 0.0), 0.1)
    for r in (0, 1):
        m.observe({"kind": "beat", "rank": r, "step": 10, "phase": "checkpoint", "ts": t})
    ping(m, t, t + 500)
    no_hang_until(m, t, t + 500, step=5)  # a 500 s first save: first-occurrence budget 600 s
    for r in (0, 1):
        m.observe({"kind": "beat", "rank": r, "step": 10, "phase": "step", "ts": t + 500})
    assert m.section_timeout("checkpoint") == pytest.approx(10 * 500, rel=0.05)
    # a short save learns a short budget, with a 60 s floor
    m2 = HangMonitor(1, 0.0, DEFAULTS.model_copy(update={"total_steps": 100}))
    t = run_steps(m2, 1, 10, 0.0, 0.1)
    m2.observe({"kind": "beat", "rank": 0, "step": 10, "phase": "checkpoint", "ts": t})
    m2.observe({"kind": "beat", "rank": 0, "step": 10, "phase": "step", "ts": t + 0.5})
    assert m2.section_timeout("checkpoint") == 60.0


def test_declared_eval_pause_is_no_hang_for_the_pausing_rank_nor_its_waiting_peer():
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = run_steps(m, 1, 10, startup(m, 0.0), 0.1)
    m.observe({"kind": "beat", "rank": 0, "step": 11, "phase": "eval", "ts": t})  # rank 0 evaluates
    m.observe(
        {"kind": "beat", "rank": 1, "step": 11, "phase": "step", "stage": "begin", "ts": t}
    )  # rank 1 waits
    ping(m, t, t + 900)
    no_hang_until(m, t, t + 900, step=5)
    m.observe({"kind": "beat", "rank": 0, "step": 11, "phase": "step", "ts": t + 900})  # pause over
    assert m.learned.p99("eval") == pytest.approx(900, rel=0.05)
    ping(m, t + 900, t + 904)
    assert m.check(t + 904) is None  # budgets restart at the end of the pause
    # an eval pause that never ends is judged by its own budget
    m.observe({"kind": "beat", "rank": 0, "step": 12, "phase": "eval", "ts": t + 905})
    ping(m, t + 905, t + 905 + 9100)
    f = m.check(t + 905 + 9100)
    assert f is not None and f.section == "eval" and f.timeout_s == pytest.approx(9000, rel=0.05)


def test_a_3x_straggler_is_no_hang():
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = run_steps(m, 1, 10, startup(m, 0.0), 0.2)
    t = run_steps(m, 11, 200, t, lambda r: 0.6 if r == 1 else 0.2)
    ping(m, 0, t)
    assert m.check(t) is None and m.step_timeout() >= 5.0


def test_a_peer_still_importing_is_not_a_rendezvous_hang():
    m = HangMonitor(2, 0.0, DEFAULTS)
    startup(m, 1.0, ("import", "rendezvous"), ranks=[0])  # rank 0 reaches the rendezvous at t=2
    startup(m, 1.0, ("import",), ranks=[1])  # rank 1 imports for 100 s (loaded host), pinging
    ping(m, 1, 101)
    no_hang_until(m, 1, 101)
    startup(m, 101.0, ("rendezvous",), ranks=[1])
    ping(m, 101, 101 + 59)
    no_hang_until(m, 101, 101 + 59)  # the rendezvous budget counts from the last arrival
    f = m.check(101 + 60.5)
    assert f is not None and f.section == "rendezvous" and f.phase == "startup"


# ---------------------------------------------------------------- hangs


def test_stalled_step_found_within_10x_p99_or_5s():
    m = HangMonitor(2, 0.0, DEFAULTS)
    rng = random.Random(1)
    times = [0.4 + rng.random() * 0.6 for _ in range(60)]  # p99 near 1 s: budget ~10 s
    t = startup(m, 0.0)
    for i, d in enumerate(times, start=1):
        t = run_steps(m, i, i, t, d)
    bound = max(10 * p99(times[1:]), 5.0)  # step 1 is the first-step section
    # rank 0 stops before step 61; rank 1 began it and blocks in the collective (both keep pinging)
    m.observe(
        {"kind": "beat", "rank": 1, "step": 61, "phase": "step", "stage": "begin", "ts": t + 0.01}
    )
    ping(m, t, t + 30, every=0.5)
    assert m.step_timeout() <= bound
    assert m.check(t + m.step_timeout() - 0.01) is None
    f = m.check(t + bound + 0.01)
    assert f is not None and f.ranks == [0] and f.why == "behind" and f.section == "step"


def test_silent_rank_found_within_5s_of_its_last_message_in_step_and_checkpoint():
    for phase in ("step", "checkpoint"):
        m = HangMonitor(2, 0.0, DEFAULTS)
        t = run_steps(m, 1, 20, startup(m, 0.0), 0.1)
        if phase == "checkpoint":
            for r in (0, 1):
                m.observe({"kind": "beat", "rank": r, "step": 20, "phase": "checkpoint", "ts": t})
        ping(m, t, t + 60, ranks=[0])
        ping(m, t, t + 2, ranks=[1])  # SIGSTOP at t + 2.x: its last ping was at t + 2
        if (
            phase == "checkpoint"
        ):  # the save's own budget is long: only the liveness rule can find it
            assert m.check(t + 2 + 4.99) is None
        f = m.check(t + 2 + 5.01)
        assert (
            f is not None and f.ranks == [1] and f.why == "unresponsive" and f.timeout_s == 5.0
        ), phase


@pytest.mark.parametrize("section", ["import", "rendezvous", "build", "load"])
def test_stalled_startup_section_found_from_what_the_first_attempt_took(section):
    a1 = HangMonitor(2, 0.0, DEFAULTS)
    t = startup(a1, 0.0, dt=1.5)
    run_steps(a1, 1, 3, t, 0.2)
    learned = a1.learned
    assert learned.p99(section) == pytest.approx(1.5, rel=0.05)
    # attempt 2: rank 1 stops in `section` (alive, pinging); rank 0 goes on to the rendezvous and
    # waits
    a2 = HangMonitor(2, 100.0, DEFAULTS, learned=learned)
    order = ["import", "rendezvous", "build", "load"]
    upto = order[: order.index(section) + 1]
    t = startup(a2, 101.0, upto, dt=1.0, ranks=[1])
    startup(
        a2,
        101.0,
        order[: max(2, order.index(section) + 1)]
        if section != "import"
        else ("import", "rendezvous"),
        dt=1.0,
        ranks=[0],
    )
    stuck_at = t - 1.0
    ping(a2, 101, stuck_at + 100)
    budget = max(DEFAULTS.startup_floor_s, 10 * 1.5)  # 20 s, not 600
    f = None
    for k in range(0, 400):
        now = stuck_at + k * 0.1
        f = a2.check(now)
        if f is not None:
            break
    assert f is not None and f.phase == "startup" and 1 in f.ranks
    assert now <= stuck_at + budget + 0.11
    assert f.section == section or (section == "import" and f.section == "import")


def test_startup_without_history_uses_the_bounded_first_budgets():
    c = DEFAULTS
    assert [
        c.first_budget(s) for s in ("launch", "import", "rendezvous", "build", "load", "first_step")
    ] == [120.0, 300.0, 60.0, 300.0, 600.0, 300.0]
    assert HangConfig(startup_s=30).first_budget("load") == 30  # the old key caps them all
    m = HangMonitor(2, 0.0, c)
    startup(m, 1.0, ("import", "rendezvous", "build"))  # both ranks stop in build at t=3
    ping(m, 1, 400)
    assert m.check(3 + 299) is None
    f = m.check(3 + 300.5)
    assert f is not None and f.section == "build"


def test_a_rank_that_never_connects_is_found_at_the_launch_budget():
    m = HangMonitor(2, 0.0, DEFAULTS)
    startup(m, 1.0, ("import",), ranks=[0])
    ping(m, 1, 200, ranks=[0])
    assert m.check(119.9) is None
    f = m.check(120.1)
    assert f is not None and f.ranks == [1] and f.section == "launch"


def test_learned_carries_over_and_is_json_summarised():
    a1 = HangMonitor(1, 0.0, DEFAULTS)
    run_steps(a1, 1, 5, startup(a1, 0.0), 0.25)
    s = a1.learned.summary()
    assert s["step"]["n"] == 4 and s["first_step"]["n"] == 1 and "import" in s
    json.dumps(s)
    a2 = HangMonitor(1, 10.0, DEFAULTS, learned=a1.learned)
    assert a2.prior.p99("import") == a1.learned.p99("import")
    assert isinstance(Learned().copy(), Learned)


def test_a_section_that_ended_in_the_same_read_is_learned_as_short():
    """Arrival stamps are per socket read: under a saturated CPU a quick load (a fresh start has no
    checkpoint) and the first step's beat arrive together, 0 s apart. That is a short section, so
    the next attempt judges its load by the floor, not by the 600 s first-occurrence budget."""
    a1 = HangMonitor(2, 0.0, DEFAULTS)
    t = startup(a1, 0.0, ("import", "rendezvous", "build", "load"), dt=1.0)
    t = run_steps(
        a1, 1, 1, t - 1.0, 0.3
    )  # the first step's beat arrives with the load beat: load 0 s
    assert a1.learned.p99("load") is not None
    a2 = HangMonitor(2, 100.0, DEFAULTS, learned=a1.learned)
    assert a2.section_timeout("load") == DEFAULTS.startup_floor_s
    d = Durations()
    for bad in (-1.0, math.nan, math.inf):
        d.add(bad)
    assert d.quantile() is None


# --------------------------------------------------------------- the probe's eval pause, end to end


def test_probe_eval_pause_reaches_the_monitor_as_a_declared_pause(tmp_path):
    """``with probe.pause("eval", step)`` over a real channel: beats with phase eval, then step."""
    import contextlib

    from ptops.ops.node.agent import relay_in_thread
    from ptops.ops.rank.probe import Probe
    from ptops.ops.supervisor.channel import ChannelServer

    server = ChannelServer()
    stack = contextlib.ExitStack()
    stack.callback(server.close)
    agent = stack.enter_context(relay_in_thread(server.address(), server.token))
    probe = Probe(
        tmp_path, 0, 1, world_size=1, channel=agent.local_address, token=agent.local_token,
        heartbeat_s=30,
    )  # fmt: skip
    stack.callback(probe.close)
    with stack:
        probe.startup("build")
        probe.world(1, 0)
        with probe.pause("eval", 7):
            pass
        got = []
        while len(got) < 5:  # the rank's messages, its agent's batches opened
            peer, msg, ts = server.inbox.get(timeout=10)
            if msg.get("role") != "node":
                got += [m for _, m, _ in msg["items"]] if msg["t"] == "_batch" else [msg]
        kinds = [(m.get("t"), m.get("phase"), m.get("section")) for m in got]
        assert kinds[0][0] == "_hello"
        assert ("beat", "startup", "build") in kinds and ("world", None, None) in kinds
        assert ("beat", "eval", None) in kinds and kinds[-1] == ("beat", "step", None)
        m = HangMonitor(1, 0.0, DEFAULTS)
        t = 1.0
        for msg in got[1:]:
            if msg.get("t") == "beat":
                m.observe(
                    {
                        "kind": "beat",
                        "rank": 0,
                        "ts": t,
                        **{k: msg.get(k) for k in ("step", "phase", "stage", "section")},
                    }
                )
                t += 100.0  # each phase lasts 100 s: the eval pause too, under its own budget
        assert m.learned.p99("eval") == pytest.approx(100.0, rel=0.05)


# ---------------------------------------------------------------- real runs, shipped defaults


def _events(run, kind):
    return [
        e
        for e in (
            json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()
        )
        if e["kind"] == kind
    ]


def _step_p99(run, attempt_max=None):
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return p99(
        [r["step_s"] for r in recs if isinstance(r.get("step_s"), (int, float)) and r["step"] > 1]
    )


def test_real_hangs_found_with_the_shipped_defaults(faulted_runs):
    """The shared ``hang`` run sets no hang key: a rank stopped in Python at a step start (its peer
    blocks in the collective) and a SIGSTOPped rank are each found by budgets within
    max(10 x p99 step, 5 s); digests and orphans of the same run: test_supervisor_real."""
    from ptops.recipes.schema import from_json

    hang = faulted_runs.get("hang")
    run = hang.run
    assert hang.proc.returncode == 0, hang.proc.stderr
    recipe = from_json((run / "recipe.json").read_text())
    assert recipe.supervisor.hang == HangConfig(), "the hang run must use the shipped hang settings"
    bound = max(10 * _step_p99(run), 5.0)
    first, second = _events(run, "hang")
    assert first["why"] == "behind" and first["ranks"] == [0] and first["section"] == "step"
    assert first["timeout_s"] <= bound + 1e-6
    assert second["why"] == "unresponsive" and second["ranks"] == [1]
    assert second["timeout_s"] <= bound + 1e-6
    for ev in (first, second):
        assert ev["found_ts"] <= ev["ts"]  # found, then stacks, then the event


def test_world_of_one_stops_the_run_at_once(tmp_path, ptops):
    """A rank that inits its process group alone (``misrendezvous:rank=1``: its own store, world
    size 1) makes the supervisor fail the run with one ``misconfigured`` event: no restart, no
    orphans."""
    from ptops.ops.supervisor.procs import run_processes

    run = tmp_path / "run"
    proc = ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--set",
        "train.steps=50",
        "--no-mlflow",
        "--fault",
        "misrendezvous:rank=1",
        timeout=600,
    )
    assert proc.returncode == 4, proc.stderr  # misconfigured: do not requeue (docs/exit-codes.md)
    assert [(e["rank"], e["fault"]) for e in _events(run, "fault_injected")] == [
        (1, "misrendezvous:rank=1")
    ]
    mis = _events(run, "misconfigured")
    assert (
        len(mis) == 1
        and mis[0]["rank"] == 1
        and mis[0]["world_size"] == 1
        and mis[0]["expected_world_size"] == 2
    )
    assert "world of one" in mis[0]["reason"]
    assert [e["attempt"] for e in _events(run, "launch")] == [1]
    assert not _events(run, "restart") and "world of one" in _events(run, "failed")[0]["reason"]
    assert [line for line in proc.stderr.splitlines() if "misconfigured:" in line]
    assert run_processes(run) == []


def test_hold_fault_declared_as_eval_reaches_the_probe_as_an_eval_pause(tmp_path):
    """``hold:phase=eval`` (how tests and the soak declare an engine's eval pause) fires before the
    step like any hold, but the probe reports phase ``eval`` (judged by the eval budget)."""
    import threading

    from ptops.faultinject.inject import Injector
    from ptops.faultinject.spec import parse

    seen = []
    inj = Injector(
        [parse("hold:step=3,seconds=0.05,phase=eval")],
        0,
        1,
        lambda f, s: None,
        on_hold=lambda step, phase="hold": seen.append((step, phase)),
        on_release=lambda *a: seen.append("end"),
    )
    inj.before_step(2)
    assert seen == []
    t = threading.Thread(target=inj.before_step, args=(3,))
    t.start()
    t.join(10)
    assert seen == [(3, "eval"), "end"]
    plain = []
    inj = Injector(
        [parse("hold:step=1,seconds=0.01")],
        0,
        1,
        lambda f, s: None,
        on_hold=lambda step: plain.append(step),
    )
    inj.before_step(1)
    assert plain == [1]


def test_startup_hang_found_from_the_first_attempts_durations(tmp_path, ptops):
    """Attempt 1 crashes at step 2 (its start-up sections are now known); in attempt 2 rank 1 hangs
    in the checkpoint-load section (``hang:phase=load``): found by the learned load budget,
    max(startup_floor_s, 10 x what attempt 1's load took), not the 600 s start-up timeout."""
    from ptops.ops.supervisor.procs import run_processes

    run = tmp_path / "run"
    proc = ptops(
        "launch",
        "titan-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "supervisor.restart.backoff_s=0.5",
        "--no-mlflow",
        "--fault",
        "crash:rank=1,step=2",
        "--fault",
        "hang:phase=load,rank=1,attempt=2",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    hangs = _events(run, "hang")
    assert len(hangs) == 1, proc.stderr
    h = hangs[0]
    assert (
        h["attempt"] == 2 and h["phase"] == "startup" and h["section"] == "load" and 1 in h["ranks"]
    )
    assert DEFAULTS.startup_floor_s <= h["timeout_s"] < DEFAULTS.load_s  # learned, far below 600 s
    assert [e["attempt"] for e in _events(run, "launch")] == [1, 2, 3] and _events(run, "completed")
    assert run_processes(run) == []


def test_supervisor_hands_sections_and_world_reports_on(tmp_path):
    """The channel handlers pass a beat's start-up section to the monitor, and a rank's report of
    a world of one marks the attempt misconfigured (the attempt loop then fails the run)."""
    from helpers import offline_supervisor

    from ptops.ops.supervisor.channel import Peer

    sup = offline_supervisor(tmp_path, 2)
    peers = [
        Peer(
            cid=r,
            sock=None,
            hello={"role": "rank", "rank": r, "attempt": 1, "pid": 100 + r, "host": "h"},
        )
        for r in (0, 1)
    ]
    for p in peers:
        sup.handle(p, {"t": "_hello"}, 1.0)
        sup.handle(p, {"t": "beat", "step": 0, "phase": "startup", "section": "rendezvous"}, 2.0)
    assert sup.monitor.ranks[1].section == "rendezvous"
    sup.handle(peers[0], {"t": "world", "world_size": 2, "rank": 0, "host": "h"}, 3.0)
    assert sup.misconfigured is None
    sup.handle(peers[1], {"t": "world", "world_size": 1, "rank": 0, "host": "h"}, 3.0)
    m = sup.misconfigured
    assert (
        m["rank"] == 1
        and m["world_size"] == 1
        and m["expected_world_size"] == 2
        and "world of one" in m["reason"]
    )


def test_second_step_of_a_fresh_run_is_judged_by_its_first_step():
    m = HangMonitor(2, 0.0, DEFAULTS)
    run_steps(m, 1, 1, startup(m, 0.0), 3.0)  # only the first step is known
    assert m.step_timeout() == pytest.approx(30.0, rel=0.05)  # 10 x the first step, not 300 s
    assert m.section_timeout("data") == m.step_timeout()


def test_a_peers_clean_exit_gives_the_others_the_shutdowns_budget():
    """A user's script has no known last step (``total_steps`` None): once a rank left cleanly the
    job is ending, and a peer still tearing down (a process group's destructor: 5 s once on a
    loaded box, a false hang at the end of a finished run) is judged by the final shutdown's budget,
    not a step's. A rank that left with an error changes nothing: its peers' step budget stands."""
    for code, hang_after in ((0, DEFAULTS.checkpoint_s), (1, 5.0)):
        m = HangMonitor(2, 0.0, DEFAULTS)
        t = run_steps(m, 1, 12, startup(m, 0.0), 0.1)
        m.observe({"kind": "exit", "rank": 0, "ts": t, "code": code})
        ping(m, t, t + hang_after + 2, ranks=[1])
        no_hang_until(m, t, t + hang_after - 1, step=1)
        found = m.check(t + hang_after + 1)
        assert found is not None and found.ranks == [1], (code, found)
        assert found.phase == ("finishing" if code == 0 else "step")


def test_after_a_peers_clean_exit_a_silent_teardown_gets_the_shutdowns_budget_too():
    """The peer still tearing down may not even ping (fresh clone s12a, the accelerate example:
    rank 1 idle in C after its script's ``main()`` returned, no ping for 5 s, rank 0 gone with
    code 0): judged by the shutdown's budget for liveness as for progress. After an error exit the
    liveness bound stands."""
    for code in (0, 1):
        m = HangMonitor(2, 0.0, DEFAULTS)
        t = run_steps(m, 1, 12, startup(m, 0.0), 0.1)
        m.observe({"kind": "exit", "rank": 0, "ts": t, "code": code})  # rank 1: nothing after t
        bound = max(m.step_timeout(), DEFAULTS.ping_stale_s)  # a step's liveness bound (5 s)
        hang_after = DEFAULTS.checkpoint_s if code == 0 else bound
        no_hang_until(m, t, t + hang_after - 1, step=1)
        found = m.check(t + hang_after + 1)
        assert found is not None and found.ranks == [1], (code, found)


# ---------------------------------------------------------------- irregular steps (issue 47)


def test_a_rare_long_step_sets_a_floor_the_p99_would_miss():
    """1,000 steps of 1 s with an evaluation of 20 s every 200 steps: 0.5 % of the steps, below
    the nearest-rank p99, so 10 x p99 is 10 s. The next such step must not be a hang: the budget is
    also seen_multiplier x the longest step seen (40 s); a stall is still found within it."""
    m = HangMonitor(2, 0.0)
    t = startup(m, 0.0)
    for block in range(5):
        first = block * 200 + 1
        t = run_steps(m, first, first + 198, t, 1.0)
        t = run_steps(m, first + 199, first + 199, t, 20.0)
    assert m.learned.p99("step") < 1.1 and m.step_timeout() == pytest.approx(40.0, rel=0.05)
    # the 6th evaluation step: 20 s without progress after step 1000 ended
    ping(m, t, t + 30)
    no_hang_until(m, t, t + 25)
    found = m.check(t + 41)
    assert found is not None and found.section == "step" and found.timeout_s <= 41


def test_one_ranks_own_save_is_a_pause_its_peers_wait_for():
    """A script's rank 0 saves its snapshot (``save``: a declared pause, the checkpoint budget)
    while rank 1 waits in a barrier: 30 s, over the 5 s step budget, is no hang of either."""
    m = HangMonitor(2, 0.0)
    t = run_steps(m, 1, 20, startup(m, 0.0), 0.1)
    m.observe({"kind": "beat", "rank": 0, "step": 20, "phase": "save", "ts": t})
    ping(m, t, t + 40)
    no_hang_until(m, t, t + 30)
    assert m.ranks[0].section == "checkpoint"
    m.observe({"kind": "beat", "rank": 0, "step": 20, "phase": "step", "ts": t + 30})
    assert m.learned.p99("checkpoint") == pytest.approx(30.0, rel=0.05)
    t = run_steps(m, 21, 22, t + 30, 0.1)
    # a save that never ends is still judged by its budget (60 s floor), a SIGSTOP at once
    m.observe({"kind": "beat", "rank": 0, "step": 22, "phase": "save", "ts": t})
    ping(m, t, t + 400)
    no_hang_until(m, t, t + 299)
    found = m.check(t + 301)
    assert found is not None and found.ranks == [0] and found.section == "checkpoint", found


# ---------------------------------------------------------------- the seams of an RL step


def rl_steps(m: HangMonitor, first: int, last: int, t: float, sync: float, rest: float) -> float:
    """Steps of ``sync + rest`` seconds whose weight sync to the engine (phase engine_sync) takes
    ``sync`` on every rank; the generation and the reward call take ``rest``."""
    for s in range(first, last + 1):
        for r in list(m.ranks):
            m.observe(
                {"kind": "beat", "rank": r, "step": s, "phase": "step", "stage": "begin", "ts": t}
            )
            m.observe({"kind": "beat", "rank": r, "step": s, "phase": "engine_sync", "ts": t})
            m.observe({"kind": "beat", "rank": r, "step": s, "phase": "step", "ts": t + sync})
            m.observe(
                {"kind": "beat", "rank": r, "step": s, "phase": "reward", "ts": t + sync + 0.1}
            )
            m.observe({"kind": "beat", "rank": r, "step": s, "phase": "step", "ts": t + sync + 1})
            m.observe({"kind": "metrics", "rank": r, "step": s, "step_s": sync + rest, "ts": t})
        t += sync + rest
    return t


def test_a_hung_weight_sync_is_found_on_its_own_learned_budget_not_the_steps():
    """Steps of 60 s whose sync takes 2 s: the step's budget is 600 s, the sync's 20 s (10 x its
    p99); a sync that never returns is found there, named by its seam."""
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = rl_steps(m, 1, 20, startup(m, 0.0), sync=2.0, rest=58.0)
    assert m.step_timeout() == pytest.approx(600.0)
    assert m.section_timeout("engine_sync") == pytest.approx(20.0, rel=0.1)
    for r in (0, 1):  # step 21's sync begins and never ends (both ranks keep pinging)
        m.observe(
            {"kind": "beat", "rank": r, "step": 21, "phase": "step", "stage": "begin", "ts": t}
        )
        m.observe({"kind": "beat", "rank": r, "step": 21, "phase": "engine_sync", "ts": t})
    ping(m, t, t + 60, every=1.0)
    budget = m.section_timeout("engine_sync")
    no_hang_until(m, t, t + budget - 0.1)
    f = m.check(t + budget + 0.1)
    assert f is not None and f.phase == "engine_sync" and f.step == 21, f
    assert f.timeout_s == pytest.approx(budget)


def test_a_slow_reward_call_keeps_the_steps_budget():
    """The reward call's graders carry bounds of their own (the judge: 10 s a completion): a call
    far longer than the ones before is judged by the step's budget, not cut short by its history."""
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = rl_steps(m, 1, 20, startup(m, 0.0), sync=2.0, rest=58.0)
    for r in (0, 1):
        m.observe(
            {"kind": "beat", "rank": r, "step": 21, "phase": "step", "stage": "begin", "ts": t}
        )
        m.observe({"kind": "beat", "rank": r, "step": 21, "phase": "reward", "ts": t})
    ping(m, t, t + 700, every=5.0)
    no_hang_until(m, t, t + 599, step=10.0)
    f = m.check(t + 601)
    assert f is not None and f.phase == "reward" and f.timeout_s == pytest.approx(600.0)


def test_a_seam_without_history_is_judged_by_the_step():
    m = HangMonitor(2, 0.0, DEFAULTS)
    t = run_steps(m, 1, 20, startup(m, 0.0), 3.0)  # 30 s step budget, no sync seen yet
    for r in (0, 1):
        m.observe(
            {"kind": "beat", "rank": r, "step": 21, "phase": "step", "stage": "begin", "ts": t}
        )
        m.observe({"kind": "beat", "rank": r, "step": 21, "phase": "engine_generate", "ts": t})
    ping(m, t, t + 40, every=1.0)
    assert m.check(t + 29.9) is None
    f = m.check(t + 30.1)
    assert f is not None and f.phase == "engine_generate"
