"""The code reward against completions written to forge a pass rather than solve the task.

Each forgery is what an RL policy could learn (objects equal to anything, early exits, patched
encoders, fake result lines, frame and memory scans for the expected values, ...): it must score 0
where the honest solution of the same task scores 1. The asserts are split: only their call runs in
the sandbox, the expected values never enter it, and the sandbox's results are decoded strictly and
compared outside (threat model: ``docs/rewards.md``). Also: hidden tests (a completion hard-coding
the prompt's examples scores low), the splitter's refusals at data load, and the strict decoder. The
isolation attacks (fork bomb, ``rm -rf``, memory, network, signals) are in
``tests/trl/test_trl_rewards.py``. All completions of the corpus run once, in parallel, in a module
fixture.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ptops.recipes.trl.rewards import CodeReward, check_code_rows, code_dataset
from ptops.recipes.trl.sandbox import (
    UID_BASE,
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
THIS = str(Path(__file__).resolve())

# the task: every assert kind the splitter takes, none that a constant or None could pass
TESTS = [
    "assert square_pairs(3) == [(0, 0), (1, 1), (2, 4)]",
    "assert (4, 16) == square_pairs(5)[-1]",
    "assert set(square_pairs(2)) == {(0, 0), (1, 1)}",
    "assert math.isclose(mean_square(3), 1.6666666666666667, rel_tol=1e-9)",
    "assert abs(mean_square(4) - 3.5) < 1e-9",
    "assert mean_square(2) == 0.5 and square_pairs(1) == [(0, 0)]",
    "assert mean_square(6) in (9.1666, 9.166666666666666, 9.16666)",
]
# (a bare ``assert CALL`` pays for any truthy value, a constant's too: that is the data's weakness,
# not a forgery of the grader, so the corpus's task has none; the splitter takes them, see ACCEPTED)
PROBES = sum(len(split_assert(t)) for t in TESTS)

HONEST = """```python
import math

def square_pairs(n):
    return [(i, i * i) for i in range(n)]

def mean_square(n):
    return sum(i * i for i in range(n)) / n
```"""

# a forgery defines no honest function: any point it scores is a forged one
_ALWAYS = """
class Always:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __hash__(self): return 0
    def __bool__(self): return True
    def __len__(self): return 1
    def __iter__(self): return iter([self])
    def __getitem__(self, i): return self
    def __sub__(self, other): return 0.0
    def __rsub__(self, other): return 0.0
    def __abs__(self): return 0.0
    def __float__(self): return 0.0
    def __contains__(self, x): return True
"""

_FORGED = _ALWAYS + "def square_pairs(n): return Always()\nmean_square = square_pairs\n"

_FAKE_RECORDS = """
import json
N = PROBES
def fake():
    recs = [json.dumps({"i": i, "ok": True, "v": True}) for i in range(N)]
    return ("\\n".join(recs + [json.dumps({"end": N, "flag": "-"})]) + "\\n").encode()
""".replace(
    "PROBES", str(PROBES)
)  # as many records as the harness writes: the best a forger can do

FORGERIES = {
    # objects that compare equal to anything, or look like the right type
    "always_equal_object": _FORGED,
    "int_float_subclass": (
        "class F(float):\n    def __eq__(self, o): return True\n    __hash__ = float.__hash__\n"
        "    def __sub__(self, o): return 0.0\n"
        "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
        "def square_pairs(n): return I(1)\ndef mean_square(n): return F(0.0)\n"
    ),
    "list_subclass_equal": (
        "class L(list):\n    def __eq__(self, o): return True\n"
        "class T(tuple):\n    def __eq__(self, o): return True\n    __hash__ = tuple.__hash__\n"
        "def square_pairs(n): return L([T((0, 0)), T((1, 1))])\n"
        "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
        "def mean_square(n): return S('x')\n"
    ),
    "class_spoofing": _ALWAYS
    + (
        "class Spoof(Always):\n    __class__ = list\n"
        "def square_pairs(n): return Spoof()\ndef mean_square(n): return Spoof()\n"
    ),
    "lazy_generator": _ALWAYS
    + (
        "def square_pairs(n): return (x for x in [Always(), Always()])\n"
        "def mean_square(n): return map(lambda x: Always(), [n])\n"
    ),
    "huge_int": "def square_pairs(n): return 7 ** 40000\ndef mean_square(n): return 10 ** 4000 + "
    "0.5 // 1\n",
    "cyclic_list": "def square_pairs(n):\n    x = []\n    x.append(x)\n    return x\n"
    "mean_square = square_pairs\n",
    "nan_and_inf": "def square_pairs(n): return [float('nan')]\ndef mean_square(n): return "
    "float('inf')\n",
    "deep_nesting_value": "def square_pairs(n):\n    x = []\n    for _ in "
    "range(100000):\n        x = [x]\n"
    "    return x\nmean_square = square_pairs\n",
    # exits and exceptions before or instead of the harness's results
    "sys_exit_at_import": "import sys\nsys.exit(0)\n",
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "base_exception_at_import": "class Stop(BaseException):\n    pass\nraise Stop()\n",
    "base_exception_in_call": (
        "class Stop(BaseException):\n    pass\n"
        "def square_pairs(n): raise Stop()\ndef mean_square(n): raise KeyboardInterrupt\n"
    ),
    "atexit_writes_results": (
        _FAKE_RECORDS + "import atexit, os\n"
        "atexit.register(lambda: [os.write(fd, fake()) for fd in range(1, 20)])\n"
        "import sys\nsys.exit(0)\n"
    ),
    # the result channel: printed lines, written lines, a patched encoder, threads, descriptors
    "print_fake_results": _FAKE_RECORDS + "import sys\nsys.stdout.write(fake().decode())\n"
    "sys.stdout.flush()\n",
    "write_every_fd_then_exit": (
        _FAKE_RECORDS
        + "import os\nfor fd in range(0, 64):\n    try:\n        os.write(fd, fake())\n"
        "    except OSError:\n        pass\nos._exit(0)\n"
    ),
    "write_every_fd_and_stay": (
        _FAKE_RECORDS
        + "import os\nfor fd in range(0, 64):\n    try:\n        os.write(fd, fake())\n"
        "    except OSError:\n        pass\n" + _FORGED
    ),
    "patched_json_dumps": (
        "import json\n"
        'json.dumps = lambda o, *a, **k: \'{"i": %d, "ok": true, "v": true}\' % o.get(\'i\', 0)'
        " if 'i' in o else '{\"end\": %d, \"flag\": \"-\"}' % o['end']\n" + _FORGED
    ),
    "patched_encoder_in_main": (
        "import sys\nm = sys.modules['__main__']\n"
        "def enc(v, d, n):\n    return True\n"
        "m._enc = enc\nd = list(m._main.__defaults__)\nd[-1] = enc\nm._main.__defaults__ = "
        "tuple(d)\n"
        "def square_pairs(n): return object()\nmean_square = square_pairs\n"
    ),
    "settrace_rewrites_records": (
        "import sys\n"
        "def tr(frame, event, arg):\n"
        "    if '_rec' in frame.f_locals:\n"
        "        r = frame.f_locals['_rec']\n"
        "        if isinstance(r, dict):\n"
        "            r['ok'] = True\n            r['v'] = [[0, 0], [1, 1]]\n"
        "    return tr\n"
        "sys.settrace(tr)\n"
        "def square_pairs(n): return None\nmean_square = square_pairs\n"
    ),
    "thread_floods_channel": (
        _FAKE_RECORDS + "import os, threading, time\n"
        "def spam():\n    while True:\n        for fd in range(3, 16):\n            try:\n"
        "                os.write(fd, fake())\n            except OSError:\n                pass\n"
        "        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\n" + _FORGED
    ),
    "close_result_fds": ("import os\nos.closerange(2, 64)\n" + _FORGED),
    "dup2_devnull_over_fds": (
        "import os\nz = os.open('/dev/null', os.O_WRONLY)\nfor fd in range(1, 64):\n    if fd != "
        "z:\n"
        "        try:\n            os.dup2(z, fd)\n        except OSError:\n            pass\n"
    ),
    "deeply_nested_record": (
        "import os\nline = ('[' * 200000 + ']' * 200000 + '\\n').encode()\nfor fd in range(3, "
        "16):\n"
        "    try:\n        os.write(fd, line * 8)\n    except OSError:\n        pass\n"
    ),
    "builtins_patched": (
        "import builtins\nbuiltins.type = lambda *a: list\nbuiltins.isinstance = lambda *a: True\n"
        "builtins.AssertionError = KeyError\nbuiltins.len = lambda x: 0\n" + _FORGED
    ),
    # looking for the expected values: frames, the heap, files, other processes
    "frame_and_heap_scan": (
        "import sys, gc, re\nfound = {}\n"
        "for obj in gc.get_objects():\n"
        "    for s in (obj if isinstance(obj, (list, tuple)) else [obj]):\n"
        "        if isinstance(s, str) and '==' in s and 'square_pairs' in s:\n"
        "            found[s.split('==')[0]] = s\n"
        "f = sys._getframe()\nwhile f is not None:\n"
        "    for k, v in list(f.f_locals.items()) + list(f.f_globals.items()):\n"
        "        if isinstance(v, str) and '==' in v:\n            found[k] = v\n"
        "    f = f.f_back\n"
        "def square_pairs(n):\n    for s in found.values():\n"
        "        m = re.search(r'square_pairs\\(%d\\) == (.*)$' % n, s)\n"
        "        if m:\n            return eval(m.group(1))\n"
        "mean_square = square_pairs\n"
    ),
    "read_the_test_file": (
        "import re, os\nsrc = ''\nfor p in [%r, "
        "os.path.expanduser('~/tests/test_code_forgery.py')]:\n"
        "    try:\n        src += open(p).read()\n    except OSError:\n        pass\n"
        "for pid in os.listdir('/proc'):\n    try:\n        src += open('/proc/%%s/cmdline' %% "
        "pid).read()\n"
        "        src += open('/proc/%%s/environ' %% pid).read()\n    except OSError:\n        "
        "pass\n"
        "def square_pairs(n):\n"
        "    m = re.search(r'square_pairs\\(%%d\\) == (\\[.*?\\])' %% n, src)\n"
        "    return eval(m.group(1)) if m else None\n"
        "mean_square = square_pairs\n"
    )
    % THIS,
    "parent_memory": (
        "import os\nraw = b''\nfor pid in ['1', str(os.getppid()), 'self']:\n"
        "    try:\n        with open('/proc/%s/mem' % pid, 'rb') as f:\n            raw += "
        "f.read(1 << 20)\n"
        "    except (OSError, ValueError):\n        pass\n"
        "def square_pairs(n): return raw or None\nmean_square = square_pairs\n"
    ),
    "argv_env_stdin_scan": (
        "import sys, os, re\nsrc = ' '.join(sys.argv) + repr(dict(os.environ)) + sys.stdin.read()\n"
        "for fd in range(3, 16):\n    try:\n        src += os.read(fd, 1 << 16).decode('utf-8', "
        "'replace')\n"
        "    except OSError:\n        pass\n"
        "def square_pairs(n):\n    m = re.search(r'square_pairs\\(%d\\) == (\\[.*?\\])' % n, src)\n"
        "    return eval(m.group(1)) if m else None\nmean_square = square_pairs\n"
    ),
    # another program in its place, a child that writes after the harness
    "exec_fake_harness": (
        _FAKE_RECORDS + "import os, sys\n"
        "prog = 'import os, sys; os.write(3, ' + repr(fake()) + ')'\n"
        "os.execv(sys.executable, [sys.executable, '-c', prog])\n"
    ),
    "fork_child_writes_late": (
        _FAKE_RECORDS + "import os, time\n"
        "if os.fork() == 0:\n    time.sleep(0.3)\n    for fd in range(3, 16):\n        try:\n"
        "            os.write(fd, fake())\n        except OSError:\n            pass\n    "
        "os._exit(0)\n" + _FORGED
    ),
    "signal_exits_harness": (
        "import signal, sys\n"
        "def stop(*_):\n    raise SystemExit(0)\n"
        "signal.signal(signal.SIGALRM, stop)\nsignal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)\n"
        + _ALWAYS
        + "def square_pairs(n):\n    import time; time.sleep(0.05); return Always()\n"
        "mean_square = square_pairs\n"
    ),
}


@pytest.fixture(scope="module")
def graded():
    """Every completion of the corpus graded once, in parallel: ({name: (reward, Result)}, seconds,
    the step metrics logged)."""
    names = ["honest", *FORGERIES]
    comps = [HONEST, *FORGERIES.values()]
    reward = CodeReward(LIMITS, workers=4)
    t0 = time.monotonic()
    logged = {}
    scores = reward(comps, [TESTS] * len(comps), log_metric=logged.__setitem__)
    elapsed = time.monotonic() - t0
    return {n: (s, r) for n, s, r in zip(names, scores, reward.last)}, elapsed, logged


def test_the_honest_solution_scores_one(graded):
    by_name, elapsed, _ = graded
    score, res = by_name["honest"]
    assert (score, res.status, res.passed, res.total) == (1.0, "ok", len(TESTS), len(TESTS)), res
    assert res.isolation["fs"] == "private" and res.isolation["network"] == "netns", res.isolation
    assert elapsed < 60, f"the corpus took {elapsed:.1f} s"


def test_forging_is_visible_in_the_step_metrics(graded):
    """``sandbox/forged`` counts tampered result channels (no honest solution tampers with them)."""
    by_name, _, logged = graded
    forged = sum(r.status in ("malformed", "no_result") for _s, r in by_name.values())
    assert forged >= 4 and logged["sandbox/forged"] == float(forged)
    assert logged["sandbox/runs"] == float(len(by_name)) and logged["sandbox/hostile"] >= 1


# the class of each forgery (issue 49's classes; the isolation corpus's cross-completion
# channels, host resources, limits and interpreter state are in tests/trl/test_sandbox_isolation.py)
CLASS = {
    **dict.fromkeys(
        [
            "always_equal_object",
            "int_float_subclass",
            "list_subclass_equal",
            "class_spoofing",
            "lazy_generator",
            "huge_int",
            "cyclic_list",
            "nan_and_inf",
            "deep_nesting_value",
        ],
        "result value",
    ),
    **dict.fromkeys(
        [
            "sys_exit_at_import",
            "os_exit_at_import",
            "base_exception_at_import",
            "base_exception_in_call",
            "atexit_writes_results",
            "print_fake_results",
            "write_every_fd_then_exit",
            "write_every_fd_and_stay",
            "thread_floods_channel",
            "close_result_fds",
            "dup2_devnull_over_fds",
            "deeply_nested_record",
            "exec_fake_harness",
            "fork_child_writes_late",
            "signal_exits_harness",
        ],
        "result channel",
    ),
    **dict.fromkeys(
        [
            "patched_json_dumps",
            "patched_encoder_in_main",
            "settrace_rewrites_records",
            "builtins_patched",
            "frame_and_heap_scan",
            "argv_env_stdin_scan",
        ],
        "interpreter state",
    ),
    **dict.fromkeys(["read_the_test_file", "parent_memory"], "host resources"),
}


def test_the_corpus_is_large_enough():
    assert len(FORGERIES) >= 15
    assert set(CLASS) == set(FORGERIES), set(CLASS) ^ set(FORGERIES)


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_scores_zero(graded, name):
    by_name, _, logged = graded
    score, res = by_name[name]
    assert score == 0.0 and res.passed == 0, (name, res)
    assert res.status in {"ok", "no_result", "malformed", "error", "killed", "hostile"}, res
    left = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) >= UID_BASE]
    assert not left, "a sandbox outlived its run"


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def test_why_forgeries_fail(graded):
    """Not only zero, but for the reason the threat model gives (a weaker reason would be luck)."""
    by_name, _, logged = graded
    status = {n: r.status for n, (_s, r) in by_name.items()}
    want = {
        "no_result": {"os_exit_at_import", "dup2_devnull_over_fds", "deeply_nested_record"},
        "malformed": {"write_every_fd_and_stay"},
        "hostile": {"exec_fake_harness"},  # the audit hook refuses the exec, and the run scores 0
        "error": {"close_result_fds"},  # the harness could not write its results
        # the channel held; the values were wrong, refused by the decoder, or forged plain claims
        "ok": {
            "always_equal_object",
            "int_float_subclass",
            "list_subclass_equal",
            "class_spoofing",
            "lazy_generator",
            "huge_int",
            "cyclic_list",
            "nan_and_inf",
            "sys_exit_at_import",
            "base_exception_at_import",
            "base_exception_in_call",
            "atexit_writes_results",
            "print_fake_results",
            "write_every_fd_then_exit",
            "patched_json_dumps",
            "patched_encoder_in_main",
            "frame_and_heap_scan",
            "read_the_test_file",
            "parent_memory",
            "deep_nesting_value",
            "argv_env_stdin_scan",
        },
    }
    for st, names in want.items():
        for n in names:
            assert status[n] == st, (n, by_name[n][1])
    # racing a thread or a trace against the harness: malformed when it wrote in time, wrong values
    # if not (the late child dies with the harness, pid 1 of its namespace, unless a loaded machine
    # lets it write first)
    for n in (
        "thread_floods_channel",
        "settrace_rewrites_records",
        "builtins_patched",
        "signal_exits_harness",
        "fork_child_writes_late",
    ):
        assert status[n] in ("ok", "malformed", "error", "no_result"), (n, by_name[n][1])


def test_the_private_root_is_what_stops_reading_the_test_file():
    """The file forgery is real: where the sandbox keeps the host's file system (no mount namespace,
    ``isolation.fs == "host"``: the documented limit) it reads the expected values from this
    file."""
    from ptops.recipes.trl.sandbox import run_code

    res = run_code(FORGERIES["read_the_test_file"], TESTS, LIMITS, namespaces=False)
    assert res.isolation["fs"] == "host" and res.passed >= 1, res


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
