"""The grader seam (recipes/trl/grader.py): a grader's own failure is no verdict, never a 0 or a 1.

The rules on plain reward functions written the way users write them (TRL's keyword calling
convention), then real GRPO runs (tiny model, 2 ranks, gloo): ``ptops chaos`` with the seam's two
scenarios (a grader call that fails once: retried, digest = baseline; a reward call that never
returns: a hang named ``reward``, restarted, digest = baseline), and a grader that stays down: its
completions unscorable and counted, the run completing.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_ptops
from helpers import NPROC, records_by_rank

from ptops.ops.runrecord.rundir import read_jsonl
from ptops.recipes.trl.grader import GraderSeam


def _seam(funcs, weights):
    trainer = SimpleNamespace(
        reward_funcs=list(funcs), reward_weights=list(weights), state=SimpleNamespace(global_step=4)
    )
    seam = GraderSeam()
    seam.attach(trainer)
    return seam, trainer


def _score(trainer, completions):
    """TRL's calling convention: every function, the same keyword arguments, one after another."""
    kw = {"prompts": ["p"] * len(completions), "completions": completions, "answer": ["4"] * 3}
    return [f(**kw) for f in trainer.reward_funcs]


def correct(completions, answer, **_):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def fmt(completions, **_):
    return [0.5] * len(completions)


def test_a_grader_that_fails_once_is_retried_and_scores_as_if_it_had_not():
    calls = []

    def flaky(completions, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("verifier service reset the connection")
        return correct(completions, **kw)

    seam, trainer = _seam([flaky, fmt], [1.0, 0.2])
    assert _score(trainer, ["4", "5", "4"]) == [[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]]
    assert len(calls) == 2
    assert seam.metrics() == {"grader/no_verdict": 0.0, "grader/retries": 1.0}


def test_a_grader_down_leaves_its_batch_without_any_verdict_not_a_zero_and_not_the_format_bonus():
    def down(completions, **_):
        raise BrokenPipeError("the grader's helper died")

    seam, trainer = _seam([down, fmt], [1.0, 0.2])
    # format alone would have paid 0.2 x 0.5 to each: the correctness is missing, not zero
    assert _score(trainer, ["4", "5", "4"]) == [[None] * 3, [None] * 3]
    assert seam.metrics() == {"grader/no_verdict": 3.0, "grader/retries": 1.0}
    assert seam.metrics() == {"grader/no_verdict": 0.0, "grader/retries": 0.0}  # per record


def test_one_completion_a_weighted_grader_could_not_judge_is_unscorable_for_every_function():
    def judge(completions, **_):  # the judge past its bound: None for one completion
        return [0.9, None, 0.1]

    def logged(completions, **_):  # weight 0: logged only, its None takes nothing away
        return [None, 1.0, 1.0]

    seam, trainer = _seam([judge, fmt, logged], [1.0, 0.2, 0.0])
    assert _score(trainer, ["a", "b", "c"]) == [
        [0.9, None, 0.1],
        [0.5, None, 0.5],
        [None, None, 1.0],
    ]
    assert seam.metrics()["grader/no_verdict"] == 1.0


def test_a_recipe_bug_in_a_reward_function_is_not_taken_for_an_outage():
    def buggy(completions, **_):
        raise KeyError("answer")  # the recipe's mistake: crash the rank, where it is seen

    _, trainer = _seam([buggy], [1.0])
    with pytest.raises(KeyError):
        _score(trainer, ["4"])


def test_each_batch_is_graded_once_whatever_the_number_of_functions():
    n = []

    def counted(completions, **kw):
        n.append(1)
        return correct(completions, **kw)

    _, trainer = _seam([counted, fmt], [1.0, 0.2])
    first, second = ["4", "4", "4"], ["5", "5", "5"]
    assert _score(trainer, first)[0] == [1.0] * 3
    assert _score(trainer, second)[0] == [0.0] * 3
    assert len(n) == 2 and [f.__name__ for f in trainer.reward_funcs] == ["counted", "fmt"]


# ---------------------------------------------------------------- real runs


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("kind") == kind]


@pytest.mark.slow
def test_the_seam_scenarios_of_the_chaos_matrix_are_detected_and_end_on_the_baseline(tmp_path):
    proc = run_ptops(
        "chaos",
        "--recipe",
        "trl-grpo-tiny",
        "--scenario",
        "grader-crash",
        "--scenario",
        "grader-timeout",
        "--work-dir",
        str(tmp_path),
        "--json",
        timeout=900,
    )
    report = json.loads(proc.stdout)
    res = {r["kind"]: r for r in report["scenarios"]}
    assert proc.returncode == 0, {k: r["problems"] for k, r in res.items()}
    crash, timeout = res["grader-crash"], res["grader-timeout"]
    for r in (crash, timeout):
        assert r["passed"] and r["fired"] and r["digest"] == r["baseline_digest"], r
    # a failed try, retried: no rank restarted, the step's record counts the retry
    assert crash["detected_by"] == "grader_failed" and crash["restarts"] == 0
    run = Path(crash["run_dir"])
    (failed,) = _events(run, "grader_failed")
    assert (failed["rank"], failed["step"], failed["retried"], failed["no_verdict"]) == (
        1,
        6,
        True,
        0,
    )
    assert records_by_rank(run)[1][6]["grader/retries"] == 1.0
    # a reward call that never returns: a hang in the reward seam, restarted
    assert timeout["detected_by"] == "hang" and timeout["restarts"] == 1
    (hang,) = _events(Path(timeout["run_dir"]), "hang")
    assert hang["phase"] == "reward" and hang["step"] == 6


@pytest.mark.slow
def test_a_grader_that_stays_down_leaves_its_completions_unscorable_and_counted(tmp_path):
    run = tmp_path / "down"
    proc = run_ptops(
        "launch",
        "trl-grpo-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--no-mlflow",
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.interval=2",
        "--fault",
        "grader-crash:step=3,mode=persistent",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records_by_rank(run)
    for rank in range(NPROC):
        for step in (1, 2):  # graded: a reward, no failure
            assert recs[rank][step]["grader/no_verdict"] == 0.0
            assert recs[rank][step]["reward"] is not None
        for step in (3, 4):  # down: every completion of the rank's batch unscorable, none scored
            assert recs[rank][step]["grader/no_verdict"] > 0
            assert recs[rank][step].get("reward") is None, recs[rank][step]
    finals = [e for e in _events(run, "grader_failed") if not e["retried"]]
    assert {(e["rank"], e["step"]) for e in finals} == {
        (r, s) for r in range(NPROC) for s in (3, 4)
    }
    assert all(e["no_verdict"] > 0 for e in finals)
    diag = run_ptops("diagnose", str(run), "--json", timeout=120)
    rows = json.loads(diag.stdout)["findings"]
    named = [r for r in rows if r["monitor"] == "grader_failed"]
    assert named and all(r["runbook"] == "GraderNoVerdict" for r in named), rows
