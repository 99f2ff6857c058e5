"""Supervisor pieces without training: restart policy, hang monitor, channel, injectors, lock, status."""

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
from ptops.ops.rank.channel import ChannelClient
from ptops.ops.supervisor.channel import ChannelServer
from ptops.ops.supervisor.policy import EXIT_FAILED, EXIT_NO_REQUEUE, Failure, PolicyConfig, RestartPolicy

# ---------------------------------------------------------------- policy


def test_backoff_doubles_without_progress_and_is_capped():
    p = RestartPolicy(PolicyConfig(backoff_s=1, backoff_max_s=5, storm_restarts=100, no_progress_attempts=100))
    delays = []
    for i in range(6):
        d = p.decide(Failure(ts=1000 * i, start_step=10, good_step=10, reason="x"))
        assert d.action == "restart"
        delays.append(d.delay_s)
    assert delays == [2, 4, 5, 5, 5, 5]
    # an attempt that made progress resets the backoff
    d = p.decide(Failure(ts=10_000, start_step=10, good_step=20, reason="x"))
    assert d.delay_s == 1


def test_storm_stops_with_do_not_requeue():
    p = RestartPolicy(PolicyConfig(storm_restarts=3, storm_window_s=60, no_progress_attempts=100))
    steps = iter(range(0, 1000, 10))
    def fail(ts):
        s = next(steps)
        return p.decide(Failure(ts=ts, start_step=s, good_step=s + 10, reason="boom"))
    assert fail(0).action == "restart"
    assert fail(100).action == "restart"  # first one is outside the window now
    assert fail(130).action == "restart"
    d = fail(150)  # 100, 130, 150 within 60 s
    assert d.action == "stop" and d.exit_code == EXIT_NO_REQUEUE and "storm" in d.reason and "boom" in d.reason


def test_no_progress_stops_after_k_attempts():
    p = RestartPolicy(PolicyConfig(no_progress_attempts=3, storm_restarts=100))
    assert p.decide(Failure(0, start_step=0, good_step=10)).action == "restart"  # made progress
    assert p.decide(Failure(100, start_step=10, good_step=10)).action == "restart"
    assert p.decide(Failure(200, start_step=10, good_step=10)).action == "restart"
    d = p.decide(Failure(300, start_step=10, good_step=10))
    assert d.action == "stop" and d.exit_code == EXIT_NO_REQUEUE and "no progress" in d.reason and "step 10" in d.reason


def test_max_restarts_is_plain_failure():
    p = RestartPolicy(PolicyConfig(max_restarts=2, storm_restarts=100, no_progress_attempts=100))
    for i in range(2):
        assert p.decide(Failure(1000 * i, start_step=i, good_step=i + 1)).action == "restart"
    d = p.decide(Failure(5000, start_step=2, good_step=3))
    assert d.action == "stop" and d.exit_code == EXIT_FAILED and "max_restarts=2" in d.reason


def test_policy_history_from_events():
    events = [
        {"kind": "launch", "ts": 1},
        {"kind": "restart", "ts": 10, "from_step": 5, "prev_from_step": 5, "reason": "crash"},
        {"kind": "restart", "ts": 20, "from_step": 5, "prev_from_step": 5, "reason": "crash"},
    ]
    p = RestartPolicy.from_events(PolicyConfig(no_progress_attempts=3, storm_restarts=100), events)
    assert p.no_progress_streak() == 2
    assert p.decide(Failure(30, start_step=5, good_step=5)).exit_code == EXIT_NO_REQUEUE


# ---------------------------------------------------------------- hang monitor


def _steps(mon, rank, first, last, t0, dt):
    t = t0
    for s in range(first, last + 1):
        mon.observe({"kind": "beat", "rank": rank, "step": s, "phase": "step", "stage": "begin", "ts": t})
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


def test_culprit_is_the_rank_behind():
    mon = HangMonitor(2, 0.0, HangConfig(floor_s=2, ping_stale_s=100))
    t = max(_steps(mon, r, 1, 7, 1.0, 0.1) for r in (0, 1))
    # rank 1 entered step 8 and waits in a collective; rank 0 hangs before step 8 begins
    mon.observe({"kind": "beat", "rank": 1, "step": 8, "phase": "step", "stage": "begin", "ts": t + 0.01})
    for k in range(1, 10):
        for r in (0, 1):
            mon.observe({"kind": "ping", "rank": r, "ts": t + k * 0.5})
    f = mon.check(t + 3)
    assert f.ranks == [0] and f.why == "behind" and f.step == 7 and f.silent_s == pytest.approx(3, abs=0.1)
    ev = f.as_event(attempt=2)
    assert ev["attempt"] == 2 and ev["ranks"] == [0] and ev["step"] == 7


def test_exited_rank_is_not_watched():
    mon = HangMonitor(2, 0.0, HangConfig(floor_s=2, ping_stale_s=100, total_steps=5, checkpoint_s=30))
    t = max(_steps(mon, r, 1, 5, 1.0, 0.1) for r in (0, 1))
    mon.observe({"kind": "exit", "rank": 1, "ts": t})
    for k in range(1, 40):
        mon.observe({"kind": "ping", "rank": 0, "ts": t + k})
    assert mon.check(t + 10) is None  # rank 0 is finishing (final save): checkpoint budget
    assert mon.check(t + 31) is not None


# ---------------------------------------------------------------- channel


def test_channel_roundtrip_and_auth():
    server = ChannelServer()
    try:
        got = []
        client = ChannelClient(server.address(), server.token, {"role": "rank", "rank": 3, "attempt": 1}, on_message=got.append)
        client.send({"t": "beat", "step": 1})
        peer, hello, _ = server.inbox.get(timeout=5)
        assert hello["t"] == "_hello" and hello["rank"] == 3 and "token" not in hello
        assert server.inbox.get(timeout=5)[1] == {"t": "beat", "step": 1}
        server.send(peer, {"cmd": "stacks", "id": 1})
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [{"cmd": "stacks", "id": 1}]
        # a wrong token is dropped without an answer and never reaches the inbox
        bad = ChannelClient(server.address(), "wrong", {"role": "rank", "rank": 9})
        bad.send({"t": "beat", "step": 99})
        time.sleep(0.3)
        assert server.inbox.empty()
        client.close()
        assert server.inbox.get(timeout=5)[1] == {"t": "_eof"}
    finally:
        server.close()


def test_probe_dies_when_supervisor_channel_closes(tmp_path):
    """The rank-side half of 'no orphans': channel EOF -> the rank kills itself."""
    server = ChannelServer()
    code = (
        "import time\n"
        "from ptops.ops.rank.probe import Probe\n"
        f"p = Probe({str(tmp_path)!r}, 0, 1, channel={server.address()!r}, token={server.token!r}, heartbeat_s=0.2)\n"
        "p.startup()\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        server.inbox.get(timeout=30)
        server.close()
        assert proc.wait(timeout=15) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------- injectors


def test_injector_fires_once_at_its_step_and_emits_first():
    emitted = []
    inj = Injector([parse("nan:step=3"), parse("slow:rank=0,step=2,seconds=0.05,steps=2"), parse("crash:rank=1,step=2")], 0, 1, lambda f, s: emitted.append((f.kind, s)))
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
    inj = Injector([parse("enospc:step=5"), parse("corrupt-ckpt:step=10")], 0, 1, lambda f, s: None, run_dir=tmp_path)
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
        f"p = Probe({str(tmp_path)!r}, 1, 1, faults={json.dumps(json.dumps([parse('crash:rank=1,step=2').to_dict()]))})\n"
        "p.before_step(1); p.before_step(2); print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout
    ev = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev[0]["kind"] == "fault_injected" and ev[0]["rank"] == 1 and ev[0]["step"] == 2


# ---------------------------------------------------------------- lock and status


def test_lock_is_exclusive_and_dies_with_holder(tmp_path):
    from ptops.ops.supervisor.lock import LockedError, acquire, holder, release

    fd = acquire(tmp_path)
    assert holder(tmp_path) == os.getpid()
    code = f"from ptops.ops.supervisor.lock import acquire; acquire({str(tmp_path)!r}, wait_s=0.2)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "already supervised by pid" in proc.stderr
    release(fd)
    assert holder(tmp_path) is None
    # a holder killed with SIGKILL releases it
    p = subprocess.Popen([sys.executable, "-c", f"from ptops.ops.supervisor.lock import acquire; acquire({str(tmp_path)!r}); import time; print('ok', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ok"
    with pytest.raises(LockedError):
        acquire(tmp_path, wait_s=0.1)
    p.kill()
    p.wait()
    release(acquire(tmp_path, wait_s=2))


def test_status_marks_a_dead_supervisor(tmp_path, ptops):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.runrecord.status import write_status

    run = RunDir(tmp_path / "run").create()
    run.event("launch", attempt=1, supervised=True)
    write_status(run, {"state": "running", "step": 3, "attempt": 1, "supervisor_pid": 999999, "ranks": [{"rank": 0, "pid": 5, "host": "h"}]})
    proc = ptops("status", str(run.path), "--json", check=True)
    s = json.loads(proc.stdout)
    assert s["state"] == "dead" and s["supervisor_pid"] is None and s["ranks"] == [] and "resume" in s["hint"]
    assert oct(os.stat(run.path / "status.json").st_mode & 0o777) == "0o600"
    bad = ptops("status", str(tmp_path / "nope"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_recipe_supervisor_section_validates(ptops):
    from ptops.recipes.schema import RecipeError, load

    rec, _ = load("titan-tiny", ["supervisor.hang_floor_s=5"])
    assert rec.supervisor.hang_floor_s == 5 and rec.supervisor.channel_host == "127.0.0.1"
    with pytest.raises(RecipeError, match="supervisor.hang_floor_s"):
        load("titan-tiny", ["supervisor.hang_floor_s=-1"])
    with pytest.raises(RecipeError, match="supervisor.bogus"):
        load("titan-tiny", ["supervisor.bogus=1"])


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


def _sup_with_log(tmp_path, text, first_bad=None):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor.core import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.run = RunDir(tmp_path)
    sup.run.logs(1).mkdir(parents=True)
    (sup.run.logs(1) / "torchrun.log").write_text(text)
    sup.first_bad = first_bad
    sup.proc = None
    return sup


def test_root_cause_is_not_torchruns_sigtermed_survivor(tmp_path):
    """torchrun blames the rank with the earliest error file; the SIGKILLed rank never writes one."""
    assert _sup_with_log(tmp_path, TORCHRUN_FAILURES)._root_cause(1) == (1, -9, "torchrun")


def test_root_cause_prefers_the_channel(tmp_path):
    sup = _sup_with_log(tmp_path, TORCHRUN_FAILURES, first_bad=(1, None, "channel closed without goodbye"))
    assert sup._root_cause(1) == (1, -9, "channel closed without goodbye")


def test_killed_rank_beats_the_peer_whose_error_it_caused(tmp_path):
    sup = _sup_with_log(tmp_path, TORCHRUN_FAILURES)
    sup._note_bad(0, 1, "goodbye", 100.0)  # rank 0: "connection closed by peer"
    sup._note_bad(1, None, "channel closed without goodbye", 100.05)  # rank 1 was SIGKILLed
    assert sup._root_cause(1) == (1, -9, "channel closed without goodbye")


def test_late_silent_exit_does_not_steal_the_blame(tmp_path):
    sup = _sup_with_log(tmp_path, TORCHRUN_FAILURES)
    sup._note_bad(0, 1, "goodbye", 100.0)  # rank 0 raised a real error
    sup._note_bad(1, None, "channel closed without goodbye", 101.5)  # rank 1 SIGTERMed by torchrun later
    assert sup._root_cause(1)[0] == 0
