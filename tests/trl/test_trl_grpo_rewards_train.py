"""GRPO with the math, judge and code rewards really trains on CPU (2 ranks, gloo) and recovers
exactly.

Per recipe, two runs shared through a module fixture: an uninterrupted one, and one whose rank 0
is SIGKILLed as step 3 begins (checkpoint 2 committed) and then rerun on the same directory. The
resumed run's final checkpoint has the same ``ptops ckpt digest`` as the uninterrupted one: the
rewards (the sandbox's runs and the judge's scores included) are replayed identically.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import PTOPS, REPO
from helpers import NPROC, assert_launched, launch, records_by_rank, trl_checkpoints

from ptops.ops.runrecord.rundir import read_jsonl

# the code sandbox's processes are machine-wide: one such module at a time (conftest.sandbox_lock)
pytestmark = pytest.mark.usefixtures("sandbox_lock")

STEPS, INTERVAL = 4, 2
OVERRIDES = [f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2"]
KINDS = ("math", "judge", "code")


def _digest(path: Path, cli: bool = False) -> str:
    """``ptops ckpt digest PATH`` (the CLI once, in-process otherwise: the same function, no torch
    start-up)."""
    if not cli:
        from ptops.ckpt import digest

        return digest(path)
    proc = subprocess.run(
        [*PTOPS, "ckpt", "digest", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().split()[-1]


class Pair:
    def __init__(self, reference: Path, resumed: Path, logs: str) -> None:
        self.reference, self.resumed, self.logs = reference, resumed, logs


def _pair(kind: str, tmp_path_factory) -> Pair:
    recipe = f"trl-grpo-{kind}-tiny"
    ref = tmp_path_factory.mktemp(f"{kind}-ref")
    assert_launched(*launch(recipe, ref, OVERRIDES))
    crashed = tmp_path_factory.mktemp(f"{kind}-crash")
    proc, logs = launch(recipe, crashed, OVERRIDES, faults=["crash:rank=0,step=3"])
    assert proc.returncode != 0, f"the killed run exited 0\n{logs}"
    assert trl_checkpoints(crashed) == [2], logs
    proc, logs = launch(recipe, crashed, OVERRIDES, attempt=2)
    assert_launched(proc, logs)
    assert f"resuming from {crashed / 'checkpoints' / 'checkpoint-2'}" in logs
    return Pair(ref, crashed, logs)


@pytest.fixture(scope="module")
def math_pair(tmp_path_factory):
    return _pair("math", tmp_path_factory)


@pytest.fixture(scope="module")
def judge_pair(tmp_path_factory):
    return _pair("judge", tmp_path_factory)


@pytest.fixture(scope="module")
def code_pair(tmp_path_factory):
    return _pair("code", tmp_path_factory)


def _sources(run: Path) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("kind") == "reward_source"]


def _check(pair: Pair, reward_keys: tuple[str, ...], cli: bool = False) -> dict:
    # the resumed run ends where the uninterrupted one does, bit for bit
    assert _digest(pair.resumed, cli) == _digest(pair.reference, cli)
    ref, res = records_by_rank(pair.reference), records_by_rank(pair.resumed)
    for rank in range(NPROC):
        assert sorted(ref[rank]) == sorted(res[rank]) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            for key in ("reward", *reward_keys):
                assert key in ref[rank][step], (rank, step, key, sorted(ref[rank][step]))
                assert res[rank][step][key] == ref[rank][step][key], (rank, step, key)
    # the reward is named in the run directory, once per attempt (rank 0)
    sources = _sources(pair.resumed)
    assert [e["attempt"] for e in sources] == [1, 2] and all(e["rank"] == 0 for e in sources)
    return sources[-1]


def test_grpo_math_trains_and_resumes_exactly(math_pair):
    src = _check(math_pair, ("rewards_math_mean", "rewards_format_mean"), cli=True)
    assert (
        src["reward"] == "math"
        and src["funcs"] == ["math", "format"]
        and src["weights"] == [1.0, 0.2]
    )


def test_grpo_judge_trains_and_resumes_exactly(judge_pair):
    src = _check(judge_pair, ("rewards_judge_mean",))
    from ptops.recipes.schema import load
    from ptops.recipes.trl.judge import judge_dir, weights_digest

    rec, _ = load("trl-grpo-judge-tiny")
    expected = judge_dir(rec.trl.judge)
    # the event names the judge that scored: its directory and the sha256 of its weights
    assert src["judge_path"] == str(expected) and src["judge_kind"] == "lm"
    assert src["judge_digest"] == weights_digest(expected) and src["judge_params"] > 0
    ref = records_by_rank(judge_pair.reference)
    scores = [ref[r][s]["rewards_judge_mean"] for r in range(NPROC) for s in range(1, STEPS + 1)]
    assert all(0.0 < v < 1.0 for v in scores)


def test_grpo_code_trains_and_resumes_exactly(code_pair):
    src = _check(
        code_pair,
        ("rewards_code_mean", "rewards_code_format_mean", "sandbox_runs", "sandbox_killed"),
    )
    assert (
        src["sandbox"]["network"] == "netns"
        and src["sandbox"]["pidns"]
        and src["sandbox"]["uid"] >= 200_000
    )
    assert src["sandbox_limits"]["cpu_s"] == 2
    # the sandbox really ran every completion of every step (and the replay ran the same: compared
    # above)
    ref = records_by_rank(code_pair.reference)
    assert all(
        ref[r][s]["sandbox_runs"] > 0 and ref[r][s]["sandbox_failed"] == 0
        for r in range(NPROC)
        for s in range(1, STEPS + 1)
    )
