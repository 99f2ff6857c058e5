"""Code-reward data that cannot be vacuous (issue 49 point 5): at load, a row whose hidden tests an
answer solving nothing passes (the empty string, a constant, ``None``, a function returning its
input) is refused with one line naming the source, the row and the test. Nothing here runs a
sandbox: the verdicts are the grader's own comparison on plain values."""

from __future__ import annotations

import pytest

from ptops.recipes.trl.rewards import check_code_rows, code_dataset, vacuous_test

PROMPT = [{"role": "user", "content": "Write f(x)."}]

# (tests, what the one line must say): each loaded before issue 49
VACUOUS = [
    (['assert f(1) in "abcdef"'], r"`in` the string 'abcdef' is passed by the empty string"),
    (['assert f(1) in ""'], r"`in` the string '' is passed by the empty string"),
    (["assert True"], r"True is a literal, not the completion's answer"),
    (["assert 1 == 1"], r"1 is a literal, not the completion's answer"),
    (["assert 'a' in 'abc'"], r"'a' is a literal"),
    (["assert f(1) == 0", "assert f(2) == 0"], r"an answer of 0 passes every one"),
    (["assert f(1) == []", "assert f(2) == []"], r"an answer of \[\] passes every one"),
    (["assert f(1) is None"], r"an answer of None passes every one \(expected: is None\)"),
    (["assert f(3)"], r"an answer of True passes every one \(expected: truthy\)"),
    (["assert not f(3)"], r"an answer of '' passes every one \(expected: falsy\)"),
    (["assert f(1) in [0, 1, 2]"], r"an answer of 0 passes every one"),
    (["assert f(1) == False", "assert f(2) == 0"], r"an answer of 0 passes every one"),
    (["assert f(3) == 3", "assert f(4) == 4"], r"a function returning its argument 1 passes"),
    (["assert f('ab') == 'ab'"], r"a function returning its argument 1 passes"),
    (["assert biggest(5, 2) == 5", "assert biggest(9, 4) == 9"], r"returning its argument 1"),
    (["assert smallest(5, 2) == 2", "assert smallest(9, 4) == 4"], r"returning its argument 2"),
]

HONEST = [
    ["assert f(2) == 4"],
    ["assert is_even(3) == False", "assert is_even(4) == True"],
    ["assert biggest(5, 2) == 5", "assert biggest(1, 4) == 4"],
    ["assert f(1) in [3, 4]"],
    ["assert f(1) is None", "assert f(2) == 5"],
    ["assert add(-3, 3) == 0", "assert add(1, 2) == 3"],
]


@pytest.mark.parametrize("tests,says", VACUOUS)
def test_vacuous_tests_are_refused_at_load_with_one_line_naming_the_row(tests, says):
    good = {"prompt": PROMPT, "tests": ["assert f(2) == 4"]}
    with pytest.raises(ValueError) as e:
        check_code_rows([good, good, {"prompt": PROMPT, "tests": tests}], source="tasks.jsonl")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("tasks.jsonl row 2: vacuous: ")
    assert tests[0] in msg
    assert __import__("re").search(says, msg), msg


@pytest.mark.parametrize("tests", HONEST)
def test_honest_tests_load(tests):
    row = {"prompt": PROMPT, "tests": tests}
    assert check_code_rows([row]) == [row]
    assert vacuous_test(tests) is None


def test_the_built_in_code_data_has_no_vacuous_row():
    """Before issue 49, 23 of the first 256 rows were passed by a function returning one of its
    arguments (15 by `return a`, 8 by `return b`: biggest / smallest whose answer was the same
    argument three times), e.g. row 33: biggest(1, -7), (6, -9), (5, -1)."""
    rows = code_dataset(1024)
    assert all(vacuous_test(r["tests"]) is None for r in rows)
    assert rows[33]["tests"] != [
        "assert biggest(1, -7) == 1",
        "assert biggest(6, -9) == 6",
        "assert biggest(5, -1) == 5",
    ]
    # rows that were not vacuous are unchanged (the redraw has its own random stream)
    assert rows[0]["tests"] == code_dataset(1)[0]["tests"]
