"""The re-run on another rank and the contributions (``recipes/sdc.py``, ``monitors/sdc.py``), the
pure parts: scripted fingerprints stand for what a rank hands to the reduce-scatter. The live runs
(titan-tiny on 2 and 3 ranks, a ``bitflip target=compute`` fault) are in
``tests/chaos/test_sdc_live.py``.
"""

from __future__ import annotations

import pytest
import torch

from ptops.faultinject.spec import FaultSpecError, parse
from ptops.monitors import MonitorsSection, replay
from ptops.monitors.sdc import SdcMonitor
from ptops.ops.supervisor.policy import FindingPolicy, contained_sdc, persistent_sdc
from ptops.recipes import sdc


class _Tap:
    """Scripted contributions: each run of a checked step takes the next list."""

    def __init__(self, runs: list[list[int]]):
        self.runs, self.armed = list(runs), []

    def arm(self, on: bool) -> None:
        self.armed.append(on)

    def take(self) -> list[int]:
        return self.runs.pop(0) if self.runs else []


def _step(checks, step, tap_runs, grads_runs=None, exchange=None, partner=None, agree=bool):
    """One step through the checks: ``grads_runs`` the gradient values of each run (equal by
    default), the tap scripted with ``tap_runs``."""
    checks.tap.runs = list(tap_runs)
    values = list(grads_runs or [1.0, 1.0, 1.0])
    g = torch.full((4,), values[0])

    def rerun():
        values.pop(0)
        g.fill_(values[0])

    checks.before_step(step)
    checks.before_optimizer(step, lambda: [("w.grad", g)], rerun, agree, exchange, partner)
    return checks.after_step(step)


def _checks(recheck_every=1, partner_every=0):
    return sdc.StateChecks(
        0, None, lambda: [], lambda: [], recheck_every=recheck_every,
        partner_every=partner_every, tap=_Tap([]),
    )  # fmt: skip


def test_the_rank_whose_contribution_differed_is_named_not_the_shard_it_reached():
    checks = _checks()
    flags = []
    keys = _step(
        checks, 1, [[5, 7], [5, 8], [5, 8]],
        exchange=lambda flag: flags.append(flag) or [False, flag],
    )  # fmt: skip
    assert keys["sdc_recheck"] == 0  # its own shard came out equal: the error went elsewhere
    assert keys["sdc_recheck_contrib"] == 1 and keys["sdc_recheck_kept"] == "recompute"
    assert keys["sdc_recheck_compute"] == [1] and flags == [True]
    # a rank that only received the error: its shard differed, its contributions did not
    victim = _checks()
    keys = _step(
        victim, 1, [[3, 4], [3, 4], [3, 4]], grads_runs=[2.0, 1.0, 1.0],
        exchange=lambda flag: [flag, True],
    )  # fmt: skip
    assert keys["sdc_recheck"] == 1 and keys["sdc_recheck_contrib"] == 0
    assert keys["sdc_recheck_compute"] == [1] and keys["sdc_recheck_kept"] == "recompute"
    # equal everywhere: no third run, no exchange
    calm = _checks()
    keys = _step(calm, 1, [[1], [1]], exchange=lambda flag: pytest.fail("exchanged"))
    assert (keys["sdc_recheck"], keys["sdc_recheck_contrib"]) == (0, 0)
    assert "sdc_recheck_compute" not in keys


def test_partner_runs_at_its_cadence_and_when_three_runs_give_three_answers():
    checks = _checks(recheck_every=2, partner_every=4)
    calls = []

    def partner(own):
        calls.append(own)
        return ([], [])

    seen = {}
    for step in range(1, 9):
        runs = [[step], [step]] if step % 2 == 0 else [[step]]
        seen[step] = _step(checks, step, runs, partner=partner)
    assert calls == [[4], [8]]  # the contributions of the run that stands
    assert seen[4]["sdc_partner"] == 0 and "sdc_partner" not in seen[2]
    assert checks.tap.armed == [False, True, False, True, False, True, False, True]
    # step 2 is no partner step, but its three runs disagree: the partner decides
    noisy = _checks(recheck_every=2, partner_every=0)
    got = []
    keys = _step(
        noisy, 2, [[1], [2], [3]], grads_runs=[1.0, 2.0, 3.0],
        partner=lambda own: got.append(own) or ([1, 2], [2]),
    )  # fmt: skip
    assert keys["sdc_recheck_kept"] == "none" and got == [[3]]
    assert keys["sdc_partner"] == 2 and keys["sdc_partner_suspects"] == [2]


def test_suspects_are_the_devices_common_to_every_disagreement():
    # a bad device d spoils its own batch and the one it computes as partner (d - 1)
    assert sdc.partner_suspects([0, 1], 3) == [1]
    assert sdc.partner_suspects([2, 0], 3) == [0]
    assert sdc.partner_suspects([3, 4], 8) == [4]
    assert sdc.partner_suspects([0, 1], 2) == [0, 1]  # a pair cannot be told apart
    assert sdc.partner_suspects([5], 8) == [5, 6]  # one batch: its own device or its partner
    assert sdc.partner_suspects([], 4) == []
    assert sdc.partner_suspects([0, 2], 8) == []  # two unrelated disagreements: nobody in common


def rec(step, rank, attempt=1, **kw):
    return {"step": step, "rank": rank, "attempt": attempt, "loss": 1.0, **kw}


def test_monitor_blames_the_computing_rank_and_spares_the_shard_it_reached():
    records = [rec(5, r, sdc_recheck=0, sdc_recheck_contrib=0) for r in (0, 1)]
    records += [
        rec(10, 0, sdc_recheck=1, sdc_recheck_contrib=0, sdc_recheck_compute=[1],
            sdc_recheck_tensor="0.w.grad", sdc_recheck_kept="recompute"),
        rec(10, 1, sdc_recheck=0, sdc_recheck_contrib=1, sdc_recheck_compute=[1],
            sdc_recheck_kept="recompute"),
    ]  # fmt: skip
    (found,) = replay(records, [SdcMonitor()])
    assert (found.rank, found.step, found.severity) == (1, 10, "warning")
    assert found.detail.startswith("recompute transient: rank 1's computation at step 10")
    assert "1 reduce-scatter bucket(s)" in found.detail and contained_sdc(found)


def test_monitor_partner_one_suspect_is_struck_two_are_rolled_back():
    pol = FindingPolicy(MonitorsSection())
    clean = [rec(5, r, sdc_partner=0) for r in (0, 1, 2)]
    bad = [rec(10, r, sdc_partner=2, sdc_partner_suspects=[1]) for r in (0, 1, 2)]
    (found,) = replay(clean + bad, [SdcMonitor()])
    assert (found.rank, found.step, found.value, found.severity) == (1, 5, 2.0, "critical")
    assert found.detail.startswith("partner persistent: rank 1 computes differently")
    assert "last clean partner check, step 5" in found.detail
    assert persistent_sdc(found) and pol.decide(found).action == "exclude_node"
    pair = [rec(10, r, sdc_partner=2, sdc_partner_suspects=[0, 1]) for r in (0, 1)]
    (two,) = replay([rec(5, r, sdc_partner=0) for r in (0, 1)] + pair, [SdcMonitor()])
    assert two.rank is None and two.detail.startswith("partner unattributed: ranks 0 and 1")
    assert not persistent_sdc(two) and pol.decide(two).action == "rollback"
    # nothing before it in the attempt: back to before its first record
    (first,) = replay(bad, [SdcMonitor()])
    assert first.step == 9


def test_compute_target_parses_and_the_default_cadence_is_documented():
    f = parse("bitflip:rank=1,step=10,target=compute,mode=persistent")
    assert f.params["target"] == "compute" and f.attempt == 0  # a bad device stays bad
    with pytest.raises(FaultSpecError, match="target"):
        parse("bitflip:step=3,target=wire")
    section = MonitorsSection()
    assert section.sdc.partner_every == 1000 and section.sdc.recheck_every == 200
