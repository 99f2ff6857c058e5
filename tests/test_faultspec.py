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
    faults = [parse("crash:rank=1,step=12"), parse("slow:step=2,seconds=0.25,steps=3"), parse("crash:step=2,signal=term")]
    assert from_env(to_env(faults)) == faults
    assert parse(format_spec(faults[1])) == Fault("slow", 2, None, 1, {"seconds": 0.25, "steps": 3}, format_spec(faults[1]))
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
        ("hang:step=3,phase=save", ["key 'phase'", "expected one of step, import, rendezvous, build, load"]),
        ("hang:step=3,phase=build", ["key 'step'", "start-up hang (phase=build) has no step"]),
        ("slow:step=3,seconds=-1", ["key 'seconds'", ">= 0"]),
        ("preempt:step=3,rank=1", ["key 'rank'", "unknown key for preempt"]),
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
