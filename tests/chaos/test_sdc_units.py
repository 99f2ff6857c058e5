"""Silent data corruption, the pure and the rank-local parts (no training run; real torch tensors):
the ``bitflip`` spec, the flip itself (deterministic, finite, one bit), the exact fingerprint and
the at-rest / replica checks of ``recipes/sdc.py``, the ``sdc`` monitor over made-up records, the
policy (exact rollback, a persistent rank strikes its node) and ``diagnose``'s incident.

The live runs (titan-tiny: a transient flip recovers to the reference digest, a persistent one is
caught again and stops) are in ``tests/chaos/test_sdc_live.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ptops.faultinject.inject import FLIP_EXPONENT_BIT, Injector, flip_one_bit
from ptops.faultinject.spec import FaultSpecError, format_spec, parse
from ptops.monitors import MonitorsSection, build_monitors, replay
from ptops.monitors.sdc import SdcMonitor
from ptops.ops.supervisor.policy import (
    FindingPolicy,
    contained_sdc,
    persistent_sdc,
    plan_rollback,
)
from ptops.recipes import sdc


def test_bitflip_spec_defaults_and_errors():
    f = parse("bitflip:step=11")
    assert (f.kind, f.step, f.rank, f.attempt) == ("bitflip", 11, 0, 1)
    p = parse("bitflip:rank=1,step=3,target=optim,mode=persistent")
    assert p.rank == 1 and p.attempt == 0 and p.params == {"target": "optim", "mode": "persistent"}
    again = parse(format_spec(p))  # round trip (attempt=0 written out)
    assert (again.rank, again.step, again.attempt, again.params) == (1, 3, 0, p.params)
    assert parse("bitflip:rank=1,step=3,mode=persistent,attempt=2").attempt == 2
    for bad, words in (
        ("bitflip:step=3,target=disk", "key 'target'"),
        ("bitflip:step=3,mode=every", "key 'mode'"),
        ("bitflip:rank=1", "key 'step'"),
    ):
        with pytest.raises(FaultSpecError, match=words):
            parse(bad)


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(8, 4, generator=g) * 0.02),
        ("b.bias", torch.randn(5, generator=g, dtype=torch.float64)),
        ("c.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
    ]


@pytest.mark.parametrize("spec", ["bitflip:rank=0,step=7", "bitflip:rank=0,step=7,target=optim"])
def test_flip_is_one_exponent_bit_finite_and_deterministic(spec):
    fault = parse(spec)
    a, b = _named(), _named()
    what_a, what_b = flip_one_bit(a, fault, 7), flip_one_bit(b, fault, 7)
    assert what_a == what_b  # same spec: same tensor, element, bit
    diffs = []
    for (name, x), (_, y) in zip(_named(), a):
        assert torch.isfinite(y.float()).all()
        width = {torch.float32: torch.int32, torch.float64: torch.int64}.get(x.dtype, torch.int16)
        xor = x.view(width) ^ y.view(width)
        for i in torch.nonzero(xor.view(-1)).view(-1).tolist():
            diffs.append((name, i, int(xor.view(-1)[i])))
    assert len(diffs) == 1, diffs
    name, index, bits = diffs[0]
    mantissa = {"a.weight": 23, "b.bias": 52, "c.weight": 7}[name]
    assert abs(bits) == 1 << (mantissa + FLIP_EXPONENT_BIT)
    assert f"element {index} of {name}" in what_a
    x = dict(_named())[name].view(-1)[index].double()
    y = dict(a)[name].view(-1)[index].double()
    assert float(abs(y / x)) in (2.0**16, 2.0**-16)  # it matters, and it stays finite


def test_fingerprint_sees_one_flip_and_nothing_else():
    named = _named()
    before = sdc.fingerprint(named)
    assert sdc.fingerprint(_named()) == before  # exact: the same state, the same sums
    flip_one_bit(named, parse("bitflip:step=1"), 1)
    after = sdc.fingerprint(named)
    assert sum(x != y for x, y in zip(before, after)) == 1
    assert sdc.total(before) != sdc.total(after) and len(sdc.total(after)) == 16


class _Probe:
    def __init__(self, faults):
        self.emitted = []
        self.faults = Injector(
            [parse(f) for f in faults], 0, 1, lambda f, s: self.emitted.append((str(f), s))
        )


def _checks(faults, every=2, replicated=False, rank_tensors=None):
    params = rank_tensors or _named()
    opt = [("optim0.g0.p0.exp_avg", torch.zeros(4))]
    probe = _Probe(faults)
    return sdc.StateChecks(every, probe, lambda: params, lambda: opt, replicated), probe, params


def _run(checks, steps, train=None):
    out = {}
    for step in steps:
        checks.before_step(step)
        if train:
            train(step)
        out[step] = checks.after_step(step)
    return out


def test_at_rest_check_catches_a_flip_in_its_window_only():
    # every=2: windows after steps 2 and 4 (checked at the starts of 3 and 5)
    checks, probe, params = _checks(["bitflip:rank=0,step=5"])

    def train(step):  # the optimizer changes the state inside each step: never a finding
        for _, t in params:
            t.add_(torch.ones_like(t) * 1e-3)

    recs = _run(checks, range(1, 7), train)
    assert recs[3]["sdc_rest"] == 0 and "sdc_rest_tensor" not in recs[3]
    assert recs[5]["sdc_rest"] == 1 and recs[5]["sdc_rest_tensor"] in dict(params)
    assert "sdc_rest" not in recs[4] and "sdc_rest" not in recs[6]  # not check steps
    assert all("sdc_fp" not in r for r in recs.values())  # shards: not replicated
    assert recs[2]["sdc_s"] > 0 and "sdc_s" not in recs[1]
    assert probe.emitted == [("bitflip:rank=0,step=5", 5)]


def test_persistent_flip_fires_every_step_emitted_once():
    checks, probe, _ = _checks(["bitflip:rank=0,step=3,mode=persistent"], every=1)
    recs = _run(checks, range(1, 6))
    assert [recs[s].get("sdc_rest") for s in range(2, 6)] == [0, 1, 1, 1]
    assert len(probe.emitted) == 1


def test_replicated_ranks_put_their_fingerprint_in_the_record():
    a, _, _ = _checks([], every=2, replicated=True)
    b, _, _ = _checks(["bitflip:rank=0,step=4"], every=2, replicated=True)
    ra, rb = _run(a, range(1, 5)), _run(b, range(1, 5))
    assert ra[2]["sdc_fp"] == rb[2]["sdc_fp"]  # same state, same fingerprint
    assert ra[4]["sdc_fp"] != rb[4]["sdc_fp"]  # the flip before step 4 shows after it


class _Grads:
    """A rank's gradients computed from its weights and a batch, deterministically; ``noisy``
    runs add a different error each time (a device that cannot compute the same thing twice)."""

    def __init__(self, noisy: bool = False):
        self.w = _named()[0][1]
        self.grads = [("0.w.grad", torch.zeros_like(self.w))]
        self.noisy, self.runs = noisy, 0

    def compute(self):
        self.runs += 1
        g = self.w * 3.0 + 0.5
        if self.noisy:
            g = g + self.runs * 1e-3
        self.grads[0][1].copy_(g)


def _recheck_run(faults, steps, noisy=False, recheck_every=2):
    probe = _Probe(faults)
    g = _Grads(noisy)
    checks = sdc.StateChecks(
        0, probe, lambda: [], lambda: [], recheck_every=recheck_every
    )  # at rest off: the recheck alone
    votes = []
    out = {}
    for step in steps:
        checks.before_step(step)
        g.compute()  # the step's backward
        checks.before_optimizer(
            step, lambda: g.grads, g.compute, lambda flag: votes.append(flag) or flag
        )
        clean = g.w * 3.0 + 0.5
        out[step] = {**checks.after_step(step), "_clean": bool(torch.equal(g.grads[0][1], clean))}
    return out, probe, votes


def test_recheck_catches_a_gradient_flip_and_keeps_the_clean_gradients():
    recs, probe, votes = _recheck_run(["bitflip:rank=0,step=4,target=grad"], range(1, 7))
    assert recs[2]["sdc_recheck"] == 0 and "sdc_recheck_kept" not in recs[2]
    assert recs[4]["sdc_recheck"] == 1 and recs[4]["sdc_recheck_tensor"] == "0.w.grad"
    assert recs[4]["sdc_recheck_kept"] == "recompute"  # the flipped first run was outvoted
    assert all(r["_clean"] for r in recs.values())  # the optimizer never saw the flipped value
    assert "sdc_recheck" not in recs[3] and "sdc_recheck" not in recs[5]  # not recheck steps
    assert votes == [False, True, False]  # a third run only where a rank disagreed
    assert probe.emitted == [("bitflip:rank=0,step=4,target=grad", 4)]
    # the flip lands between the backward and the optimizer, never at rest
    at_rest, probe2, _ = _checks(["bitflip:rank=0,step=2,target=grad"], every=1)
    assert _run(at_rest, range(1, 4))[2]["sdc_rest"] == 0 and not probe2.emitted


def test_recheck_of_a_flip_outside_its_steps_is_missed_and_says_so_by_cadence():
    recs, _, _ = _recheck_run(["bitflip:rank=0,step=3,target=grad"], range(1, 5))
    assert recs[3].get("sdc_recheck") is None and not recs[3]["_clean"]  # step 3: not rechecked
    assert recs[4]["sdc_recheck"] == 0  # the sample: step 4's own compute was clean


def test_recheck_of_a_device_that_never_agrees_keeps_none():
    recs, _, _ = _recheck_run([], range(1, 3), noisy=True)
    assert recs[2]["sdc_recheck"] == 1 and recs[2]["sdc_recheck_kept"] == "none"


def test_monitor_recheck_contained_then_persistent_and_what_the_policy_does():
    records = [rec(s, r, sdc_recheck=0) for s in (5, 10) for r in (0, 1)]
    records += [
        rec(15, 0, sdc_recheck=0),
        rec(15, 1, sdc_recheck=2, sdc_recheck_tensor="0.w.grad", sdc_recheck_kept="recompute"),
        rec(20, 0, sdc_recheck=0),
        rec(20, 1, sdc_recheck=1, sdc_recheck_tensor="0.w.grad", sdc_recheck_kept="recompute"),
    ]
    found = replay(records, [SdcMonitor()])
    assert [(f.step, f.rank, f.value, f.severity) for f in found] == [
        (15, 1, 1.0, "warning"),
        (10, 1, 2.0, "critical"),  # a bad device: back before its last clean recheck (step 10)
    ]
    assert found[0].detail.startswith("recompute transient: rank 1's gradients at step 15")
    assert "discarded before the optimizer" in found[0].detail
    assert found[1].detail.startswith("recompute persistent") and "step 10" in found[1].detail
    pol = FindingPolicy(MonitorsSection())
    assert contained_sdc(found[0]) and pol.decide(found[0]).action == "alert"
    assert not contained_sdc(found[1]) and pol.decide(found[1]).action == "exclude_node"
    (none,) = replay(
        [rec(4, 0, sdc_recheck=0), rec(8, 0, sdc_recheck=3, sdc_recheck_kept="none")],
        [SdcMonitor()],
    )
    assert none.severity == "critical" and "three answers" in none.detail and none.step == 4
    assert pol.decide(none).action == "exclude_node"


def rec(step, rank, attempt=1, **kw):
    return {"step": step, "rank": rank, "attempt": attempt, "loss": 1.0, **kw}


def test_monitor_at_rest_transient_then_persistent():
    records = [rec(s, r, sdc_rest=0) for s in (1, 2) for r in (0, 1)]
    records += [rec(3, 0, sdc_rest=0), rec(3, 1, sdc_rest=2, sdc_rest_tensor="0.w")]
    records += [rec(4, 1, sdc_rest=1)]  # the same attempt: reported once
    records += [rec(2, r, attempt=2, sdc_rest=0) for r in (0, 1)]
    records += [rec(3, 1, attempt=2, sdc_rest=1, sdc_rest_tensor="0.w")]
    found = replay(records, [SdcMonitor()])
    assert [(f.step, f.rank, f.attempt, f.value) for f in found] == [(2, 1, 1, 1.0), (2, 1, 2, 2.0)]
    assert found[0].detail.startswith("at_rest transient: rank 1") and "0.w" in found[0].detail
    assert found[1].detail.startswith("at_rest persistent: rank 1")
    assert found[0].severity == "critical" and found[0].family == "sdc"
    assert not persistent_sdc(found[0]) and persistent_sdc(found[1])


def test_monitor_replicas_name_the_odd_rank_out_and_the_last_agreed_step():
    ok = [rec(s, r, sdc_fp="aa") for s in (10, 20) for r in (0, 1, 2)]
    bad = [rec(30, 0, sdc_fp="bb"), rec(30, 1, sdc_fp="cc"), rec(30, 2, sdc_fp="bb")]
    (f,) = replay(ok + bad, [SdcMonitor()])
    assert (f.step, f.rank, f.attempt) == (20, 1, 1)
    assert f.detail.startswith("replica transient") and "last agreed at step 20" in f.detail
    pair = [rec(10, 0, sdc_fp="aa"), rec(10, 1, sdc_fp="ab")]
    (g,) = replay(pair, [SdcMonitor()])
    assert g.rank is None and g.step == 9  # two replicas: which one lies is unknown


def test_monitor_is_registered_with_its_runbook_and_default_cadence():
    names = [m.name for m in build_monitors(MonitorsSection())]
    assert "sdc" in names
    section = MonitorsSection()
    assert section.sdc.every == 25 and section.action_for("sdc") == "rollback"


def test_policy_rolls_back_exactly_and_strikes_a_persistent_rank():
    section = MonitorsSection.model_validate({"rollback": {"skip_batches": 3, "lr_scale": 0.5}})
    pol = FindingPolicy(section)
    found = replay(
        [rec(11, 1, sdc_rest=1), rec(11, 1, attempt=2, sdc_rest=1)], [SdcMonitor()], flush=False
    )
    assert pol.decide(found[0]).action == "rollback"
    assert pol.decide(found[1]).action == "exclude_node"
    entries = [(5, "step-5", True), (10, "step-10", True), (15, "step-15", True)]
    plan = plan_rollback(entries, found[0].step, pol, "sdc", exact=True)
    assert (plan.to_step, plan.quarantine) == (5, ["step-15", "step-10"])
    assert (plan.info.skip_batches, plan.info.lr_scale, plan.info.lr_factor) == (0, 1.0, 1.0)
    nan = plan_rollback(entries, 10, pol, "nan")  # other monitors keep the configured rollback
    assert (nan.info.skip_batches, nan.info.lr_factor) == (3, 0.5)


def test_finding_actions_stop_a_local_run_on_a_persistent_rank(tmp_path):
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor.actions import FindingActions

    run = RunDir(tmp_path)
    said = []
    acts = FindingActions(MonitorsSection(), run, said.append)
    first, again = replay(
        [rec(11, 1, sdc_rest=1), rec(11, 1, attempt=2, sdc_rest=1)], [SdcMonitor()]
    )
    acts.on_finding(first, 1, lambda r: "node-a")
    assert acts.pending.action == "rollback"
    acts.pending = None
    acts.on_finding(again, 2, lambda r: "node-a")
    assert acts.pending.action == "stop"  # a local launch cannot replace the node
    (ex,) = [e for e in run.read_events() if e["kind"] == "exclude_node"]
    assert (ex["rank"], ex["host"], ex["acted"]) == (1, "node-a", False)
    (tmp_path / "s").mkdir()
    slurm = FindingActions(MonitorsSection(), RunDir(tmp_path / "s"), said.append)
    slurm.exclude_node = lambda host, why: f"strike 1 against {host}"
    slurm.on_finding(again, 2, lambda r: "node-a")
    assert slurm.pending.action == "rollback"  # a spare takes the node's place


def test_diagnose_names_rank_node_and_kind(tmp_path):
    from ptops.diagnostics.incidents import build
    from ptops.monitors.registry import RUNBOOKS

    (found,) = replay([rec(11, 1, sdc_rest=1, sdc_rest_tensor="0.w")], [SdcMonitor()])
    events = [
        {"ts": 1.0, "kind": "launch", "attempt": 1},
        {"ts": 2.0, "kind": "anomaly", **found.to_event(), "attempt": 1},
        {"ts": 3.0, "kind": "rollback", "monitor": "sdc", "from_step": 10, "to_step": 5},
    ]
    findings = [
        {**found.to_dict(), "source": "replay", "runbook": RUNBOOKS["sdc"], "live": True, "ts": 2.0}
    ]
    (inc,) = build(tmp_path, events, [], findings, {1: "node-b"}, RUNBOOKS)
    assert inc["kind"] == "sdc" and inc["rank"] == 1 and inc["host"] == "node-b"
    assert "at_rest" in inc["title"] and "transient" in inc["title"] and "node-b" in inc["title"]
    assert inc["runbook"] == "SilentDataCorruption"
    assert "step 10 to checkpoint step 5" in inc["action"]
    assert json.dumps(inc)  # JSON-safe for `diagnose --json`
