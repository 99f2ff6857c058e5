"""The goodput soak's fault plan (``bench/goodput_soak.py``): the same faults, at the same steps,
for every peer, and keyed to the right torchrun/ft worker group. No training here (the soak itself
is a benchmark); the ft peer's worker is checked to wrap the probe's per-step hook without running
it."""

from __future__ import annotations

import importlib.util

from conftest import REPO

from ptops.faultinject.spec import parse


def _soak():
    spec = importlib.util.spec_from_file_location(
        "goodput_soak", REPO / "bench" / "goodput_soak.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_is_the_seeds_and_every_kind_comes_once_per_round():
    g = _soak()
    plan = g.fault_plan(0, 90.0, 30.0)
    assert plan == g.fault_plan(0, 90.0, 30.0) != g.fault_plan(1, 90.0, 30.0)
    assert sum(gap for gap, _, _ in plan) >= 30 * 60  # enough faults for the whole soak
    assert all(60.0 <= gap <= 120.0 for gap, _, _ in plan)
    first_round = [kind for _, kind, _ in plan[: len(g.KINDS)]]
    assert sorted(first_round) == sorted(g.KINDS)


def test_up_front_faults_match_the_plan_steps_and_follow_the_worker_groups():
    g = _soak()
    plan = [
        (10.0, "slow", 0),
        (10.0, "crash", 1),
        (10.0, "nan", 0),
        (10.0, "hang_stop", 1),
        (10.0, "hang", 0),
    ]
    steps = g.plan_steps(plan, 0.1)
    assert [s for s, _, _, _ in steps] == [100, 200, 300, 400, 500]
    # a crash, a NaN (torchtitan's finite-loss check kills the rank) or a hang ends a torchrun/ft
    # worker group: the faults after it belong to the next one
    assert [a for _, _, _, a in steps] == [1, 1, 2, 3, 4]
    faults = g.up_front(plan, 0.1)
    assert [str(f) for f in faults] == [
        "slow:rank=1,step=100,seconds=0.5,steps=20,attempt=1",
        "crash:rank=1,step=200,attempt=1",
        "nan:step=300,attempt=2",
        "hang:rank=1,step=400,mode=stop,attempt=3",
        "hang:rank=0,step=500,attempt=4",
    ]
    assert all(str(parse(str(f))) == str(f) for f in faults)


def test_goodput_counts_a_steps_last_execution_and_not_a_nan_step(tmp_path):
    g = _soak()
    recs = [
        '{"rank": 0, "step": 1, "step_s": 1.0, "loss": 2.0}',
        '{"rank": 0, "step": 2, "step_s": 5.0, "loss": 2.0}',
        '{"rank": 1, "step": 2, "step_s": 9.0, "loss": 2.0}',
        # redone after a restart: this one counts
        '{"rank": 0, "step": 2, "step_s": 2.0, "loss": 1.5}',
        '{"rank": 0, "step": 3, "step_s": 4.0, "loss": "nan"}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(recs) + "\n")
    out = g.goodput(tmp_path, 10.0)
    assert out["productive_s"] == 3.0 and out["goodput"] == 0.3
    assert out["nan_steps"] == 1 and out["steps"] == 3 and out["steps_per_min"] == 12.0


def test_fired_counts_a_fault_of_every_rank_once_per_worker_group():
    g = _soak()
    ev = [
        {"kind": "fault_injected", "fault": "nan:step=5", "attempt": 1, "rank": r, "ts": 3.0}
        for r in (0, 1)
    ]
    ev.append({"kind": "fault_injected", "fault": "nan:step=5", "attempt": 2, "rank": 0, "ts": 9.0})
    assert g.fired(ev, 1.0) == [
        {"t": 2.0, "fault": "nan:step=5"},
        {"t": 8.0, "fault": "nan:step=5"},
    ]


def test_step_tail_reads_only_new_lines_and_waits_for_a_whole_line(tmp_path):
    g = _soak()
    path = tmp_path / "metrics.jsonl"
    tail = g.StepTail(path)
    assert tail() == 0  # no file yet
    path.write_text('{"rank": 0, "step": 4}\n{"rank": 1, "step": 9}\n{"rank": 0, "st')
    assert tail() == 4
    with open(path, "a") as f:
        f.write('ep": 7}\n{"rank": 0, "step": 5}\n')
    assert tail() == 7  # the highest step, a later lower one (a restarted group) does not lower it


def test_ft_peer_is_skipped_with_a_reason_when_nvrx_is_not_installed(tmp_path):
    g = _soak()
    g.NVRX = tmp_path / "no-nvrx"
    why = g.ft_missing()
    assert why is not None and "not installed" in why and "bench/README.md" in why
