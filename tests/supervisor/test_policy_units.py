"""The [monitors] policy, unit level: finding -> action, max_rollbacks, which checkpoint a rollback
picks, the PTOPS_ROLLBACK contract the adapters read (no training here; see test_policy_live.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ptops.monitors import Finding, MonitorsSection
from ptops.ops.supervisor.actions import FindingActions
from ptops.ops.supervisor.policy import FINDING_EFFECTS, HALTING, FindingPolicy, plan_rollback
from ptops.recipes.rollback import ENV, RollbackInfo, skip_start


def nan_at(step: int) -> Finding:
    return Finding("nan", step, math.nan, f"loss is nan at step {step}", "critical", rank=0)


def section(**kw) -> MonitorsSection:
    return MonitorsSection.model_validate(kw)


def test_default_mapping():
    pol = FindingPolicy(MonitorsSection())
    assert pol.decide(nan_at(12)).action == "rollback"
    assert pol.decide(Finding("loss_spike", 30, 9.0, "spike")).action == "alert"
    assert pol.decide(Finding("straggler", 8, 1.6, "slow", rank=1)).action == "alert"
    assert pol.decide(Finding("reward_hacking", 30, -0.7, "hack")).action == "alert"
    assert pol.decide(Finding("some_future_monitor", 3, 1.0, "?")).action == "alert"
    d = pol.decide(nan_at(12))
    assert d.step == 12 and d.monitor == "nan" and "step 12" in d.reason and d.rank == 0


def test_configured_mapping():
    pol = FindingPolicy(
        section(
            loss_spike={"action": "stop"},
            straggler={"action": "exclude_node"},
            reward_hacking={"action": "rollback"},
            nan={"action": "alert"},
        )
    )
    assert pol.decide(Finding("loss_spike", 30, 9.0, "spike")).action == "stop"
    assert pol.decide(Finding("straggler", 8, 1.6, "slow", rank=1)).action == "exclude_node"
    assert pol.decide(Finding("reward_hacking", 30, -0.7, "hack")).action == "rollback"
    assert pol.decide(nan_at(3)).action == "alert"


def test_findings_to_actions_table():
    """The effects are data: which actions end the attempt, which write an extra event."""
    assert set(FINDING_EFFECTS) == {"alert", "stop", "rollback", "exclude_node"}
    assert HALTING == ("stop", "rollback")
    assert (
        FINDING_EFFECTS["exclude_node"].record == "exclude_node"
        and not FINDING_EFFECTS["exclude_node"].halts
    )
    assert not FINDING_EFFECTS["alert"].halts and FINDING_EFFECTS["alert"].record is None
    # exclude_node names a node: only a straggler finding can have it
    pol = FindingPolicy(section(straggler={"action": "exclude_node"}))
    assert pol.decide(Finding("straggler", 8, 1.6, "slow", rank=1)).effect.record == "exclude_node"


def test_record_only_policy_never_acts():
    """A plain launch: findings are recorded (their events), every action is ``alert``."""
    pol = FindingPolicy.from_events(
        section(loss_spike={"action": "stop"}, straggler={"action": "exclude_node"}),
        [],
        record_only=True,
    )
    for f in (
        nan_at(12),
        Finding("loss_spike", 30, 9.0, "spike"),
        Finding("straggler", 8, 1.6, "slow", rank=1),
    ):
        d = pol.decide(f)
        assert d.action == "alert" and not d.effect.halts and d.effect.record is None


def test_max_rollbacks_counts_earlier_rollback_events():
    sec = section(rollback={"max_rollbacks": 2})
    events = [
        {"kind": "launch"},
        {"kind": "rollback", "from_step": 12, "to_step": 10, "lr_scale": 1.0},
    ]
    pol = FindingPolicy.from_events(sec, events)
    assert pol.rollback_allowed()
    pol.rollbacks.append({"kind": "rollback", "from_step": 14, "to_step": 10})
    assert not pol.rollback_allowed()
    assert not FindingPolicy(section(rollback={"max_rollbacks": 0})).rollback_allowed()


def test_rollback_picks_newest_good_before_the_anomaly_and_quarantines_at_or_after():
    pol = FindingPolicy(MonitorsSection())
    ckpts = [
        (5, "c/step-5", True),
        (10, "c/step-10", True),
        (12, "c/step-12", True),
        (15, "c/step-15", False),
    ]
    plan = plan_rollback(ckpts, 12, pol, "nan")
    assert (plan.from_step, plan.to_step, plan.to_path) == (12, 10, "c/step-10")
    assert sorted(plan.quarantine) == [
        "c/step-12",
        "c/step-15",
    ]  # at or after the anomaly, good or not
    # the newest before the anomaly is bad: the one before it
    plan = plan_rollback([(5, "c/step-5", True), (10, "c/step-10", False)], 12, pol, "nan")
    assert (plan.to_step, plan.to_path, plan.quarantine) == (5, "c/step-5", [])
    # nothing good before the anomaly: from scratch
    plan = plan_rollback([(10, "c/step-10", True)], 10, pol, "nan")
    assert (plan.to_step, plan.to_path, plan.quarantine) == (0, None, ["c/step-10"])


def test_skip_window_and_lr_factor():
    # default skip_batches=1: exactly the anomaly step's batch
    assert skip_start(12, 10, 1) == 12
    # a wide window cannot start before the resume point
    assert skip_start(12, 10, 5) == 11
    assert skip_start(12, 0, 0) == 13
    pol = FindingPolicy(
        section(rollback={"skip_batches": 3, "lr_scale": 0.5}),
        [{"kind": "rollback", "from_step": 9, "to_step": 5, "lr_scale": 0.5}],
    )
    info = plan_rollback([(10, "c/step-10", True)], 14, pol, "nan at 14").info
    assert (info.from_step, info.to_step, info.skip_batches, info.skip_at_step) == (14, 10, 3, 12)
    assert info.lr_scale == 0.5 and info.lr_factor == 0.25 and info.count == 2


def test_env_roundtrip_and_latest_rollback_env():
    info = RollbackInfo(12, 10, 1, 12, 0.5, 0.5, 1, "nan")
    assert RollbackInfo.from_env({ENV: info.to_env()}) == info
    assert RollbackInfo.from_env({}) is None
    assert RollbackInfo.from_env({ENV: "{not json"}) is None
    pol = FindingPolicy.from_events(
        MonitorsSection(),
        [
            {
                "kind": "rollback",
                "from_step": 12,
                "to_step": 10,
                "skip_batches": 1,
                "skip_at_step": 12,
                "lr_scale": 1.0,
                "lr_factor": 1.0,
                "count": 1,
                "reason": "a",
                "ts": 1.0,
                "monitor": "nan",
            },
        ],
    )
    env = json.loads(pol.last_env())
    assert env["from_step"] == 12 and env["to_step"] == 10 and env["skip_at_step"] == 12
    assert FindingPolicy(MonitorsSection()).last_env() is None


@pytest.mark.parametrize(
    "first,in_ckpt,expect",
    [
        (11, True, {12: 2}),  # resumed at 10: skip before 12
        (16, True, {}),  # resumed after the window from a checkpoint that holds the data position
        (16, False, {16: 2}),  # ...one that recounts it (transformers): re-apply on the first step
        (13, True, {}),
    ],
)
def test_batches_to_skip(first, in_ckpt, expect):
    info = RollbackInfo.from_dict({"from_step": 13, "to_step": 10, "skip_batches": 2})
    assert info.skip_at_step == 12
    got = {s: n for s in range(first, 20) if (n := info.batches_to_skip(s, first, in_ckpt))}
    assert got == expect


def test_gameable_reward_and_verifier():
    from ptops.recipes.trl.rewards import length, reward_setup, verifier

    funcs, weights = reward_setup("length")
    assert [f.__name__ for f in funcs] == ["length", "verifier"] and weights == [1.0, 0.0]
    funcs, weights = reward_setup("correct", with_verifier=True)
    assert [f.__name__ for f in funcs] == ["correct", "format", "verifier"] and weights == [
        1.0,
        0.2,
        0.0,
    ]
    assert length(["ab", "abcd"]) == [2 / 64, 4 / 64]
    assert verifier(["it is 7", "12", "none", "x 47"], answer=["7", "7", "7", "7"]) == [
        1.0,
        1 - 5 / 40,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError):
        reward_setup("bogus")


# ------------------------------------------------------------- the effects, on a real run directory


class _Run:
    """FindingActions' inputs: a run directory, a place to say things, a rank -> host lookup."""

    def __init__(self, tmp_path, monitors: MonitorsSection, events=(), record_only=False):
        from ptops.ops.runrecord.rundir import RunDir

        self.run = RunDir(tmp_path)
        self.run.checkpoints.mkdir(parents=True, exist_ok=True)
        for e in events:
            self.run.event(**e)
        self.said: list[str] = []
        self.actions = FindingActions(monitors, self.run, self.said.append, record_only=record_only)
        self.picked = None  # what the supervisor's deep restart pick would return

    def host_of(self, rank):
        return {1: "node-b"}.get(rank)

    def restart_checkpoint(self):
        return self.picked


def _kinds(r):
    return [e["kind"] for e in r.run.read_events()]


def test_effects_stop_is_exit_3(tmp_path):
    r = _Run(tmp_path, section(loss_spike={"action": "stop"}))
    r.actions.on_finding(Finding("loss_spike", 30, 9.0, "spike"), 1, r.host_of)
    assert r.actions.pending.action == "stop"
    out = r.actions.end_attempt(1)
    assert out.kind == "stop"
    v = r.actions.after_attempt(out, 1, r.restart_checkpoint)
    assert v.exit_code == 3 and v.state == "failed" and "loss_spike at step 30" in v.reason
    (failed,) = [e for e in r.run.read_events() if e["kind"] == "failed"]
    assert "loss_spike at step 30" in failed["reason"] and failed["exit_code"] == 3


def test_effects_rollback_quarantines_and_budget(tmp_path):
    ck = tmp_path / "checkpoints"
    for s in (5, 12, 15):
        (ck / f"step-{s}").mkdir(parents=True)
    r = _Run(tmp_path, section(rollback={"max_rollbacks": 1}))
    r.actions.on_finding(nan_at(12), 1, r.host_of)
    r.actions.on_finding(nan_at(13), 1, r.host_of)  # the first halting decision of an attempt wins
    assert r.actions.pending.step == 12
    v = r.actions.after_attempt(r.actions.end_attempt(1), 1, r.restart_checkpoint)
    assert v.exit_code is None and v.state == "restarting" and v.good is None  # from scratch
    moved = [e for e in r.run.read_events() if e["kind"] == "checkpoint_invalid"]
    assert sorted(Path(e["path"]).name for e in moved) == ["step-12", "step-15"]
    assert all(e["reason"] == "after anomaly at step 12" for e in moved)
    assert (
        not (ck / "step-12").exists() and len(list((ck / "invalid").iterdir())) == 2
    )  # moved, never deleted
    (rb,) = [e for e in r.run.read_events() if e["kind"] == "rollback"]
    assert (
        rb["from_step"] == 12 and rb["to_step"] == 0
    )  # step-5 is not a real checkpoint here: from scratch
    env = r.actions.attempt_env()
    assert json.loads(env[ENV])["from_step"] == 12 and r.actions.pending is None
    # a second rollback is over max_rollbacks=1: failed, exit 3
    r.actions.on_finding(nan_at(14), 2, r.host_of)
    v = r.actions.after_attempt(r.actions.end_attempt(2), 2, r.restart_checkpoint)
    assert v.exit_code == 3 and _kinds(r)[-1] == "failed" and "max_rollbacks=1" in v.reason
    # a supervisor that adopts the run knows the rollback count and the env from events.jsonl
    r2 = _Run(tmp_path, section(rollback={"max_rollbacks": 1}))
    assert json.loads(r2.actions.attempt_env()[ENV])["to_step"] == 0
    assert not r2.actions.policy.rollback_allowed()


def test_effects_exclude_node_is_recorded_only(tmp_path):
    r = _Run(tmp_path, section(straggler={"action": "exclude_node"}))
    r.actions.on_finding(Finding("straggler", 8, 1.6, "slow", rank=1), 1, r.host_of)
    assert r.actions.pending is None
    (ev,) = [e for e in r.run.read_events() if e["kind"] == "exclude_node"]
    assert ev["rank"] == 1 and ev["host"] == "node-b" and ev["acted"] is False


def test_effects_record_only_writes_nothing_more(tmp_path):
    r = _Run(
        tmp_path,
        section(straggler={"action": "exclude_node"}, loss_spike={"action": "stop"}),
        record_only=True,
    )
    r.actions.on_finding(Finding("straggler", 8, 1.6, "slow", rank=1), 1, r.host_of)
    r.actions.on_finding(nan_at(12), 1, r.host_of)
    assert r.actions.pending is None and _kinds(r) == [] and r.said == []


@pytest.mark.parametrize(
    "error,began,fatal",
    [
        (
            "ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'",
            False,
            True,
        ),
        ("ModuleNotFoundError: No module named 'torchtitan'", False, True),
        ("SyntaxError: invalid syntax (trainer.py, line 3)", False, True),
        (
            "ImportError: cannot import name 'x'",
            True,
            False,
        ),  # after a step: the no-progress rule decides
        ("RuntimeError: CUDA error: an illegal memory access was encountered", False, False),
        (None, False, False),
    ],
)
def test_fatal_startup_error(error, began, fatal):
    from ptops.ops.supervisor.policy import fatal_startup_error

    why = fatal_startup_error(error, began_step=began)
    assert bool(why) == fatal and (not fatal or error.split(":")[0] in why)


def test_fatal_failure_stops_without_a_restart():
    """Seen on the first GPU lease (torch 2.11 under TorchTitan 0.3.0): the same ImportError three
    attempts in a row. The first one stops the run, exit 4 (misconfigured: the same image fails the
    same way on any node; do not requeue)."""
    from ptops.ops.supervisor.policy import (
        EXIT_MISCONFIGURED,
        Failure,
        RestartPolicy,
        fatal_startup_error,
    )

    pol = RestartPolicy()
    why = fatal_startup_error("ImportError: cannot import name 'X'", began_step=False)
    d = pol.decide(
        Failure(ts=0.0, start_step=0, good_step=0, reason="crash: rank 0 exited 1", fatal=why)
    )
    assert (d.action, d.exit_code) == (
        "stop",
        EXIT_MISCONFIGURED,
    ) and "restart would fail the same way" in d.reason
    d = RestartPolicy().decide(
        Failure(ts=0.0, start_step=0, good_step=0, reason="crash: rank 0 exited 1")
    )
    assert d.action == "restart"
