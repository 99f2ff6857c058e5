"""Supervisor pieces without training: restart policy, hang monitor, channel, dispatch, blame,
injectors, lock, status."""

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ptops.faultinject.inject import Injector
from ptops.faultinject.spec import parse
from ptops.monitors.hang import HangConfig, HangMonitor
from ptops.ops.node.agent import relay_in_thread
from ptops.ops.rank.channel import ChannelClient
from ptops.ops.supervisor.blame import (
    GOODBYE,
    KILLED_PEER_RACE_S,
    NO_GOODBYE,
    Bad,
    Blame,
    root_cause,
)
from ptops.ops.supervisor.channel import ChannelServer
from ptops.ops.supervisor.policy import EXIT_FAILED, EXIT_NO_REQUEUE, Failure, RestartPolicy
from ptops.recipes.schema import RestartConfig

# ---------------------------------------------------------------- policy


def test_backoff_doubles_without_progress_and_is_capped():
    p = RestartPolicy(
        RestartConfig(backoff_s=1, backoff_max_s=5, storm_restarts=100, no_progress_attempts=100)
    )
    delays = []
    for i in range(6):
        d = p.decide(Failure(ts=1000 * i, start_step=10, good_step=10, reason="x"))
        assert d.action == "restart"
        delays.append(d.delay_s)
    assert delays == [1, 2, 4, 5, 5, 5]
    # an attempt that made progress restarts at once, and resets the backoff
    d = p.decide(Failure(ts=10_000, start_step=10, good_step=20, reason="x"))
    assert d.delay_s == 0
    d = p.decide(Failure(ts=20_000, start_step=20, good_step=20, reason="x"))
    assert d.delay_s == 1


def test_storm_stops_with_do_not_requeue():
    p = RestartPolicy(RestartConfig(storm_restarts=3, storm_window_min=1, no_progress_attempts=100))
    steps = iter(range(0, 1000, 10))

    def fail(ts):
        s = next(steps)
        return p.decide(Failure(ts=ts, start_step=s, good_step=s + 10, reason="boom"))

    assert fail(0).action == "restart"
    assert fail(100).action == "restart"  # first one is outside the window now
    assert fail(130).action == "restart"
    d = fail(150)  # 100, 130, 150 within 60 s
    assert (
        d.action == "stop"
        and d.exit_code == EXIT_NO_REQUEUE
        and "storm" in d.reason
        and "boom" in d.reason
    )


def test_no_progress_stops_after_k_attempts():
    p = RestartPolicy(RestartConfig(no_progress_attempts=3, storm_restarts=100))
    assert p.decide(Failure(0, start_step=0, good_step=10)).action == "restart"  # made progress
    assert p.decide(Failure(100, start_step=10, good_step=10)).action == "restart"
    assert p.decide(Failure(200, start_step=10, good_step=10)).action == "restart"
    d = p.decide(Failure(300, start_step=10, good_step=10))
    assert (
        d.action == "stop"
        and d.exit_code == EXIT_NO_REQUEUE
        and "no progress" in d.reason
        and "step 10" in d.reason
    )


def test_max_restarts_is_plain_failure():
    p = RestartPolicy(RestartConfig(max_restarts=2, storm_restarts=100, no_progress_attempts=100))
    for i in range(2):
        assert p.decide(Failure(1000 * i, start_step=i, good_step=i + 1)).action == "restart"
    d = p.decide(Failure(5000, start_step=2, good_step=3))
    assert (
        d.action == "stop"
        and d.exit_code == EXIT_FAILED
        and "supervisor.restart.max_restarts=2" in d.reason
    )


def test_policy_history_from_events():
    events = [
        {"kind": "launch", "ts": 1},
        {"kind": "restart", "ts": 10, "from_step": 5, "prev_from_step": 5, "reason": "crash"},
        {"kind": "restart", "ts": 20, "from_step": 5, "prev_from_step": 5, "reason": "crash"},
    ]
    p = RestartPolicy.from_events(RestartConfig(no_progress_attempts=3, storm_restarts=100), events)
    assert p.no_progress_streak() == 2
    assert p.decide(Failure(30, start_step=5, good_step=5)).exit_code == EXIT_NO_REQUEUE


def test_temporary_strategy_never_restarts():
    """A plain launch: the first failure ends the run (exit 1), whatever the restart budget says."""
    p = RestartPolicy(RestartConfig(max_restarts=10), strategy="temporary")
    d = p.decide(
        Failure(0, start_step=0, good_step=10, reason="crash: rank 1 exited -9 at step 12")
    )
    assert d.action == "stop" and d.exit_code == EXIT_FAILED
    assert "crash: rank 1 exited -9" in d.reason and "no restart" in d.reason
    assert (
        RestartPolicy.from_events(RestartConfig(), [], "temporary").decide(Failure(0, 0, 0)).action
        == "stop"
    )


# ---------------------------------------------------------------- hang monitor


def _steps(mon, rank, first, last, t0, dt):
    t = t0
    for s in range(first, last + 1):
        mon.observe(
            {"kind": "beat", "rank": rank, "step": s, "phase": "step", "stage": "begin", "ts": t}
        )
        t += dt
        mon.observe({"kind": "metrics", "rank": rank, "step": s, "step_s": dt, "ts": t})
    return t


def test_startup_budget_then_adaptive_step_timeout():
    cfg = HangConfig(multiplier=10, floor_s=2, startup_s=30, checkpoint_s=20, ping_stale_s=100)
    mon = HangMonitor(2, 0.0, cfg)
    mon.observe({"kind": "beat", "rank": 0, "step": 0, "phase": "startup", "ts": 1})
    assert mon.check(29.9) is None  # rank 1 has not even connected yet: startup budget
    f = mon.check(30.5)
    assert f is not None and f.phase == "startup" and 1 in f.ranks
    mon = HangMonitor(2, 0.0, cfg)
    t = 0.0
    for r in (0, 1):
        t = _steps(mon, r, 1, 10, 5.0, 0.5)
    assert mon.step_timeout() == 5.0  # 10 x median 0.5 s > floor 2 s
    assert mon.check(t + 4.9) is None
    f = mon.check(t + 5.1)
    assert f is not None and f.phase == "step" and f.timeout_s == 5.0


def test_floor_applies_to_fast_steps():
    mon = HangMonitor(1, 0.0, HangConfig(multiplier=10, floor_s=3, ping_stale_s=100))
    t = _steps(mon, 0, 1, 20, 1.0, 0.01)
    assert mon.step_timeout() == 3
    assert mon.check(t + 2.9) is None and mon.check(t + 3.1) is not None


def test_checkpoint_budget_and_unresponsive_rank():
    cfg = HangConfig(multiplier=10, floor_s=2, checkpoint_s=60, ping_stale_s=3)
    mon = HangMonitor(2, 0.0, cfg)
    t = max(_steps(mon, r, 1, 5, 1.0, 0.1) for r in (0, 1))
    for r in (0, 1):
        mon.observe({"kind": "beat", "rank": r, "step": 5, "phase": "checkpoint", "ts": t})
    # rank 0 keeps pinging while its save waits; rank 1 goes silent (SIGSTOPped inside the save)
    for k in range(1, 20):
        mon.observe({"kind": "ping", "rank": 0, "ts": t + k})
    assert mon.check(t + 1.5) is None
    f = mon.check(t + 10)
    assert f is not None and f.ranks == [1] and f.why == "unresponsive" and f.stalled == [1]
    # a save that only takes long (both ranks pinging) is fine until checkpoint_s
    mon2 = HangMonitor(1, 0.0, cfg)
    t = _steps(mon2, 0, 1, 5, 1.0, 0.1)
    mon2.observe({"kind": "beat", "rank": 0, "step": 5, "phase": "checkpoint", "ts": t})
    for k in range(1, 70):
        mon2.observe({"kind": "ping", "rank": 0, "ts": t + k})
    assert mon2.check(t + 59) is None
    assert mon2.check(t + 61).phase == "checkpoint"


def _node_world(mon, pings, until):
    """24 ranks (3 nodes of 8) finish steps 1-5 (1 s each), enter step 6 together at t=5 and wait
    in its collective; rank r pings every 0.5 s until ``pings.get(r, until)``."""
    for r in range(24):
        _steps(mon, r, 1, 5, 0.0, 1.0)
        mon.observe(
            {"kind": "beat", "rank": r, "step": 6, "phase": "step", "stage": "begin", "ts": 5.0}
        )
    for r in range(24):
        k = 1
        while 5.0 + 0.5 * k <= pings.get(r, until):
            mon.observe({"kind": "ping", "rank": r, "ts": 5.0 + 0.5 * k})
            k += 1


def test_a_frozen_node_is_named_whole_and_a_late_sender_quiet_for_less_is_not():
    """Node 1 (ranks 8-15) freezes: its last pings a heartbeat apart. When its budget runs out,
    node 2's sender has been late for 5.5 s (quiet past ping_stale_s, 4 s): named before, which
    blamed two nodes (no Slurm strike); now listed as also quiet, not named."""
    from ptops.ops.runrecord.events import SPECS, EventKind

    mon = HangMonitor(24, 0.0, HangConfig(multiplier=10, floor_s=2, ping_stale_s=4))
    pings = {8 + i: 5.0 + 0.5 * (i % 2) for i in range(8)} | {16 + i: 10.0 for i in range(8)}
    _node_world(mon, pings, until=15.5)
    assert mon.step_timeout() == 10
    f = mon.check(15.5)
    assert f is not None and f.why == "unresponsive"
    assert f.ranks == list(range(8, 16)) and f.also_quiet == list(range(16, 24))
    assert f.stalled == list(range(24))  # every rank is past its step budget: all in step 6
    ev = f.as_event(1)
    assert ev["also_quiet"] == list(range(16, 24))
    assert "also_quiet" in SPECS[EventKind.HANG].optional
    # the same world without the late sender: the node alone, nothing else listed
    mon = HangMonitor(24, 0.0, HangConfig(multiplier=10, floor_s=2, ping_stale_s=4))
    _node_world(mon, {8 + i: 5.0 for i in range(8)}, until=15.5)
    f = mon.check(15.5)
    assert f.ranks == list(range(8, 16)) and f.also_quiet == []
    assert "also_quiet" not in f.as_event(1)


@pytest.mark.parametrize(
    "apart, named, also",
    [(3.0, [3, 12], []), (5.5, [3], [12]), (0.0, [3, 12], [])],
)
def test_two_silent_ranks_are_both_named_only_when_they_went_silent_together(apart, named, also):
    """Rank 3 stops pinging at t=5, rank 12 ``apart`` seconds later: within ping_stale_s (4 s)
    of each other both are culprits (a fault that took two nodes); further apart the second is
    listed as also quiet, the first named (its node is the one that stopped the job)."""
    mon = HangMonitor(24, 0.0, HangConfig(multiplier=10, floor_s=2, ping_stale_s=4))
    _node_world(mon, {3: 5.0, 12: 5.0 + apart}, until=15.5)
    f = mon.check(15.5)
    assert f is not None and f.why == "unresponsive"
    assert f.ranks == named and f.also_quiet == also and f.step == 6


def test_culprit_is_the_rank_behind():
    mon = HangMonitor(2, 0.0, HangConfig(floor_s=2, ping_stale_s=100))
    t = max(_steps(mon, r, 1, 7, 1.0, 0.1) for r in (0, 1))
    # rank 1 entered step 8 and waits in a collective; rank 0 hangs before step 8 begins
    mon.observe(
        {"kind": "beat", "rank": 1, "step": 8, "phase": "step", "stage": "begin", "ts": t + 0.01}
    )
    for k in range(1, 10):
        for r in (0, 1):
            mon.observe({"kind": "ping", "rank": r, "ts": t + k * 0.5})
    f = mon.check(t + 3)
    assert (
        f.ranks == [0]
        and f.why == "behind"
        and f.step == 7
        and f.silent_s == pytest.approx(3, abs=0.1)
    )
    ev = f.as_event(attempt=2)
    assert ev["attempt"] == 2 and ev["ranks"] == [0] and ev["step"] == 7


def test_exited_rank_is_not_watched():
    mon = HangMonitor(
        2, 0.0, HangConfig(floor_s=2, ping_stale_s=100, total_steps=5, checkpoint_s=30)
    )
    t = max(_steps(mon, r, 1, 5, 1.0, 0.1) for r in (0, 1))
    mon.observe({"kind": "exit", "rank": 1, "ts": t})
    for k in range(1, 40):
        mon.observe({"kind": "ping", "rank": 0, "ts": t + k})
    assert mon.check(t + 10) is None  # rank 0 is finishing (final save): checkpoint budget
    assert mon.check(t + 31) is not None


# ---------------------------------------------------------------- channel


def test_channel_roundtrip_and_auth():
    """A rank's message reaches the supervisor through its node agent and a command comes back;
    a wrong token is dropped unanswered; a rank connecting to the supervisor itself is refused
    (one line saying why), so every rank takes the agent's path."""
    server = ChannelServer()
    try:
        with relay_in_thread(server.address(), server.token) as agent:
            got = []
            client = ChannelClient(
                agent.local_address,
                agent.local_token,
                {"role": "rank", "rank": 3, "attempt": 1},
                on_message=got.append,
            )
            client.send({"t": "beat", "step": 1})
            assert server.inbox.get(timeout=5)[1]["role"] == "node"  # the agent's own hello
            peer, hello, _ = server.inbox.get(timeout=5)
            assert hello["t"] == "_hello" and hello["rank"] == 3 and "token" not in hello
            assert peer.via is not None and peer.via.role == "node"
            _, batch, _ = server.inbox.get(timeout=5)
            assert [m for _, m, _ in batch["items"]] == [{"t": "beat", "step": 1}]
            server.send(peer, {"cmd": "stacks", "id": 1})
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got == [{"cmd": "stacks", "id": 1}]
            # a wrong token is dropped without an answer and never reaches the inbox
            told = []
            bad = ChannelClient(
                server.address(), "wrong", {"role": "node", "node": "x"}, on_message=told.append
            )
            bad.send({"t": "ka"})
            # the right token, but a rank of its own: refused, told why, never in the inbox
            direct = ChannelClient(
                server.address(),
                server.token,
                {"role": "rank", "rank": 9, "attempt": 1},
                on_message=told.append,
            )
            direct.send({"t": "beat", "step": 99})
            deadline = time.monotonic() + 5
            while not told and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (
                len(told) == 1
                and "refused" in told[0]["error"]
                and "node agent" in told[0]["error"]
            )
            assert server.refused == 1 and server.inbox.empty()
            client.close()
            _, gone, _ = server.inbox.get(timeout=5)
            assert gone == {"t": "_eof"}
    finally:
        server.close()


def test_probe_dies_when_its_channel_closes(tmp_path):
    """The rank-side half of 'no orphans': its node agent's connection ends (the agent exited:
    its sockets close) -> the rank kills itself."""
    server = ChannelServer()
    try:
        with relay_in_thread(server.address(), server.token) as agent:
            code = (
                "import time\n"
                "from ptops.ops.rank.probe import Probe\n"
                f"p = Probe({str(tmp_path)!r}, 0, 1, channel={agent.local_address!r}, "
                f"token={agent.local_token!r}, heartbeat_s=0.2)\n"
                "p.startup()\n"
                "time.sleep(60)\n"
            )
            proc = subprocess.Popen([sys.executable, "-c", code])
            try:
                server.inbox.get(timeout=30)  # the agent
                assert server.inbox.get(timeout=30)[1]["t"] == "_hello"  # the rank, relayed
            except BaseException:
                proc.kill()
                raise
        try:  # the agent's sockets are closed on leaving the block
            assert proc.wait(timeout=15) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        server.close()


# ---------------------------------------------------------------- injectors


def test_injector_fires_once_at_its_step_and_emits_first():
    emitted = []
    inj = Injector(
        [
            parse("nan:step=3"),
            parse("slow:rank=0,step=2,seconds=0.05,steps=2"),
            parse("crash:rank=1,step=2"),
        ],
        0,
        1,
        lambda f, s: emitted.append((f.kind, s)),
    )
    assert not inj.should_poison(2) and inj.should_poison(3) and not inj.should_poison(3)
    t = time.monotonic()
    inj.before_step(2)
    inj.before_step(3)
    inj.before_step(4)
    assert 0.09 < time.monotonic() - t < 1.0  # slow: two steps of 0.05 s
    assert emitted == [("nan", 3), ("slow", 2)]  # the crash is rank 1's
    other = Injector([parse("nan:step=3,attempt=2")], 0, 1, lambda f, s: None)
    assert not other.should_poison(3)


def test_live_injected_fault_fires_at_next_step_when_past():
    emitted = []
    inj = Injector([], 0, 1, lambda f, s: emitted.append(s))
    assert inj.add(parse("nan:step=2"))
    assert not inj.add(parse("nan:rank=1,step=2"))
    assert inj.should_poison(7) and emitted == [7]


def test_enospc_and_corrupt(tmp_path):
    inj = Injector(
        [parse("enospc:step=5"), parse("corrupt-ckpt:step=10")],
        0,
        1,
        lambda f, s: None,
        run_dir=tmp_path,
    )
    with pytest.raises(OSError) as exc:
        inj.on_checkpoint(5)
    assert exc.value.errno == 28
    ck = tmp_path / "checkpoints" / "step-10"
    ck.mkdir(parents=True)
    (ck / "__0_0.distcp").write_bytes(b"x" * 100)
    inj.on_checkpoint(10)
    inj.after_checkpoint(10)
    assert (ck / "__0_0.distcp").stat().st_size == 50


def test_crash_fault_kills_the_process(tmp_path):
    code = (
        "from ptops.ops.rank.probe import Probe\n"
        f"p = Probe({str(tmp_path)!r}, 1, 1, "
        f"faults={json.dumps(json.dumps([parse('crash:rank=1,step=2').to_dict()]))})\n"
        "p.faults.before_step(1); p.faults.before_step(2); print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev[0]["kind"] == "fault_injected" and ev[0]["rank"] == 1 and ev[0]["step"] == 2


# ---------------------------------------------------------------- lock and status


def test_lock_is_exclusive_and_dies_with_holder(tmp_path):
    from ptops.ops.runrecord.lock import LockedError, acquire, holder, release

    fd = acquire(tmp_path)
    assert holder(tmp_path) == os.getpid()
    code = f"from ptops.ops.runrecord.lock import acquire; acquire({str(tmp_path)!r}, wait_s=0.2)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "already supervised by pid" in proc.stderr
    release(fd)
    assert holder(tmp_path) is None
    # a holder killed with SIGKILL releases it
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from ptops.ops.runrecord.lock import acquire; acquire({str(tmp_path)!r}); import "
            "time; print('ok', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ok"
    with pytest.raises(LockedError):
        acquire(tmp_path, wait_s=0.1)
    p.kill()
    p.wait()
    release(acquire(tmp_path, wait_s=2))


def test_status_lists_the_live_ranks_encoded_again_only_when_they_change(tmp_path):
    """status.json's ranks (pid and host: what ``ptops status --json`` and ``inject`` read) follow
    every hello, a rank's new hello and every EOF; between those the list is not sorted and
    encoded again each second (131,072 ranks: ~0.3 s of the main thread a rewrite)."""
    from helpers import offline_supervisor

    from ptops.ops.runrecord.status import write_status
    from ptops.ops.supervisor.channel import Peer

    sup = offline_supervisor(tmp_path, 3)

    def peer(r, pid):
        hello = {"role": "rank", "rank": r, "attempt": 1, "pid": pid, "host": f"h{r}"}
        return Peer(cid=r, sock=None, hello=hello)

    def listed():
        sup.write_status(force=True)
        st = json.loads((sup.run.path / "status.json").read_text())
        assert st["attempt"] == 1 and st["total_steps"] == sup.recipe.train.steps
        return [(r["rank"], r["pid"], r["host"]) for r in st["ranks"]]

    for r in (2, 0, 1):
        sup.handle(peer(r, 100 + r), {"t": "_hello"}, 1.0)
    assert listed() == [(0, 100, "h0"), (1, 101, "h1"), (2, 102, "h2")]
    held = sup._ranks_held[2]
    assert listed() == [(0, 100, "h0"), (1, 101, "h1"), (2, 102, "h2")]
    assert sup._ranks_held[2] is held  # nothing changed: not encoded again
    sup.handle(peer(1, 555), {"t": "_hello"}, 2.0)  # rank 1 again (its process was replaced)
    assert listed() == [(0, 100, "h0"), (1, 555, "h1"), (2, 102, "h2")]
    sup.handle(peer(0, 100), {"t": "_eof"}, 3.0)
    assert listed() == [(1, 555, "h1"), (2, 102, "h2")]
    sup.ranks = {}  # the next attempt
    assert listed() == []
    # a start-up burst: a change within 20x the last encoding's cost waits, unless forced
    sup._ranks_held = (*sup._ranks_held[:3], time.monotonic() + 60.0)
    sup.handle(peer(2, 102), {"t": "_hello"}, 4.0)
    assert sup._ranks_json() == "[]"
    assert listed() == [(2, 102, "h2")]
    # the keys given encoded join the others as one JSON object, with or without others
    write_status(sup.run, {}, {"ranks": "[1]"})
    assert json.loads((sup.run.path / "status.json").read_text()) == {"ranks": [1]}
    write_status(sup.run, {"a": "x"}, {"b": "{}"})
    assert json.loads((sup.run.path / "status.json").read_text()) == {"a": "x", "b": {}}


def test_status_marks_a_dead_supervisor(tmp_path, ptops):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.runrecord.status import write_status

    run = RunDir(tmp_path / "run").create()
    run.event("launch", attempt=1, supervised=True)
    write_status(
        run,
        {
            "state": "running",
            "step": 3,
            "attempt": 1,
            "supervisor_pid": 999999,
            "ranks": [{"rank": 0, "pid": 5, "host": "h"}],
        },
    )
    proc = ptops("status", str(run.path), "--json", check=True)
    s = json.loads(proc.stdout)
    assert (
        s["state"] == "dead"
        and s["supervisor_pid"] is None
        and s["ranks"] == []
        and "resume" in s["hint"]
    )
    assert oct(os.stat(run.path / "status.json").st_mode & 0o777) == "0o600"
    bad = ptops("status", str(tmp_path / "nope"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_recipe_supervisor_section_validates(ptops):
    from ptops.recipes.schema import RecipeError, load

    rec, _ = load("titan-tiny", ["supervisor.hang.floor_s=5", "supervisor.restart.max_restarts=2"])
    assert rec.supervisor.hang.floor_s == 5 and rec.supervisor.restart.max_restarts == 2
    assert rec.supervisor.channel_host == "127.0.0.1"
    with pytest.raises(RecipeError, match="supervisor.hang.floor_s"):
        load("titan-tiny", ["supervisor.hang.floor_s=-1"])
    with pytest.raises(RecipeError, match="supervisor.bogus"):
        load("titan-tiny", ["supervisor.bogus=1"])
    with pytest.raises(RecipeError, match="supervisor.restart.bogus"):
        load("titan-tiny", ["supervisor.restart.bogus=1"])


def test_nested_supervisor_defaults_are_the_models_own():
    """Defaults are written once: the recipe's sections are the models the policy and hang monitor
    take."""
    from ptops.monitors.hang import HangConfig
    from ptops.recipes.schema import SupervisorSection, load

    rec, _ = load("titan-tiny")
    assert rec.supervisor.hang == HangConfig() and rec.supervisor.restart == RestartConfig()
    assert (
        SupervisorSection().hang.floor_s == 5.0 and SupervisorSection().restart.max_restarts == 10
    )
    for model in (HangConfig, RestartConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
    # the supervisor hands its recipe's section to the policy as is
    assert RestartPolicy.from_events(rec.supervisor.restart, []).config is rec.supervisor.restart


TORCHRUN_FAILURES = """\
Failures:
[1]:
  time      : 2026-11-30_03:49:40
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 21144)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 21144
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-30_03:49:40
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 21143)  (SIGTERM)
"""


def test_root_cause_is_not_torchruns_sigtermed_survivor():
    """torchrun blames the rank with the earliest error file; the SIGKILLed rank never writes
    one."""
    assert root_cause(None, TORCHRUN_FAILURES, 1) == (1, -9, "torchrun")


def test_root_cause_prefers_the_channel():
    first = Bad(1, None, NO_GOODBYE, 100.0)
    assert root_cause(first, TORCHRUN_FAILURES, 1) == (
        1,
        -9,
        NO_GOODBYE,
    )  # exit code from torchrun's log
    assert root_cause(Bad(0, 3, GOODBYE, 100.0), TORCHRUN_FAILURES, 1) == (
        0,
        3,
        GOODBYE,
    )  # its own goodbye's code


def test_root_cause_without_any_report_is_torchruns_exit_code():
    assert root_cause(None, "", 1) == (None, 1, "torchrun exit code")
    only_sigterm = "  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n"
    assert root_cause(None, only_sigterm, 1) == (0, -15, "torchrun")  # nobody else to blame


def test_killed_rank_beats_the_peer_whose_error_it_caused():
    b = Blame()
    b.note(0, 1, GOODBYE, 100.0)  # rank 0: "connection closed by peer"
    b.note(1, None, NO_GOODBYE, 100.0 + KILLED_PEER_RACE_S / 5)  # rank 1 was SIGKILLed
    assert root_cause(b.first, TORCHRUN_FAILURES, 1) == (1, -9, NO_GOODBYE)


def test_a_rank_the_launcher_stopped_after_the_failing_one_does_not_take_its_blame():
    """A plain launch: rank 1 raises (an OOM, goodbye with exit 1); the launcher sees it die first
    and stops rank 0, whose channel closes without goodbye within the race window. The launcher's
    first line decides: rank 1 (seen in a fresh-clone run under load, 2026-12-03). A rank killed
    outright before its peer's error keeps the blame (the launcher saw it die first)."""
    b = Blame()
    b.note(1, 1, GOODBYE, 100.0)
    b.note(0, None, NO_GOODBYE, 100.0 + KILLED_PEER_RACE_S / 5)
    warm = "[ptops.warmlaunch] failed (exitcode: 1) local_rank: 1 (pid: 42)\n"
    stop = "[ptops.warmlaunch] exited (exitcode: -15) local_rank: 0 (pid: 41)\n"
    assert root_cause(b.first, warm + stop, 1, b.displaced) == (1, 1, GOODBYE)
    # a handler that exits 128+15 on SIGTERM was stopped too
    assert root_cause(b.first, warm + stop.replace("-15", "143"), 1, b.displaced)[0] == 1
    # the failed line alone is no order of death: nothing says warmlaunch stopped rank 0
    assert root_cause(b.first, warm, 1, b.displaced)[::2] == (0, NO_GOODBYE)
    killed = "[ptops.warmlaunch] failed (exitcode: -9) local_rank: 0 (pid: 41)\n"
    assert root_cause(b.first, killed, 1, b.displaced)[::2] == (0, NO_GOODBYE)
    assert root_cause(b.first, "", 1, b.displaced) == (0, None, NO_GOODBYE)  # nothing to decide
    # torchrun: its failure blocks say it SIGTERMed rank 0 (it stopped it after rank 1 failed)
    stopped = "  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n"
    assert root_cause(b.first, stopped, 1, b.displaced) == (1, 1, GOODBYE)
    # torchrun's first line is no order of death (ranks found dead in one poll, in rank order)
    line = "failed (exitcode: 1) local_rank: 1 (pid: 42) of binary: python\n"
    assert root_cause(b.first, line, 1, b.displaced)[::2] == (0, NO_GOODBYE)


def test_a_killed_rank_keeps_the_blame_when_warmlaunch_reads_both_deaths_at_once():
    """Rank 1 is SIGKILLed; rank 0 fails on it and says goodbye first on the channel (both handled
    in one batch). warmlaunch found both statuses in one select and named rank 0 ``failed`` (rank
    order); rank 1's own SIGKILL says no launcher stopped it: rank 1 (CI, 2026-12-04)."""
    b = Blame()
    b.note(0, 1, GOODBYE, 100.0)
    b.note(1, None, NO_GOODBYE, 100.0 + KILLED_PEER_RACE_S / 50)
    log = (
        "[ptops.warmlaunch] failed (exitcode: 1) local_rank: 0 (pid: 41)\n"
        "[ptops.warmlaunch] exited (exitcode: -9) local_rank: 1 (pid: 42)\n"
    )
    assert root_cause(b.first, log, 1, b.displaced) == (1, -9, NO_GOODBYE)


def test_late_silent_exit_does_not_steal_the_blame():
    b = Blame()
    b.note(0, 1, GOODBYE, 100.0)  # rank 0 raised a real error
    b.note(
        1, None, NO_GOODBYE, 100.0 + KILLED_PEER_RACE_S * 6
    )  # rank 1 SIGTERMed by torchrun later
    assert root_cause(b.first, TORCHRUN_FAILURES, 1)[0] == 0


def test_first_silent_death_is_not_replaced():
    b = Blame()
    b.note(1, None, NO_GOODBYE, 100.0)
    b.note(0, None, NO_GOODBYE, 100.01)  # only a goodbye can be overtaken by a silent death
    b.note(0, 1, GOODBYE, 100.02)
    assert b.first.rank == 1


# ---------------------------------------------------------------- channel dispatch


class _FakeServer:
    def __init__(self):
        self.sent = []

    def send(self, peer, msg):
        self.sent.append((peer, msg))
        return True

    def address(self, advertise=""):
        return "127.0.0.1:1"


def _dispatch_sup(tmp_path):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor import Supervisor
    from ptops.recipes.schema import load

    rec, _ = load("titan-tiny", ["launch.nproc=2"])
    run = RunDir(tmp_path / "run").create()
    sup = Supervisor(rec, run, [], out=io.StringIO(), strategy="temporary")
    sup.server = _FakeServer()
    sup.attempt = 1
    sup.monitor = HangMonitor(2, 0.0, rec.supervisor.hang)
    return sup


def _peer(rank, attempt=1, role="rank"):
    from ptops.ops.supervisor.channel import Peer

    return Peer(
        cid=rank or 0,
        sock=None,
        hello={
            "role": role,
            "rank": rank,
            "attempt": attempt,
            "pid": 100 + (rank or 0),
            "host": "h",
        },
    )


def test_dispatch_table_routes_and_counts_unknown_types(tmp_path):
    from ptops.ops.supervisor.messages import CONTROL_HANDLERS, RANK_HANDLERS, MessagesMixin

    for name in (*RANK_HANDLERS.values(), *CONTROL_HANDLERS.values()):
        assert callable(getattr(MessagesMixin, name)), name
    sup = _dispatch_sup(tmp_path)
    p0, p1 = _peer(0), _peer(1)
    sup.handle(p0, {"t": "_hello"}, 1.0)
    sup.handle(p1, {"t": "_hello"}, 1.0)
    assert sorted(sup.ranks) == [0, 1] and sup.state == "running"
    sup.handle(p0, {"t": "metrics", "rec": {"step": 3, "rank": 0, "loss": 1.0, "step_s": 0.1}}, 2.0)
    assert sup.step == 3 and sup.run.read_metrics()[-1]["step"] == 3
    sup.handle(p1, {"t": "telepathy"}, 2.0)
    sup.handle(p1, {"t": "telepathy"}, 2.1)
    sup.handle(_peer(None, role="control"), {"t": "reboot"}, 2.2)
    assert sup.unknown_messages == {"rank:telepathy": 2, "control:reboot": 1}
    assert sup.out.getvalue().count("unknown type 'telepathy'") == 1  # said once, not per message
    sup.handle(
        _peer(0, attempt=0), {"t": "metrics", "rec": {"step": 99}}, 3.0
    )  # a straggler of attempt 0
    assert sup.step == 3 and sup.unknown_messages == {"rank:telepathy": 2, "control:reboot": 1}
    sup.handle(_peer(None, role="control"), {"t": "status"}, 3.0)
    assert sup.server.sent[-1][1] == {"ok": True, "state": "running", "attempt": 1, "step": 3}
    # goodbyes and EOFs feed the blame in channel order
    sup.handle(p0, {"t": "exit", "code": 1, "error": "peer closed"}, 4.0)
    sup.handle(p1, {"t": "_eof"}, 4.05)
    assert sup.blame.first.rank == 1 and sup.blame.first.exit_code is None
    assert sup.ranks[0].exit_code == 1 and sup.ranks[1].gone_ts == 4.05


# ----------------------------------------------------- monitors: a broken config, a raising monitor


class _Boom:
    name = "boom"

    def feed(self, rec):
        raise ValueError("odd record")


class _Echo:
    name = "echo"

    def feed(self, rec):
        return [("finding", rec["step"])]


def test_monitor_that_raises_is_recorded_once_and_the_others_go_on():
    from ptops.ops.supervisor.monitorfeed import MonitorFeed

    feed = MonitorFeed([_Boom(), _Echo()])
    findings, errors = feed.feed({"step": 1})
    assert findings == [("finding", 1)] and [(n, str(e)) for n, e in errors] == [
        ("boom", "odd record")
    ]
    findings, errors = feed.feed({"step": 2})
    assert findings == [("finding", 2)] and errors == [] and feed.errors == {"boom": 2}


def test_monitor_error_becomes_one_event(tmp_path):
    sup = _dispatch_sup(tmp_path)
    sup.feed.monitors.insert(0, _Boom())
    for step in (1, 2, 3):
        sup.feed_monitors({"step": step, "rank": 0, "loss": 1.0})
    (ev,) = [e for e in sup.run.read_events() if e["kind"] == "monitor_error"]
    assert ev["monitor"] == "boom" and ev["step"] == 1 and "ValueError: odd record" in ev["error"]


def test_broken_monitor_config_is_a_recipe_error(monkeypatch, tmp_path):
    from ptops import monitors
    from ptops.monitors.config import MonitorsSection
    from ptops.ops.supervisor import monitorfeed
    from ptops.recipes.schema import RecipeError

    class Picky:
        def __init__(self, cfg):
            raise ValueError("window must exceed level_window")

    monkeypatch.setitem(
        monitors.MONITORS,
        "loss_spike",
        dataclasses.replace(monitors.MONITORS["loss_spike"], monitor=Picky),
    )
    with pytest.raises(
        RecipeError, match=r"^r.toml: key 'monitors.loss_spike': .*window must exceed level_window"
    ):
        monitorfeed.build(MonitorsSection(), "r.toml")
    # switched off, it is not built at all
    assert monitorfeed.build(
        MonitorsSection.model_validate({"loss_spike": {"enabled": False}}), "r.toml"
    )
    with pytest.raises(RecipeError):  # the Supervisor refuses too (callers other than the CLI)
        _dispatch_sup(tmp_path)


def test_broken_monitor_config_exits_2_at_launch(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from ptops import monitors
    from ptops.ops.cli.app import app

    class Picky:
        def __init__(self, cfg):
            raise ValueError("no such key")

    monkeypatch.setitem(
        monitors.MONITORS, "nan", dataclasses.replace(monitors.MONITORS["nan"], monitor=Picky)
    )
    res = CliRunner().invoke(
        app, ["launch", "titan-tiny", "--run-dir", str(tmp_path / "run"), "--no-mlflow"]
    )
    assert res.exit_code == 2, res.output
    assert (
        "error: " in res.output
        and "titan-tiny.toml: key 'monitors.nan'" in res.output
        and "no such key" in res.output
    )
    assert not (tmp_path / "run").exists()  # nothing started, no run directory made


# ---------------------------------------------------------------- launch output


def test_mlflow_setup_lines_stay_out_of_the_launch_output(tmp_path):
    """MLflow's "Creating initial MLflow database tables..." (and alembic's notes) must not land in
    the progress output; our own warning lines still may."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.json").write_text('{"name": "t", "engine": "titan"}')
    code = (
        "from ptops.ops.obs.mlflow_export import MlflowExporter\n"
        f"e = MlflowExporter({str(run)!r}, 'sqlite:///{tmp_path}/mlflow.db')\n"
        "assert e.wait_ready(120) and e.run_id\n"
        "e.close(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "mlflow.db").exists()  # the tables were created, quietly
    assert (
        "Creating initial MLflow database tables" not in proc.stderr and " INFO " not in proc.stderr
    ), proc.stderr


def test_a_group_restarted_by_plain_torchrun_is_a_new_attempt(monkeypatch):
    """Records and attempt-1-only faults of a worker group torchrun restarted itself are told
    apart."""
    from ptops.ops.rank.probe import attempt_from_env

    monkeypatch.setenv("PTOPS_ATTEMPT", "3")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_from_env() == 3  # under ptops: torchrun --max-restarts 0, the supervisor counts
    monkeypatch.setenv("PTOPS_ATTEMPT", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt_from_env() == 2


def test_exit_code_of_an_unreaped_rank_is_read_from_the_kernel():
    """A dead rank's status before torchrun reaps it (what the supervisor reads instead of waiting
    for torchrun's 0.5 s monitor interval): a signal death as minus the signal, an exit as its code;
    a live or reaped process gives None."""
    from ptops.ops.supervisor.procs import zombie_exit_code

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert zombie_exit_code(killed.pid) is None  # alive
        killed.send_signal(signal.SIGKILL)
        for _ in range(200):  # neither is reaped (no wait() yet): both stay zombies
            if (
                zombie_exit_code(killed.pid) is not None
                and zombie_exit_code(exited.pid) is not None
            ):
                break
            time.sleep(0.05)
        assert zombie_exit_code(killed.pid) == -signal.SIGKILL
        assert zombie_exit_code(exited.pid) == 3
    finally:
        killed.kill()
        killed.wait()
        exited.wait()
    assert zombie_exit_code(exited.pid) is None  # reaped


def test_a_backlog_in_the_inbox_is_no_hang_and_is_said_once(tmp_path):
    """The ranks' last handled progress is 6 s old (budget 5 s), but what they sent since arrived
    in the last 1.5 s and waits in the inbox: judged at the oldest unhandled arrival, none is late.
    The lag is recorded once per episode (``inbox_behind``); a drained inbox judges at ``now``;
    a channel thread behind its sockets holds the judgment at the last time it had read all."""
    import time

    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor.channel import ChannelServer
    from ptops.ops.supervisor.core import Supervisor
    from ptops.ops.supervisor.launcher import prepare_run
    from ptops.recipes.schema import load, resolve_path

    rec, _ = load("titan-tiny", [])
    sup = Supervisor(rec, prepare_run(rec, resolve_path("titan-tiny"), tmp_path / "run"), [])
    sup.server, sup.attempt = ChannelServer(), 1
    try:
        now = time.monotonic()
        mon = HangMonitor(2, now - 60, HangConfig(floor_s=5, ping_stale_s=100))
        for r in (0, 1):  # the last progress handled: the end of step 5, 6 s ago
            _steps(mon, r, 1, 5, now - 6.5, 0.1)
        assert mon.check(now) is not None  # judged at now, the queued progress unseen: false hang
        for k in range(200):  # the backlog: every message arrived in the last 1.5 s
            sup.server.inbox.put((None, {"t": "ping"}, now - 1.5 + k * 0.005))
        judge = sup.judge_time(now)
        assert judge == pytest.approx(now - 1.5) and mon.check(judge) is None
        sup.server.inbox.put((None, {"t": "ping"}, now))  # the backlog grows: worst of the episode
        assert sup.judge_time(now + 0.5) == pytest.approx(now - 1.5)  # still behind: said once
        (ev,) = [e for e in RunDir(tmp_path / "run").read_events() if e["kind"] == "inbox_behind"]
        assert ev["lag_s"] == pytest.approx(1.5, abs=0.01) and ev["queued"] == 200
        while not sup.server.inbox.empty():
            sup.server.inbox.get_nowait()
        t = time.monotonic()  # the channel thread waits in select: it has read everything
        assert sup.judge_time(t) == pytest.approx(t, abs=0.05) and not sup.inbox_behind
        # the episode closed, with how long it lasted and its worst (the exporter's gauge clears)
        events = RunDir(tmp_path / "run").read_events()
        (up,) = [e for e in events if e["kind"] == "inbox_caught_up"]
        assert up["why"] == "drained" and up["max_queued"] == 201
        assert up["max_lag_s"] == pytest.approx(2.0, abs=0.01)
        assert up["behind_s"] == pytest.approx(t - now, abs=0.05)
        # bytes still in the kernel (the thread's last pass read full buffers 3 s ago): judged
        # at the last time it had read everything, and said as a new episode (the thread is
        # stopped first: it would overwrite the two fields)
        sup.server.close()
        sup.server._idle, sup.server._caught_up = False, t - 3.0
        assert sup.judge_time(t) == pytest.approx(t - 3.0) and sup.inbox_behind
        sup.server._idle = True
        sup.inbox_caught_up(t + 1.0, "attempt_ended")  # what the attempt's end does while behind
        kinds = [e["kind"] for e in RunDir(tmp_path / "run").read_events()]
        assert kinds == ["inbox_behind", "inbox_caught_up"] * 2
        last = RunDir(tmp_path / "run").read_events()[-1]
        assert last["why"] == "attempt_ended" and last["behind_s"] == pytest.approx(1.0)
    finally:
        sup.server.close()


def test_behind_a_backlog_a_rank_silent_on_a_caught_up_connection_is_found_at_the_clock():
    from ptops.ops.runrecord.events import SPECS, EventKind

    """Under a backlog the check judges each rank at what its own connection has had handled:
    the node whose connection is read and empty is judged at the clock (silent: found), the
    ranks whose messages may wait in the queue at their connection's oldest arrival (not
    silent). Judged at one time for all (no ``judge``), the same three ranks look alike."""
    cfg = HangConfig(floor_s=5, ping_stale_s=4)
    now = 1000.0
    mon = HangMonitor(3, now - 60, cfg)
    for r in (0, 1, 2):
        _steps(mon, r, 1, 5, now - 6.5, 0.1)  # each rank's last message: 6 s ago
    behind = {0: now - 3.0, 1: now - 3.0, 2: now}  # ranks 0, 1: their messages since are queued
    found = mon.check(now, judge=behind.__getitem__)
    assert found is not None and found.ranks == [2] and found.why == "unresponsive"
    assert found.stalled == [2] and found.silent_s == pytest.approx(6.0)
    assert "behind_s" not in found.as_event(1)  # the loop sets it (attempt.py): the lag judged at
    ev = dataclasses.replace(found, behind_s=3.0).as_event(1)
    assert ev["behind_s"] == 3.0 and "behind_s" in SPECS[EventKind.HANG].optional
    assert mon.check(now - 3.0) is None  # the global rule: all judged at the oldest arrival
    alike = mon.check(now)  # all judged at the clock: every rank quiet, none told apart
    assert alike is not None and alike.ranks == [0, 1, 2] and alike.why != "unresponsive"


def test_a_connections_read_until_is_its_own_oldest_queued_message_or_unread_bytes():
    """``conn_read_until``: a connection's own queued messages (a relayed rank's count on its
    node's connection) and its own socket read full hold its time; another's do not."""
    from ptops.ops.supervisor.channel import Peer

    server = ChannelServer()
    server.close()  # the thread would overwrite the fields set below
    node, other = Peer(1, None, authed=True), Peer(2, None, authed=True)
    rank = Peer(3, None, authed=True, via=node, sub=0)
    now = time.monotonic()
    server._idle = True
    assert server.conn_read_until(rank, now) == now == server.conn_read_until(other, now)
    server._put((rank, {"t": "beat"}, now - 2.0))  # queued on the node's connection
    server._put((node, {"t": "_batch", "items": []}, now - 1.0))
    assert server.conn_read_until(rank, now) == now - 2.0 == server.conn_read_until(node, now)
    assert server.conn_read_until(other, now) == now
    server.took(rank, now - 2.0)  # handled, oldest first
    assert server.conn_read_until(rank, now) == now - 1.0
    server.took(None, now)  # a test's own entry: nothing to drop
    server.took(other, now - 5.0)  # not queued on that connection: nothing dropped
    assert server.conn_read_until(node, now) == now - 1.0
    server.took(node, now - 1.0)
    # the channel thread's last round read the node's socket full: held at the round before
    server._idle, server._round_t = False, now - 0.01
    server._full, node.caught_t = frozenset({id(node)}), now - 3.0
    assert server.conn_read_until(rank, now) == now - 3.0
    assert server.conn_read_until(other, now) == now - 0.01


def test_a_peers_rank_and_attempt_are_read_once_off_its_hello():
    """``Peer.key`` (what every message's check reads): set with the hello, however it is set;
    None for a node or control peer and for a hello whose numbers are no ints (its messages are
    then no rank's, instead of an error in the supervisor's loop)."""
    from ptops.ops.supervisor.channel import Peer
    from ptops.ops.supervisor.messages import _current_rank

    p = Peer(1, None, hello={"rank": "3", "attempt": 2})
    assert p.key == (3, 2) and p.rank == 3 and _current_rank(p, 2) and not _current_rank(p, 1)
    late = Peer(2, None)
    assert late.key is None and not _current_rank(late, 0)
    late.hello = {"role": "rank", "rank": 5, "attempt": 1}
    assert late.key == (5, 1) and _current_rank(late, 1)
    for hello in ({"role": "node", "rank": 1, "attempt": 1}, {"rank": [1], "attempt": 1},
                  {"rank": 1, "attempt": "x"}, {"attempt": 1}):  # fmt: skip
        assert Peer(3, None, hello=hello).key is None, hello


def test_a_nodes_lists_of_connections_are_remembered_until_its_connections_change():
    """``peers_of``: a relay names the same ~511 connections every step, so their peers are
    looked up once a list; a new hello or a connection gone makes the lists be looked up again."""
    from ptops.ops.supervisor.channel import ChannelServer, Peer, peers_of

    server = ChannelServer()
    try:
        node = Peer(1, None, hello={"role": "node", "node": "r", "attempt": 1}, authed=True)

        def hello(c: int) -> None:
            m = {"t": "hello", "role": "rank", "rank": c, "attempt": 1}
            server._relayed(node, {"t": "r", "c": c, "m": m}, 0.0)

        hello(1), hello(2)
        got = peers_of(node, [1, 2, 3])
        assert [p.rank for p in got] == [1, 2] and peers_of(node, [1, 2, 3]) is got
        hello(3)
        assert [p.rank for p in peers_of(node, [1, 2, 3])] == [1, 2, 3]
        server._relayed(node, {"t": "g", "c": 1}, 0.0)
        assert [p.rank for p in peers_of(node, [1, 2, 3])] == [2, 3]
        assert [p.rank for p in peers_of(node, [[1], 2, "3"])] == [2]  # no number: no peer
    finally:
        server.close()
