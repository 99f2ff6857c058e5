"""Fault-spec parser: the design grammar, and one clear error per bad spec."""

import pytest

from ptops.faultinject.spec import Fault, FaultSpecError, format_spec, from_env, parse, to_env


def test_design_examples():
    f = parse("crash:rank=1,step=12")
    assert (f.kind, f.rank, f.step, f.attempt) == ("crash", 1, 12, 1)
    f = parse("hang:rank=0,step=8")
    assert (f.kind, f.rank, f.step) == ("hang", 0, 8)
    f = parse("slow:rank=1,step=5,seconds=0.5")
    assert f.params == {"seconds": 0.5}
    f = parse("nan:step=10")
    assert f.rank is None and f.applies(0, 1) and f.applies(3, 1)
    for spec in ("corrupt-ckpt:step=10", "enospc:step=10", "preempt:step=10", "oom:rank=0,step=7"):
        assert parse(spec).kind == spec.split(":")[0]


def test_crash_in_save_parses_and_round_trips():
    f = parse("crash:phase=save,rank=1,step=6")
    assert (f.kind, f.step, f.rank, f.params) == ("crash", 6, 1, {"phase": "save"})
    assert from_env(to_env([f]))[0].params == {"phase": "save"}
    assert parse(format_spec(f)) == parse("crash:step=6,rank=1,phase=save")


def test_attempt_rules():
    assert parse("crash:step=3").applies(0, 1) and not parse("crash:step=3").applies(0, 2)
    f = parse("crash:step=3,attempt=2")
    assert f.applies(0, 2) and not f.applies(0, 1)
    f = parse("crash:step=3,attempt=0")
    assert f.applies(0, 1) and f.applies(0, 7)
    assert not parse("crash:rank=1,step=3").applies(0, 1)


def test_roundtrip_env_and_format():
    faults = [
        parse("crash:rank=1,step=12"),
        parse("slow:step=2,seconds=0.25,steps=3"),
        parse("crash:step=2,signal=term"),
    ]
    assert from_env(to_env(faults)) == faults
    assert parse(format_spec(faults[1])) == Fault(
        "slow", 2, None, 1, {"seconds": 0.25, "steps": 3}, format_spec(faults[1])
    )
    assert faults[2].params["signal"] == "SIGTERM"
    assert from_env("") == [] and from_env(None) == []


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", ["empty spec"]),
        ("explode:step=1", ["unknown kind 'explode'", "crash"]),
        ("crash", ["key 'step'", "missing"]),
        ("crash:", ["nothing after ':'"]),
        ("crash:rank=1", ["key 'step'", "missing"]),
        ("crash:step=x", ["key 'step'", "integer", "'x'"]),
        ("crash:step=3,rank=one", ["key 'rank'", "integer"]),
        ("slow:step=3,seconds=fast", ["key 'seconds'", "number"]),
        ("crash:step=3,color=red", ["key 'color'", "unknown key for crash", "step, rank"]),
        ("crash:step=3,step=4", ["key 'step'", "given twice"]),
        ("crash:step=0", ["key 'step'", ">= 1"]),
        ("crash:step=3,rank=-1", ["key 'rank'", ">= 0"]),
        ("crash:step=3,attempt=-2", ["key 'attempt'", ">= 0"]),
        ("crash:step", ["bad item 'step'", "key=value"]),
        ("crash:step=3,,rank=1", ["bad item ''"]),
        ("hang:step=3,mode=spin", ["key 'mode'", "sleep, stop"]),
        ("crash:step=3,signal=BOGUS", ["key 'signal'", "unknown signal"]),
        ("crash:step=3,code=2,signal=TERM", ["give one, not both"]),
        ("crash:step=3,phase=load", ["key 'phase'", "step, save", "'load'"]),
        (
            "hang:step=3,phase=save",
            ["key 'phase'", "expected one of step, import, rendezvous, build, load"],
        ),
        ("hang:step=3,phase=build", ["key 'step'", "start-up hang (phase=build) has no step"]),
        ("slow:step=3,seconds=-1", ["key 'seconds'", ">= 0"]),
        ("preempt:step=3,rank=1", ["key 'rank'", "unknown key for preempt"]),
        ("slow-save:step=2,until=later", ["key 'until'", "skipped", "'later'"]),
        ("slow-save:until=skipped", ["key 'step'", "missing"]),
        ("misrendezvous:rank=1,step=3", ["key 'step'", "unknown key for misrendezvous"]),
        ("clock-skew:offset_s=5", ["key 'node'", "missing", "clock-skew:node=n2"]),
        ("clock-skew:node=n2,step=3", ["key 'step'", "unknown key for clock-skew"]),
        ("clock-skew:node=n2,offset_s=late", ["key 'offset_s'", "number"]),
    ],
)
def test_bad_specs_give_one_clear_line(spec, words):
    with pytest.raises(FaultSpecError) as exc:
        parse(spec)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"fault {spec!r}:") or spec == ""
    for w in words:
        assert w in msg, (w, msg)


def test_cli_rejects_bad_fault_with_exit_2(ptops):
    proc = ptops("launch", "titan-tiny", "--supervise", "--fault", "crash:rank=1", "--dry-run")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--fault" in lines[0] and "key 'step'" in lines[0]


def test_slow_save_and_misrendezvous_parse_and_round_trip():
    f = parse("slow-save:step=2,until=skipped")
    assert (f.kind, f.step, f.rank, f.params) == ("slow-save", 2, None, {"until": "skipped"})
    assert parse(format_spec(f)) == f
    m = parse("misrendezvous:rank=1")
    assert (m.kind, m.rank, m.attempt, m.params) == ("misrendezvous", 1, 1, {})
    assert format_spec(m) == "misrendezvous:rank=1" and from_env(to_env([m])) == [m]


def test_clock_skew_is_a_node_fault_of_every_attempt_and_needs_slurm(ptops):
    from ptops.faultinject.spec import parse_live

    f = parse("clock-skew:node=n2")
    assert (f.kind, f.rank, f.attempt, f.params) == (
        "clock-skew", None, 0, {"node": "n2", "offset_s": 30.0}
    )  # fmt: skip
    assert parse(format_spec(f)) == Fault(f.kind, f.step, None, 0, f.params, format_spec(f))
    with pytest.raises(FaultSpecError, match="at launch only"):
        parse_live("clock-skew:node=n2")
    proc = ptops(
        "launch", "titan-tiny", "--supervise", "--fault", "clock-skew:node=n2", "--dry-run"
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "add --slurm" in lines[0] and "clock-skew:node=n2" in lines[0]


def test_misrendezvous_is_launch_only():
    """It acts before the first step: injected live it could never fire, so ``ptops inject`` refuses
    it."""
    from ptops.faultinject.spec import parse_all, parse_live

    assert parse_all(["misrendezvous:rank=1"])[0].kind == "misrendezvous"
    with pytest.raises(FaultSpecError, match="at launch only"):
        parse_live("misrendezvous:rank=1")
    assert parse_live("slow-save:step=4").kind == "slow-save"


def test_misrendezvous_rewrites_the_rendezvous_env_at_import_only(monkeypatch):
    import os

    from ptops.faultinject.inject import Injector

    env = {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fired = []
    other = Injector([parse("misrendezvous:rank=1")], 0, 1, lambda f, s: fired.append(f.kind))
    other.on_startup("import")
    assert os.environ["WORLD_SIZE"] == "2" and fired == []  # rank 0 is not named
    inj = Injector([parse("misrendezvous:rank=1")], 1, 1, lambda f, s: fired.append(f.kind))
    inj.on_startup("build")
    assert (
        os.environ["WORLD_SIZE"] == "2" and fired == []
    )  # it acts before the engine's import only
    inj.on_startup("import")
    assert fired == ["misrendezvous"]
    got = [os.environ[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")]
    assert got == ["1", "0", "0", "127.0.0.1"]
    assert os.environ["MASTER_PORT"] != "29500" and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    assert inj.pending == []


def test_slow_save_until_skipped_waits_for_a_later_skip():
    """The commit of the save of step 2 waits until a later save is skipped (also one skipped before
    the wait began); a skip of an earlier step does not end it; without ``until`` it waits its
    seconds."""
    import threading
    import time

    from ptops.faultinject.inject import Injector

    fired = []
    inj = Injector(
        [parse("slow-save:step=2,until=skipped,seconds=30")], 0, 1, lambda f, s: fired.append(s)
    )
    inj.before_commit(1)
    assert fired == []  # not its step
    t = threading.Thread(target=inj.before_commit, args=(2,))
    t.start()
    inj.on_skip(1)
    t.join(0.5)
    assert t.is_alive() and fired == [2]
    inj.on_skip(4)
    t.join(10)
    assert not t.is_alive()
    early = Injector([parse("slow-save:step=2,until=skipped,seconds=30")], 0, 1, lambda f, s: None)
    early.on_skip(4)  # the skip came first (the commit thread was late): the wait ends at once
    t0 = time.monotonic()
    early.before_commit(2)
    assert time.monotonic() - t0 < 5
    timed = Injector([parse("slow-save:step=3,seconds=0.3")], 0, 1, lambda f, s: None)
    t0 = time.monotonic()
    timed.before_commit(3)
    assert 0.3 <= time.monotonic() - t0 < 5


def test_readme_fault_table_names_every_kind():
    """The fault table lives in docs/faults.md (the README links to it)."""
    from conftest import REPO

    from ptops.faultinject.spec import KINDS

    text = (REPO / "docs" / "faults.md").read_text()
    missing = [k for k in KINDS if f"| `{k}` |" not in text]
    assert not missing, f"docs/faults.md fault table lacks {missing}"
