"""The code reward's data-side defences against a policy: graded tests are hidden (a completion
hard-coding the prompt's examples scores low), an assert the grader cannot split (call inside,
expected value outside) is refused when the data loads, and the sandbox's results are decoded
strictly. The forgeries themselves (objects equal to anything, early exits, patched encoders, fake
result lines, frame and memory scans, ...) are entries of the hostile corpus,
``tests/data/hostile/``, run by ``tests/trl/test_hostile_corpus.py`` (threat model:
``docs/rewards.md``).
"""

from __future__ import annotations

import pytest

from ptops.recipes.trl.rewards import CodeReward, check_code_rows, code_dataset
from ptops.recipes.trl.sandbox import (
    AssertRefused,
    Limits,
    decode_result,
    holds,
    plain_value,
    split_assert,
)

# the code sandbox's processes are machine-wide: one such module at a time (conftest.sandbox_lock)
pytestmark = pytest.mark.usefixtures("sandbox_lock")

LIMITS = Limits(cpu_s=2, wall_s=8.0, memory_mb=256, max_procs=8)


# ---------------------------------------------------------------- hidden tests


def test_hard_coding_the_shown_examples_scores_low():
    """The prompt shows two examples; the reward runs three others. A completion that returns the
    shown answers (and the honest answer nowhere else) scores low; the honest one scores 1."""
    from ptops.recipes.trl.rewards import CODE_TASKS

    rows = code_dataset(len(CODE_TASKS))
    hard, honest = [], []
    for row, (_sig, _does, name, _fn) in zip(rows, CODE_TASKS):
        table = {}
        for ex in row["examples"]:
            (c,) = split_assert(ex)
            table[c.probe.split("(", 1)[1].rstrip(")")] = c.expected
            assert c.probe.replace(" ", "") in row["prompt"][0]["content"].replace(" ", "")
        cases = "".join(f"    if (a, b) == ({k}):\n        return {v}\n" for k, v in table.items())
        hard.append(f"def {name}(a, b):\n{cases}    return 0\n")
        op = {
            "add": "a + b",
            "sub": "a - b",
            "mul": "a * b",
            "biggest": "max(a, b)",
            "smallest": "min(a, b)",
        }[name]
        honest.append(f"def {name}(a, b):\n    return {op}\n")
    reward = CodeReward(LIMITS, workers=4)
    tests = [r["tests"] for r in rows]
    assert reward(honest, tests) == [1.0] * len(rows)
    got = reward(hard, tests)
    assert sum(got) / len(got) < 0.2, got


def test_code_rows_refuse_tests_shown_in_the_prompt_and_unsplittable_asserts():
    row = {
        "prompt": [{"role": "user", "content": "Write add(a, b). For example add(1, 2) == 3."}],
        "tests": ["assert add(4, 5) == 9"],
        "examples": ["assert add(1, 2) == 3"],
    }
    assert check_code_rows([row]) == [row]
    with pytest.raises(
        ValueError, match=r"row 0: the graded call add\(1, 2\) is shown in the prompt"
    ):
        check_code_rows([{**row, "tests": ["assert add(1,2) == 3"]}])
    with pytest.raises(ValueError, match=r"row 1: cannot grade 'assert add\(4, 5\) != 3'"):
        check_code_rows([row, {**row, "tests": ["assert add(4, 5) != 3"]}])
    rows = code_dataset(40)
    for r in rows:  # shown and hidden inputs differ in every row
        shown = {split_assert(t)[0].probe for t in r["examples"]}
        assert len(r["tests"]) == 3 and not shown & {split_assert(t)[0].probe for t in r["tests"]}


# ---------------------------------------------------------------- the splitter and the decoder


ACCEPTED = {
    "assert f(1) == 2": [("f(1)", "eq", 2)],
    "assert 2 == f(1)": [("f(1)", "eq", 2)],
    "assert f([1, 2], k='a') == (1, 'x')": [("f([1, 2], k='a')", "eq", (1, "x"))],
    "assert set(f(3)) == set([1, 2])": [("set(f(3))", "eq", {1, 2})],
    "assert f(-1) is None": [("f(-1)", "is", None)],
    "assert f(2)": [("f(2)", "truthy", None)],
    "assert not f(2)": [("f(2)", "falsy", None)],
    "assert f(1) == 1 and g(2) == [2]": [("f(1)", "eq", 1), ("g(2)", "eq", [2])],
    "assert f(2) in [1, 2]": [("f(2)", "in", [1, 2])],
    "assert f(2 ** 10)[0] == 'a'": [("f(2 ** 10)[0]", "eq", "a")],
    "assert 1 + 1 == 2": [("1 + 1", "eq", 2)],
}

REFUSED = [
    "assert f(1) != 2",  # pays for any wrong value
    "assert (f(1) == 2) == True",  # the comparison would run inside
    "assert bool(f(1) == 2)",
    "assert f(1) + 1 == 3",  # arithmetic on the completion's value runs inside
    "assert str(f(1)) == x",  # no literal expected value
    "assert f(1) == g(2)",
    "assert f(1) < 3",
    "assert 1 < f(1) < 3",
    "assert f(lambda x: x == 2) == 1",
    "assert [x for x in f(1)] == [1]",
    "x = 1",
    "assert f(1) == 1; import os",
    "assert f(1) == float('inf')",
    "assert f(1) == 1e999",
    "assert f(1) == 1j",
    "assert f(f'{g(1)}') == 'a'",
]


@pytest.mark.parametrize("src", sorted(ACCEPTED))
def test_split_assert_accepts(src):
    got = [(c.probe, c.kind, c.expected) for c in split_assert(src)]
    assert got == ACCEPTED[src]


@pytest.mark.parametrize("src", REFUSED)
def test_split_assert_refuses(src):
    with pytest.raises(AssertRefused, match="cannot grade|not plain"):
        split_assert(src)


def test_close_checks_are_judged_outside():
    (c,) = split_assert("assert math.isclose(f(1), 0.5, rel_tol=1e-3)")
    assert c.kind == "close" and holds(c, 0.5004) and not holds(c, 0.51)
    assert not holds(c, "0.5") and not holds(c, True)
    (c,) = split_assert("assert abs(f(1) - 2.0) <= 0.1")
    assert holds(c, 2.05) and holds(c, 2) and not holds(c, 2.2) and not holds(c, [2.0])
    (c,) = split_assert("assert f(1) is True")
    assert holds(c, True) and not holds(c, 1)


@pytest.mark.parametrize(
    "line",
    [
        '{"i": 0, "ok": true, "v": NaN}',
        '{"i": 0, "ok": true, "v": Infinity}',
        '{"v": 1e999}',
        '{"v": ' + "9" * 2000 + "}",
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_decoder_refuses(line):
    with pytest.raises(ValueError):
        decode_result(line)


@pytest.mark.parametrize(
    "tree",
    [
        {"x": [1]},
        {"t": [1], "s": [2]},
        {"s": [[1]]},
        {"d": [[[1], 2]]},
        {"d": [[1, 2, 3]]},
        {"b": "zz"},
        {"t": "abc"},
        "a" * 20_000,
        [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]],
        list(range(20_000)),
    ],
)
def test_plain_value_refuses(tree):
    with pytest.raises((ValueError, TypeError)):
        plain_value(tree)


def test_plain_value_round_trip():
    tree = decode_result(
        '{"t": [1, 2.5, "x", null, true, {"s": [1, 2]}, {"f": [3]},'
        ' {"d": [[{"t": [1]}, [2]]]}, {"b": "00ff"}]}'
    )
    assert plain_value(tree) == (
        1,
        2.5,
        "x",
        None,
        True,
        {1, 2},
        frozenset({3}),
        {(1,): [2]},
        b"\x00\xff",
    )
