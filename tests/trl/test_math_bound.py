"""The math verifier's bound (issue 49 point 3): enforced from outside the evaluation
(``ptops.recipes.trl.bounded``: a forked worker killed at its deadline, under memory and CPU
limits), so a ceiling asserted on it is deterministic, not a race; honest equivalents score 1.
The costly answers themselves (many symbols, nested powers, products of sums, huge factorials,
deep nesting: each 0 in under 1 s) are the hostile corpus's verifier-cost class
(``tests/data/hostile/verifier_cost.toml``, ``tests/trl/test_hostile_corpus.py``)."""

from __future__ import annotations

import time

import pytest

from ptops.recipes.trl import bounded
from ptops.recipes.trl.rewards import MATH_STATS, answers_equal, math_verifier

CEILING_S = 1.0

# (completion, expected): honest equivalents, each scores 1 (the first two scored 0 before: the
# exponent's pattern read "2+2x+1" as the exponent of x^2+2x+1)
HONEST = [
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{x^2-1}", "(x-1)(x+1)"),
    (r"\boxed{1+2x}", "2*x+1"),
    (r"\boxed{\frac{x}{2}}", "x/2"),
    (r"\boxed{\sqrt{2}/2}", "1/sqrt(2)"),
    (r"\boxed{(a+b)(a-b)}", "a^2-b^2"),
    (r"\boxed{(x+y)^3}", "x^3+3*x^2*y+3*x*y^2+y^3"),
    (r"\boxed{\frac{7}{8}}", "0.875"),
    (r"\boxed{2 \cdot \pi}", "2pi"),
]


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """The helper starts (sympy imported once) outside the timed calls."""
    assert math_verifier([r"\boxed{x+1}"], ["1+x"]) == [1.0]


@pytest.mark.parametrize("completion,expected", HONEST)
def test_honest_equivalent_scores_one(completion, expected):
    t0 = time.monotonic()
    assert math_verifier([completion], [expected]) == [1.0]
    assert time.monotonic() - t0 < CEILING_S


def test_a_numeric_answer_refuses_free_symbols_without_symbolic_work():
    before = dict(MATH_STATS)
    assert not answers_equal("(a+b+c+d+e+f+g+h)^9", "7")
    assert not answers_equal("x-x+7", "7")  # refused by its symbols, not compared
    assert MATH_STATS["symbolic"] == before["symbolic"]
    assert MATH_STATS["refused"] == before["refused"] + 2


def test_an_overrun_is_killed_at_the_deadline_counted_and_scores_nothing():
    """A comparison that runs past its deadline (denesting sqrt(5+2sqrt(6)): ~50 ms here, against
    a 10 ms deadline) is answered "no verdict" at the deadline, counted, its worker killed and
    replaced: the next call is answered by a fresh worker."""
    cmp = bounded.BoundedComparer()
    try:
        assert cmp.equal("x", "x") is True  # starts the helper
        first = cmp.worker_pid()
        assert first is not None
        before = dict(bounded.STATS)
        t0 = time.monotonic()
        assert cmp.equal("sqrt(2)+sqrt(3)", "sqrt(5+2sqrt(6))", deadline_s=0.01) is None
        assert time.monotonic() - t0 < CEILING_S
        assert bounded.STATS["overrun"] == before["overrun"] + 1
        assert cmp.equal("y", "y") is True  # the replacement answers
        assert cmp.worker_pid() not in (None, first)
        # with room, the same comparison has its verdict
        assert cmp.equal("sqrt(2)+sqrt(3)", "sqrt(5+2sqrt(6))") is True
    finally:
        cmp.close()


def test_a_worker_that_died_is_no_verdict_and_replaced():
    """A worker killed under the helper (its RLIMIT_AS or RLIMIT_CPU does that with SIGKILL /
    SIGXCPU): that call has no verdict, counted as ``died``; the next is answered by a new one."""
    import os
    import signal

    cmp = bounded.BoundedComparer()
    try:
        assert cmp.equal("x", "x") is True
        first = cmp.worker_pid()
        os.kill(first, signal.SIGKILL)
        time.sleep(0.2)
        before = dict(bounded.STATS)
        assert cmp.equal("x", "x") is None
        assert bounded.STATS["died"] == before["died"] + 1
        assert cmp.equal("x", "x") is True
        assert cmp.worker_pid() not in (None, first)
    finally:
        cmp.close()


def test_the_worker_runs_under_memory_and_cpu_limits():
    cmp = bounded.BoundedComparer(memory_mb=768)
    try:
        assert cmp.equal("x", "x") is True
        with open(f"/proc/{cmp.worker_pid()}/limits") as f:
            limits = {line[:26].strip(): line[26:].split() for line in f}
        assert limits["Max address space"][0] == str(768 << 20)
        assert limits["Max cpu time"][0] != "unlimited"
    finally:
        cmp.close()
    assert cmp.worker_pid() is None


def test_the_overrun_is_logged_per_call():
    logged = {}
    math_verifier([r"\boxed{(a+b+c+d+e+f+g+h)^9}"], ["7"], log_metric=logged.__setitem__)
    assert logged == {"math/overrun": 0.0, "math/refused": 1.0}
