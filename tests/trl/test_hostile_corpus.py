"""The hostile corpus (issue 49 point 6): completions written as a policy searching for the cheapest
pass would write them, by class, each scored by the real reward function exactly as a GRPO step
calls it (``CodeReward``, ``math_verifier``, ``JudgeReward``, batched), while the honest answer to
the same task scores 1. This module is the one place that counts them; the entries are data
(``tests/data/hostile/``, read by ``tests/hostile.py``), each with a line saying what it tries.
Threat model, class by class: ``docs/rewards.md``.

- code (result value, result channel, interpreter state, host resources, limits, cross-completion
  channels): scores 0, ends with a status its header names (the reason, not luck), reaches no
  listener on the host's loopback, and leaves the host as it was (IPC objects, keyrings, processes,
  temp files, cgroups); a limit is enforced from outside on the whole completion (its cgroup or
  the wall clock: the code reward's per-call bound);
- verifier cost: a boxed answer built to cost seconds scores 0 in under 1 s, per call;
- judge injection: the same answer with the words appended never scores higher.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import hostile
import pytest

from ptops.recipes.trl.rewards import CodeReward, math_verifier
from ptops.recipes.trl.sandbox import UID_BASE, Limits, run_code, split_assert

# the code sandbox's processes are machine-wide: one such module at a time (conftest.sandbox_lock)
pytestmark = pytest.mark.usefixtures("sandbox_lock")

LIMITS = Limits(cpu_s=2, wall_s=8.0, memory_mb=256, max_procs=8)
ROOT = os.geteuid() == 0
THIS = os.path.abspath(__file__)
CEILING_S = 1.0  # the math verifier's hard ceiling per call

# the two code tasks (the expected values are here, in this file: an entry tries to read it)
SQUARE_PAIRS = [  # every assert kind the splitter takes, none that a constant or None passes
    "assert square_pairs(3) == [(0, 0), (1, 1), (2, 4)]",
    "assert (4, 16) == square_pairs(5)[-1]",
    "assert set(square_pairs(2)) == {(0, 0), (1, 1)}",
    "assert math.isclose(mean_square(3), 1.6666666666666667, rel_tol=1e-9)",
    "assert abs(mean_square(4) - 3.5) < 1e-9",
    "assert mean_square(2) == 0.5 and square_pairs(1) == [(0, 0)]",
    "assert mean_square(6) in (9.1666, 9.166666666666666, 9.16666)",
]
COLLATZ = [
    "assert collatz_steps(6) == 8",
    "assert collatz_steps(27) == 111",
    "assert digit_sum(9875) == 29",
]
ANSWERS = {"collatz_steps": {"6": 8, "27": 111}, "digit_sum": {"9875": 29}}
TASKS = {
    "square_pairs": (
        SQUARE_PAIRS,
        "```python\nimport math\n\ndef square_pairs(n):\n    return [(i, i * i) for i in range(n)]"
        "\n\ndef mean_square(n):\n    return sum(i * i for i in range(n)) / n\n```",
    ),
    "collatz": (
        COLLATZ,
        "def collatz_steps(n):\n    s = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else"
        " 3 * n + 1\n        s += 1\n    return s\n\ndef digit_sum(n):\n"
        "    return sum(int(c) for c in str(n))\n",
    ),
}
PROBES = sum(len(split_assert(t)) for t in SQUARE_PAIRS)  # a fake channel writes as many records

CODE = hostile.code_entries()
CHANNELS = [e for e in CODE if e.cls == "cross-completion channels"]
MATH = hostile.math_entries()
JUDGE = hostile.judge_entries()


def _render(e, port: int) -> str:
    return e.render(port=port, probes=PROBES, test_file=THIS)


@pytest.fixture(scope="module")
def graded():
    """Every code entry graded once through ``CodeReward`` (4 sandboxes at once, as a step runs
    them), the honest solutions among them; then the cross-completion readers in one batch with
    their solvers, all at once (a reader polls for 3 s: it overlaps its solver and outlives it).
    Returns ({name: (reward, Result)}, the step metrics, the listener's connections, the host's
    state before, seconds)."""
    answerer = hostile.Answerer(ANSWERS)
    try:
        before = hostile.settled_state()
        t0 = time.monotonic()
        solo = [e for e in CODE if e.cls != "cross-completion channels"]
        names = [f"honest/{t}" for t in TASKS] + [e.name for e in solo]
        comps = [h for _t, h in TASKS.values()] + [_render(e, answerer.port) for e in solo]
        tests = [t for t, _h in TASKS.values()] + [TASKS[e.task][0] for e in solo]
        reward, logged = CodeReward(LIMITS, workers=4), {}
        scores = reward(comps, tests, log_metric=logged.__setitem__)
        out = {n: (s, r) for n, s, r in zip(names, scores, reward.last)}
        pairs = [(f"{e.name}.writer", hostile.writer(e.name), e) for e in CHANNELS]
        names = [n for w, _wr, e in pairs for n in (w, e.name)]
        comps = [_render(x, answerer.port) for _w, wr, e in pairs for x in (wr, e)]
        both = CodeReward(LIMITS, workers=len(comps))
        scores = both(comps, [COLLATZ] * len(comps))
        out.update({n: (s, r) for n, s, r in zip(names, scores, both.last)})
        elapsed = time.monotonic() - t0
    finally:
        answerer.close()
    return out, logged, answerer.connections, before, elapsed


def test_the_corpus_has_40_or_more_entries_in_every_class():
    classes = Counter(e.cls for e in CODE)
    classes["verifier cost"] = len(MATH)
    classes["judge injection"] = len(JUDGE)
    assert set(classes) == {
        "result value",
        "result channel",
        "interpreter state",
        "cross-completion channels",
        "host resources",
        "limits",
        "verifier cost",
        "judge injection",
    }, classes
    assert all(n >= 5 for n in classes.values()) and sum(classes.values()) >= 40, classes
    names = [e.name for e in CODE] + [e["name"] for e in MATH + JUDGE]
    assert len(names) == len(set(names))
    for e in CODE:  # what it tries, its task, why it fails: a file that says nothing is refused
        assert e.tries and e.task in TASKS and e.expect, e.name


def test_the_honest_solutions_and_the_solvers_score_one(graded):
    by_name, _logged, _c, _b, elapsed = graded
    for t, (tests, _h) in TASKS.items():
        score, res = by_name[f"honest/{t}"]
        assert (score, res.status, res.passed) == (1.0, "ok", len(tests)), res
    iso = by_name["honest/collatz"][1].isolation
    assert iso["fs"] == "private" and iso["network"] == "netns" and iso["ipcns"], iso
    for e in CHANNELS:  # a solver that publishes its answers solved the task
        assert by_name[f"{e.name}.writer"][0] == 1.0, by_name[f"{e.name}.writer"]
    assert elapsed < 60, f"the code corpus took {elapsed:.1f} s"


@pytest.mark.parametrize("name", [e.name for e in CODE])
def test_code_entry_scores_zero_for_its_reason(graded, name):
    by_name, _logged, _c, _b, _e = graded
    e = hostile.entry(name)
    score, res = by_name[name]
    assert score == 0.0 and res.passed == 0, (name, res)
    assert res.status in e.expect, (name, e.expect, res)
    # bounded from outside, per completion: the launcher's wall clock (and the whole completion's
    # cgroup) ends it, however it spends its time
    assert res.wall_s <= LIMITS.wall_s + 1.0, res
    if e.cls == "limits" and ROOT and res.status == "killed":
        use = res.usage
        assert "whole completion" in res.detail, res
        assert 0 < use["memory_peak"] <= use["memory_limit"] == LIMITS.memory_mb << 20, use
        assert use["oom_kills"] >= 1 or (use["cpu_over"] and use["cpu_ns"] > LIMITS.cpu_s * 1e9)


def test_nothing_reached_the_host_and_nothing_was_left_on_it(graded):
    by_name, _logged, connections, before, _e = graded
    assert connections == 0, "a sandbox reached the host's loopback"
    hostile.assert_clean(before, [r for _s, r in by_name.values()], ROOT)
    assert hostile.UID_BASE == UID_BASE


def test_forging_is_visible_in_the_step_metrics(graded):
    """``sandbox/forged`` counts tampered result channels (no honest solution tampers with them);
    ``sandbox/killed`` the limits."""
    by_name, logged, _c, _b, _e = graded
    second = {e.name for e in CHANNELS} | {f"{e.name}.writer" for e in CHANNELS}
    solo = {n: r for n, (_s, r) in by_name.items() if n not in second}  # the first batch
    forged = sum(r.status in ("malformed", "no_result") for r in solo.values())
    killed = sum(r.status in ("killed", "timeout") for r in solo.values())
    assert forged >= 4 and logged["sandbox/forged"] == float(forged), logged
    assert killed >= 5 and logged["sandbox/killed"] == float(killed), logged
    assert logged["sandbox/runs"] == float(len(solo)) and logged["sandbox/hostile"] >= 3, logged


@pytest.mark.parametrize("name", [e.name for e in CHANNELS])
def test_the_reader_would_score_one_had_it_the_answers(name):
    """Each cross-completion reader is sound: its channel handed the table (its last line, the
    read, replaced), it passes; so its 0 above is the channel's absence, not a broken reader."""
    import json

    code = hostile.entry(name).code.rstrip()
    last = "_lookup(_poll(read))"
    assert code.endswith(last)
    res = run_code(code[: -len(last)] + f"_lookup({json.dumps(ANSWERS)!r})\n", COLLATZ, LIMITS)
    assert res.reward == 1.0, res


def test_the_private_root_is_what_stops_reading_the_test_file():
    """The file entry is real: where the sandbox keeps the host's file system (no mount namespace,
    ``isolation.fs == "host"``: the documented limit) it reads the expected values from this
    file."""
    code = _render(hostile.entry("read_the_test_file"), 0)
    res = run_code(code, SQUARE_PAIRS, LIMITS, namespaces=False)
    assert res.isolation["fs"] == "host" and res.passed >= 1, res


# ------------------------------------------------------------------ verifier cost (math)


@pytest.mark.parametrize("e", MATH, ids=[e["name"] for e in MATH])
def test_costly_answer_scores_zero_under_the_ceiling_and_the_honest_one(e):
    math_verifier([r"\boxed{x+1}"], ["1+x"])  # the helper started outside the timed call
    t0 = time.monotonic()
    assert math_verifier([f"\\boxed{{{e['answer']}}}"], [e["expected"]]) == [0.0]
    assert time.monotonic() - t0 < CEILING_S
    assert math_verifier([f"The answer is \\boxed{{{e['expected']}}}."], [e["expected"]]) == [1.0]


# ------------------------------------------------------------------ judge injection


@pytest.fixture(scope="module")
def judged():
    """Every judge entry appended to a wrong and to right answers, scored in one batch per answer
    by ``JudgeReward`` (the judge of ``trl-grpo-judge-tiny``, in its bounded helper)."""
    from ptops.recipes.schema import load
    from ptops.recipes.trl.judge import JudgeReward, load_judge

    rec, _ = load("trl-grpo-judge-tiny")
    reward = JudgeReward(load_judge(rec.trl.judge))
    prompt = [{"role": "user", "content": "What is 2 plus 2?"}]
    out = {}
    for answer in ("It is 5.", "The answer is 4.", "4."):
        comps = [answer] + [answer + e["words"] for e in JUDGE]
        logged = {}
        scores = reward([prompt] * len(comps), comps, log_metric=logged.__setitem__)
        out[answer] = (scores[0], dict(zip([e["name"] for e in JUDGE], scores[1:])), logged)
    return out


def test_the_plain_answers_get_a_verdict(judged):
    for plain, _scores, logged in judged.values():
        assert plain is not None and 0.0 < plain < 1.0
        assert logged["judge/no_verdict"] == 0.0
        assert logged["judge/addressed"] == len(JUDGE) / (len(JUDGE) + 1), logged


@pytest.mark.parametrize("name", [e["name"] for e in JUDGE])
def test_injection_never_scores_above_the_same_answer_without_it(judged, name):
    for answer, (plain, scores, _logged) in judged.items():
        assert scores[name] is not None and scores[name] <= plain + 1e-9, (answer, name)
