"""Fault injectors' trigger logic (right rank / step / attempt, once) and the chaos runner's pure
parts.

No training here: effects that would end the process (os.kill, os._exit) are
replaced by recorders; sleeps are recorded instead of slept.
"""

from __future__ import annotations

import errno
import json
import signal

import pytest

from ptops.faultinject import chaos, inject
from ptops.faultinject.inject import Injector, corrupt_checkpoint, pick_victim
from ptops.faultinject.spec import FaultSpecError, parse


class Effects:
    def __init__(self, monkeypatch):
        self.kills: list[tuple[int, int]] = []
        self.exits: list[int] = []
        self.sleeps: list[float] = []
        monkeypatch.setattr(inject.os, "kill", lambda pid, sig: self.kills.append((pid, sig)))
        monkeypatch.setattr(inject.os, "_exit", self._exit)
        monkeypatch.setattr(inject.time, "sleep", lambda s: self.sleeps.append(s))

    def _exit(self, code):
        self.exits.append(code)
        raise SystemExit(code)


@pytest.fixture
def fx(monkeypatch):
    return Effects(monkeypatch)


def make(specs, rank=0, attempt=1, run_dir=None):
    fired = []
    inj = Injector(
        [parse(s) for s in specs],
        rank,
        attempt,
        lambda f, step: fired.append((f.kind, step)),
        run_dir=run_dir,
    )
    return inj, fired


def drive(inj, steps=range(1, 11)):
    """Run the hooks the way an adapter does: before_step, poison, checkpoint every 4 steps."""
    poisoned = []
    for s in steps:
        inj.before_step(s)
        if inj.should_poison(s):
            poisoned.append(s)
        if s % 4 == 0:
            try:
                inj.on_checkpoint(s)
            except OSError:
                pass
            inj.after_checkpoint(s)
    return poisoned


# ------------------------------------------------------------ spec additions
def test_new_kinds_parse_and_reject_bad_keys():
    f = parse("kill-supervisor:step=4")
    assert (f.kind, f.step, f.rank, f.attempt) == ("kill-supervisor", 4, None, 1)
    f = parse("corrupt-ckpt:step=8,mode=flip,rank=1")
    assert f.params == {"mode": "flip"} and f.rank == 1
    for bad, words in (
        ("corrupt-ckpt:step=8,mode=shred", ["key 'mode'", "truncate, flip"]),
        ("kill-supervisor:step=4,rank=1", ["key 'rank'", "unknown key for kill-supervisor"]),
        ("kill-supervisor", ["key 'step'", "missing"]),
        ("oom:step=2,seconds=3", ["key 'seconds'", "unknown key for oom"]),
        ("enospc:step=x", ["key 'step'", "integer"]),
    ):
        with pytest.raises(FaultSpecError) as e:
            parse(bad)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ------------------------------------------------------------ trigger logic
def test_crash_in_save_fires_only_in_the_save_of_its_step(fx):
    """``crash:phase=save`` ignores the step's start and the checkpoint phase; it kills at
    ``in_save`` of its step, once, on its rank only."""
    inj, fired = make(["crash:phase=save,rank=1,step=8"], rank=1)
    other, other_fired = make(["crash:phase=save,rank=1,step=8"], rank=0)
    for s in range(1, 9):
        inj.before_step(s)
        other.before_step(s)
        if s % 4 == 0:
            inj.on_checkpoint(s)
            other.on_checkpoint(s)
            if s == 4:
                inj.in_save(s)
            assert fired == [] and fx.kills == []
    other.in_save(8)
    assert other_fired == [] and fx.kills == []
    with pytest.raises(SystemExit):  # the recorded kill "returns": the injector falls back to _exit
        inj.in_save(8)
    assert fired == [("crash", 8)] and [sig for _, sig in fx.kills] == [signal.SIGKILL]
    inj.in_save(8)
    assert len(fx.kills) == 1


def test_plain_crash_does_not_fire_in_the_save(fx):
    inj, fired = make(["crash:step=8"])
    inj.in_save(8)
    assert fired == [] and fx.kills == []
    with pytest.raises(SystemExit):
        inj.before_step(8)
    assert fired == [("crash", 8)]


@pytest.mark.parametrize("kind", ["crash", "hang", "slow", "oom"])
def test_before_step_kinds_fire_at_their_rank_step_attempt_only(fx, kind):
    spec = f"{kind}:rank=1,step=5" + (",seconds=0.01" if kind in ("hang", "slow") else "")
    for rank, attempt, expect in ((0, 1, []), (1, 2, []), (1, 1, [(kind, 5)])):
        inj, fired = make([spec], rank=rank, attempt=attempt)
        try:
            drive(inj)
        except (
            SystemExit,
            MemoryError,
            RuntimeError,
        ) as e:  # torch.OutOfMemoryError is a RuntimeError
            assert kind in ("crash", "oom"), e
            assert inj.pending == []
        assert fired == expect, (rank, attempt)


def test_crash_kills_itself_with_sigkill_or_exits_with_code(fx):
    inj, fired = make(["crash:step=3"])
    with pytest.raises(
        SystemExit
    ):  # the recorded SIGKILL did not kill: the injector falls back to _exit(1)
        drive(inj, range(1, 6))
    assert fired == [("crash", 3)] and fx.kills[0][1] == signal.SIGKILL and fx.exits == [1]
    fx.exits.clear()
    inj, _ = make(["crash:step=2,code=7"])
    with pytest.raises(SystemExit):
        drive(inj, range(1, 4))
    assert fx.exits == [7]


def test_oom_raises_torch_out_of_memory_error(fx):
    torch = pytest.importorskip("torch")
    inj, fired = make(["oom:step=2"])
    inj.before_step(1)
    with pytest.raises(torch.OutOfMemoryError, match="injected fault oom"):
        inj.before_step(2)
    inj.before_step(2)  # once only
    assert fired == [("oom", 2)]


def test_slow_sleeps_for_its_steps_then_stops(fx):
    inj, fired = make(["slow:step=3,seconds=0.25,steps=3"])
    drive(inj, range(1, 9))
    assert fired == [("slow", 3)] and fx.sleeps == [0.25, 0.25, 0.25]


def test_nan_poisons_one_step_on_every_rank_by_default(fx):
    for rank in (0, 1):
        inj, fired = make(["nan:step=6"], rank=rank)
        assert drive(inj) == [6] and fired == [("nan", 6)]
    inj, _ = make(["nan:step=6,attempt=2"], attempt=1)
    assert drive(inj) == []
    inj, _ = make(["nan:step=6,attempt=0"], attempt=5)
    assert drive(inj) == [6]


def test_enospc_raises_from_on_checkpoint_once(fx):
    inj, fired = make(["enospc:step=8"], rank=1)
    inj.on_checkpoint(4)
    with pytest.raises(OSError) as e:
        inj.on_checkpoint(8)
    assert e.value.errno == errno.ENOSPC and "injected fault enospc" in str(e.value)
    inj.on_checkpoint(8)  # the retry (or the next save) goes through
    assert fired == [("enospc", 8)]
    inj, fired = make(["enospc:step=8,rank=0"], rank=1)
    inj.on_checkpoint(8)
    assert fired == []


@pytest.mark.parametrize("kind", ["preempt", "kill-supervisor"])
def test_job_level_kinds_are_carried_out_by_rank_0_only(fx, monkeypatch, kind):
    monkeypatch.setenv("PTOPS_SUPERVISOR_PID", "424242")
    inj1, fired1 = make([f"{kind}:step=4"], rank=1)
    drive(inj1)
    assert fired1 == [] and fx.kills == []
    inj0, fired0 = make([f"{kind}:step=4"], rank=0)
    drive(inj0)
    expect = signal.SIGTERM if kind == "preempt" else signal.SIGKILL
    assert fired0 == [(kind, 4)] and fx.kills == [(424242, expect)]


def test_kill_supervisor_without_supervisor_is_a_no_op(fx, monkeypatch):
    monkeypatch.delenv("PTOPS_SUPERVISOR_PID", raising=False)
    inj, fired = make(["kill-supervisor:step=2"])
    drive(inj, range(1, 4))
    assert fired == [("kill-supervisor", 2)] and fx.kills == []


def _fake_dcp(root, step, sizes=(4000, 3000)):
    d = root / "checkpoints" / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m" * 100)
    for r, n in enumerate(sizes):
        (d / f"__{r}_0.distcp").write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
    (d / "ptops-manifest.json").write_text("{}" + " " * 10000)
    return d


def test_corrupt_ckpt_fires_after_the_save_of_its_step_on_rank_0(fx, tmp_path):
    d4, d8 = _fake_dcp(tmp_path, 4), _fake_dcp(tmp_path, 8)
    inj1, fired1 = make(["corrupt-ckpt:step=8"], rank=1, run_dir=tmp_path)
    drive(inj1)
    assert fired1 == [] and (d8 / "__1_0.distcp").stat().st_size == 3000
    inj, fired = make(["corrupt-ckpt:step=8"], rank=0, run_dir=tmp_path)
    inj.after_checkpoint(8)  # no save of step 8 seen yet: nothing
    assert fired == []
    drive(inj)
    assert fired == [("corrupt-ckpt", 8)]
    assert (d8 / "__0_0.distcp").stat().st_size == 2000  # truncated to half
    assert (d4 / "__0_0.distcp").stat().st_size == 4000  # other checkpoints untouched
    assert (d8 / "ptops-manifest.json").stat().st_size > 10000  # never the manifest


def test_corrupt_modes_and_victim_choice(tmp_path):
    d = _fake_dcp(tmp_path, 8)
    assert pick_victim(d, 1).name == "__1_0.distcp"
    before = (d / "__1_0.distcp").read_bytes()
    victim = corrupt_checkpoint(tmp_path, 8, rank=1, mode="flip")
    after = victim.read_bytes()
    assert victim.name == "__1_0.distcp" and len(after) == len(before)
    diff = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(diff) == inject.FLIP_BYTES and all(after[i] == before[i] ^ 0xFF for i in diff)
    trl = tmp_path / "checkpoints" / "checkpoint-4"
    trl.mkdir()
    (trl / "model.safetensors").write_bytes(b"a" * 500)
    (trl / "optimizer.pt").write_bytes(b"b" * 900)
    assert (
        corrupt_checkpoint(tmp_path, 4).name == "optimizer.pt"
        and (trl / "optimizer.pt").stat().st_size == 450
    )
    assert corrupt_checkpoint(tmp_path, 99) is None


def test_live_fault_fires_at_next_opportunity_once(fx):
    inj, fired = make([])
    for s in (1, 2, 3):
        inj.before_step(s)
    assert inj.add(parse("slow:step=2,seconds=0.1"))  # step 2 is past: fires at the next step
    inj.before_step(4)
    inj.before_step(5)
    assert fired == [("slow", 4)]
    assert not make([], rank=1)[0].add(parse("kill-supervisor:step=1"))
    assert not make([], rank=1)[0].add(parse("crash:rank=0,step=1"))


# ------------------------------------------------------------ chaos runner, pure parts
def test_select_scenarios():
    names = [s.name for s in chaos.select()]
    assert (
        len(names) == 4 * 12 + 2  # every kind on 4 recipes, the grader seam's 2 on GRPO
        and "titan-tiny/kill-supervisor" in names
        and "trl-dpo-tiny/bitflip-grad" in names
        and "trl-grpo-tiny/preempt" in names
        and "trl-grpo-tiny/grader-crash" in names
        and "trl-sft-tiny/grader-crash" not in names
    )
    assert {n.split("/")[0] for n in names} == {
        "titan-tiny",
        "trl-sft-tiny",
        "trl-dpo-tiny",
        "trl-grpo-tiny",
    }
    for recipe in ("titan-tiny", "trl-sft-tiny", "trl-dpo-tiny", "trl-grpo-tiny"):
        sc = chaos.select([], [f"{recipe}/crash-in-save"])[0]
        assert sc.faults == ("crash:phase=save,rank=1,step=8",) and sc.detect == ("crash",)
        assert sc.faults[0] and parse(sc.faults[0]).step % chaos.INTERVAL == 0  # a step that saves
    assert [s.name for s in chaos.select(["trl-sft-tiny"])] == [
        f"trl-sft-tiny/{k}" for k in chaos.TRL_KINDS
    ]
    sc = chaos.select([], ["titan-tiny/crash:rank=0,step=3"])
    assert sc[0].faults == ("crash:rank=0,step=3",) and sc[0].detect == ("crash",)
    assert [s.name for s in chaos.select(["titan-tiny", "trl-sft-tiny"], ["hang"])] == [
        "titan-tiny/hang",
        "trl-sft-tiny/hang",
    ]
    for bad in ("titan-tiny/explode", "titan-tiny/crash:stp=3", "titan-tiny/"):
        with pytest.raises(chaos.ScenarioError):
            chaos.select([], [bad])
    argv = chaos.select([], ["titan-tiny/corrupt-ckpt"])[0].launch_argv(chaos.Path("/r"))
    assert argv.count("--fault") == 2 and "--supervise" in argv and "train.steps=12" in argv


def test_analyze_timings_and_data_checks():
    ev = [
        {"ts": 100.0, "kind": "launch", "attempt": 1},
        {
            "ts": 110.0,
            "kind": "fault_injected",
            "fault": "crash:rank=1,step=6",
            "rank": 1,
            "step": 6,
            "attempt": 1,
        },
        {"ts": 111.5, "kind": "crash", "attempt": 1, "rank": 1},
        {"ts": 112.0, "kind": "restart", "attempt": 2, "from_step": 4},
        {"ts": 130.0, "kind": "completed", "step": 8},
    ]
    m = [{"step": s, "rank": 0, "attempt": 1, "loss": 1.0, "ts": 100.0 + s} for s in range(1, 6)]
    m += [{"step": s, "rank": 0, "attempt": 2, "loss": 1.0, "ts": 120.0 + s} for s in range(5, 9)]
    m += [{"step": s, "rank": 1, "attempt": 2, "loss": 1.0, "ts": 120.0 + s} for s in range(5, 9)]
    a = chaos.analyze(ev, m, 8, ("crash",))
    assert a["fired"] and a["detected_by"] == "crash" and a["detect_s"] == 1.5
    assert a["recover_s"] == 15.0 and a["steps_recomputed"] == 1 and a["restarts"] == 1
    assert a["state"] == "completed" and a["missing_steps"] == [] and a["final_step"] == 8
    m[-5]["loss"] = "nan"  # rank 0's final record of step 8
    a = chaos.analyze(ev, m[:3] + m[4:], 8, ("hang",))
    assert a["missing_steps"] == [4] and a["nonfinite_steps"] == [8] and a["detected_by"] is None
    assert chaos._ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    assert not chaos.analyze([], [], 8, ("crash",))["fired"]


def test_a_cold_restart_of_a_run_with_a_warm_pool_is_a_chaos_problem():
    """Issue 27: the crash scenarios run with ``warm_spare=true`` and fail when a restart went cold
    because the pool was gone or never ready; a first launch (or a relaunched supervisor's) is cold
    by design."""
    assert "supervisor.restart.warm_spare=true" in chaos.select([], ["titan-tiny/crash"])[
        0
    ].launch_argv(chaos.Path("/r"))
    cold1 = {
        "ts": 1.0,
        "kind": "launch",
        "attempt": 1,
        "warm_pool": True,
        "ranks_from": "cold",
        "cold_why": "pool_not_started",
    }
    warm2 = {
        "ts": 2.0,
        "kind": "launch",
        "attempt": 2,
        "warm_pool": True,
        "ranks_from": "warm",
        "warm_wait_s": 0.0,
    }
    a = chaos.analyze([cold1, warm2], [], 8, ("crash",))
    assert a["ranks_from"] == ["cold", "warm"] and a["cold_restarts"] == []
    gone = dict(
        warm2,
        ranks_from="cold",
        cold_why="pool_exited",
        cold_detail="the pool exited with code -9: ...",
    )
    a = chaos.analyze([cold1, gone], [], 8, ("crash",))
    assert a["ranks_from"] == ["cold", "cold"] and len(a["cold_restarts"]) == 1
    assert "attempt 2" in a["cold_restarts"][0] and "pool_exited" in a["cold_restarts"][0]
    off = [dict(e, warm_pool=False, ranks_from="cold", cold_why="no_pool") for e in (cold1, warm2)]
    assert chaos.analyze(off, [], 8, ("crash",))["cold_restarts"] == []


def test_fault_spec_error_names_the_spec_in_chaos_cli(ptops):
    proc = ptops("chaos", "--scenario", "titan-tiny/crash:step=zero", "--list")
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip().count("\n") == 0
        and "key 'step'" in proc.stderr
        and "integer" in proc.stderr
    )
    listed = ptops("chaos", "--list", "--recipe", "trl-sft-tiny", check=True).stdout
    assert json.dumps("trl-sft-tiny/preempt")[1:-1] in listed


def test_corrupt_waits_for_an_async_save_to_commit(fx, tmp_path):
    """A save still writing (``.writing`` marker) is damaged only once committed, off the training
    thread."""
    import threading

    d = _fake_dcp(tmp_path, 8)
    (d / ".writing").write_text("")
    inj, fired = make(["corrupt-ckpt:step=8,mode=truncate"], run_dir=tmp_path)
    inj.on_checkpoint(8)
    inj.after_checkpoint(8)
    assert fired == [("corrupt-ckpt", 8)] and (d / "__0_0.distcp").stat().st_size == 4000  # not yet
    (d / ".writing").unlink()
    for t in threading.enumerate():
        if t.name == "ptops-corrupt":
            t.join(timeout=10)
    assert (d / "__0_0.distcp").stat().st_size == 2000


def test_every_rank_agrees_on_a_sync_save_for_corrupt_ckpt(fx, tmp_path):
    """Rank 0 corrupts, rank 1 does not; both must want the save of step 8 synchronous, and neither
    after it."""
    _fake_dcp(tmp_path, 8)
    ranks = [make(["corrupt-ckpt:step=8"], rank=r, run_dir=tmp_path)[0] for r in (0, 1)]
    live = [make([], rank=r, run_dir=tmp_path)[0] for r in (0, 1)]
    for inj in live:
        inj.add(parse("corrupt-ckpt:step=5"))  # live: the next save at or after step 5
    for step in (4, 8, 12):
        for group in (ranks, live):
            answers = [inj.sync_save_wanted(step) for inj in group]
            assert answers == [step == 8] * 2, (step, answers)
            assert [bool(inj.pending) for inj in group] == [step <= 8] * 2
            for inj in group:
                inj.on_checkpoint(step)
                inj.after_checkpoint(step)


def test_chaos_junit_is_valid_junit_with_one_case_per_scenario(tmp_path):
    """`ptops chaos --junit`: parsed back by a JUnit XML parser (what CI systems use)."""
    from junitparser import Failure, JUnitXml

    from ptops.faultinject.junit import to_junit

    report = {
        "work_dir": "/tmp/chaos",
        "passed": False,
        "wall_s": 98.5,
        "baselines": {"titan-tiny": {"digest": "abc123", "run_dir": "x"}},
        "scenarios": [
            {
                "scenario": "titan-tiny/crash",
                "recipe": "titan-tiny",
                "kind": "crash",
                "faults": ["crash:rank=1,step=6"],
                "passed": True,
                "problems": [],
                "detect_s": 1.3,
                "recover_s": 8.7,
                "steps_recomputed": 1,
                "detected_by": "crash",
                "digest_equal": True,
                "wall_s": 40.2,
                "run_dir": "/tmp/chaos/a",
            },
            {
                "scenario": "titan-tiny/hang",
                "recipe": "titan-tiny",
                "kind": "hang",
                "faults": ["hang:rank=0,step=6"],
                "passed": False,
                "problems": ['digest <differs> & "final" step 11 != 12'],
                "detect_s": None,
                "recover_s": None,
                "digest_equal": False,
                "wall_s": 58.3,
                "run_dir": "/tmp/chaos/b",
            },
        ],
    }
    path = tmp_path / "junit.xml"
    path.write_text(to_junit(report))
    xml = JUnitXml.fromfile(str(path))
    suites = list(xml)
    assert len(suites) == 1
    suite = suites[0]
    assert suite.tests == 2 and suite.failures == 1
    cases = {c.name: c for c in suite}
    assert set(cases) == {"titan-tiny/crash", "titan-tiny/hang"}
    assert (
        cases["titan-tiny/crash"].is_passed
        and cases["titan-tiny/crash"].classname == "ptops.chaos.titan-tiny"
    )

    def props(
        case,
    ) -> dict[str, str]:  # testcase-level <properties> (pytest's record_property shape)
        return {p.get("name"): p.get("value") for p in case._elem.iter("property")}

    assert (
        props(cases["titan-tiny/crash"])["detect_s"] == "1.3"
        and props(cases["titan-tiny/crash"])["recover_s"] == "8.7"
    )
    assert props(cases["titan-tiny/crash"])["digest_equal"] == "true"
    assert "recover_s" not in props(cases["titan-tiny/hang"])  # unknown: left out, not "None"
    (failure,) = [r for r in cases["titan-tiny/hang"].result if isinstance(r, Failure)]
    assert failure.message == 'digest <differs> & "final" step 11 != 12'
    assert cases["titan-tiny/hang"].time == 58.3
