"""Programmatic, verifiable GRPO rewards for the arithmetic prompt data set.

``correct`` is the verifiable reward: 1.0 when the last number in the completion
equals the row's ``answer`` column, else 0.0. ``format`` gives a small shaped
reward for answering with a number at all, so that a freshly initialised tiny
model still sees non-zero reward variance (and GRPO a non-zero advantage).

A deliberately *gameable* setup for reward-hacking drills (``[trl] reward =
"length"``): the trained reward is ``length`` (pays for the completion's length
in characters: a policy games it by preferring long tokens, and says nothing
useful), and the held-out ``verifier`` (graded correctness of the final number:
1.0 exact, falling linearly to 0.0 at 40 away, 0.0 without a number) is logged
as ``rewards/verifier/mean`` with weight 0, so it never trains the policy. The
``reward_hacking`` monitor reads ``reward`` against ``rewards/verifier/mean``
(and ``completions/mean_length``). The verifier is graded, not exact, so that an
untrained tiny model starts above zero and a fall is visible.

GRPO rewards beyond arithmetic (``[trl] reward``): ``math`` (:func:`math_verifier`: the
final answer parsed and compared exactly, as fractions, or symbolically with sympy when it is
installed), ``judge`` (an LLM judge, :mod:`ptops.recipes.trl.judge`), ``code`` (the completion
run against test asserts in :mod:`ptops.recipes.trl.sandbox`). Every reward is a pure function
of the completion text and the row's columns, so a resumed run computes the same rewards (the
sandbox is the one that runs something; its outcome is still decided by the code alone).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    # conversational: [{"role": "assistant", "content": ...}]
    return "".join(m.get("content", "") or "" for m in completion if isinstance(m, dict))


def correct(completions, answer, **_: object) -> list[float]:
    out = []
    for completion, expected in zip(completions, answer):
        numbers = _NUMBER.findall(_text(completion))
        out.append(1.0 if numbers and numbers[-1] == str(expected).strip() else 0.0)
    return out


def format(completions, **_: object) -> list[float]:  # noqa: A001 - the name shows up as rewards/format
    return [1.0 if _NUMBER.search(_text(c)) else 0.0 for c in completions]


def length(completions, **_: object) -> list[float]:
    """Gameable: completion length in characters / 64 (no cap). Pays for verbosity, not for
    answers."""
    return [len(_text(c)) / 64.0 for c in completions]


def verifier(completions, answer, **_: object) -> list[float]:
    """Held-out graded correctness: 1 - |last number - answer| / 40, floored at 0; 0 without a
    number."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = _NUMBER.findall(_text(completion))
        try:
            got, want = int(numbers[-1]), int(str(expected).strip())
        except (IndexError, ValueError):
            out.append(0.0)
            continue
        out.append(max(0.0, 1.0 - abs(got - want) / 40.0))
    return out


# ---------------------------------------------------------------- math verifier


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*\$?\s*([-+\u2212]?[\d.,]+(?:\s*/\s*\d+)?|\\d?frac\{[^{}]*\}\{[^{}]*\})",
    re.IGNORECASE,
)
_LAST_NUMBER = re.compile(r"[-+\u2212]?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
# what sympy may see: numbers, single-letter symbols, sqrt, pi, + - * / ^ ( ); nothing that reaches
# Python
_SAFE_EXPR = re.compile(r"^[0-9a-z+\-*/^(). ]{1,64}$")
_NAMES = re.compile(r"[a-z]+")
_ALLOWED_NAMES = {"sqrt", "pi"}


# adversarial bounds (issue 23): a longer completion is not graded, more distinct boxed answers than
# this are a hedge, a longer answer is compared as text only; every step is then linear and bounded
MAX_MATH_CHARS = 32_000
MAX_BOXES = 8
MAX_ANSWER_CHARS = 160


def boxed_answers(text: str) -> list[str]:
    r"""The contents of every ``\boxed{...}`` (braces balanced), in order. One pass over the text
    (the partner of every brace first), so thousands of unclosed boxes cost no more than one."""
    close: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            close[stack.pop()] = i
    out = []
    for m in _BOXED.finditer(text):
        end = close.get(m.end() - 1)
        if end is not None:
            out.append(text[m.end() : end].strip())
    return out


def _prompt_text(prompt) -> str:
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "") or "") for m in prompt if isinstance(m, dict))


def strip_prompt_echo(text: str, prompt) -> str:
    """The completion without what it copied from the prompt (the whole prompt, or any line of it
    or sentence of it of 6+ characters): an echoed question must not supply the "last number"."""
    ptext = _prompt_text(prompt).strip()
    if not ptext:
        return text
    parts = re.split(r"\n|(?<=[.?!])\s+", ptext)
    pieces = [ptext] + [x.strip() for x in parts if len(x.strip()) >= 6]
    for piece in sorted(set(pieces), key=len, reverse=True):
        text = text.replace(piece, " ")
    return text


def extract_answer(completion, prompt=None) -> tuple[str | None, str]:
    r"""(final answer text, how it was found) of a completion.

    Order: ``\boxed{}`` (several boxes with different answers, or one left open, are a hedge:
    ``(None, "ambiguous")``),
    then the last "answer is N" / "answer: N", then the last number; all of it ignoring text
    echoed from the prompt (an empty ``\boxed{}`` is no answer). ``how`` is ``boxed``, ``answer``,
    ``last_number``, ``ambiguous``, ``too_long`` (over ``MAX_MATH_CHARS``: not graded) or ``none``.
    """
    text = _text(completion)
    if len(text) > MAX_MATH_CHARS:
        return None, "too_long"
    rest = strip_prompt_echo(text, prompt)
    every = boxed_answers(rest)
    if len(every) != len(_BOXED.findall(rest)):  # a box left open hides what it holds: no answer
        return None, "ambiguous"
    boxes = [b for b in every if b]
    if boxes:
        distinct = list(dict.fromkeys(normalise_answer(b) for b in boxes))
        # a symbolic comparison (bounded, but not free) only for two spellings: a completion costs
        # at most two bounded comparisons, this one and its grading
        symbolic = len(distinct) == 2
        if len(distinct) > MAX_BOXES or any(
            not answers_equal(b, distinct[-1], symbolic=symbolic) for b in distinct[:-1]
        ):
            return None, "ambiguous"
        return boxes[-1], "boxed"
    found = _ANSWER_IS.findall(rest)
    if found:
        return found[-1].rstrip(".,"), "answer"
    found = _LAST_NUMBER.findall(rest)
    if found:
        return found[-1].rstrip(".,"), "last_number"
    return None, "none"


def normalise_answer(s: str) -> str:
    r"""A canonical spelling: no ``$``/spaces/``\left``, ``\frac{a}{b}`` -> ``(a)/(b)``, thousands
    separators dropped, unicode minus, ``x = 3`` -> ``3``."""
    s = str(s).strip().replace("\u2212", "-").replace("$", "")
    s = _TEXT.sub(r"\1", s)
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\displaystyle"):
        s = s.replace(tok, "")
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi")
    for _ in range(4):  # nested fractions, innermost first
        s = _FRAC.sub(r"(\1)/(\2)", s)
        s = _SQRT.sub(r"sqrt(\1)", s)
    if "=" in s:  # "x = 3" -> "3"
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return re.sub(r"\s+", "", s).lower()


def _as_fraction(s: str):
    from fractions import Fraction

    # ASCII digits only (int() reads any script's digits), no exponent (Fraction("1e99999999") would
    # build that number), bounded length
    if len(s) > MAX_ANSWER_CHARS or not s.isascii() or "e" in s or "_" in s:
        return None

    t = s.replace("(", "").replace(")", "") if re.fullmatch(r"\(?[-+]?\d+\)?/\(?\d+\)?", s) else s
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


# cheap refusals before any symbolic work (issue 49 point 3): more distinct symbols or deeper
# parentheses than an honest final answer needs are not compared at all
MAX_SYMBOLS = 4
MAX_DEPTH = 6
MAX_POWERS = 6
MAX_TERMS = 2000  # a bound on the terms of an answer once expanded (checked before expand)


def _safe_syntax(s: str) -> bool:
    """Whether ``s`` may reach sympy: numbers, single-letter symbols, sqrt, pi and arithmetic, one
    small exponents at most, bounded nesting and symbols. Regular expressions only (no sympy)."""
    if not _SAFE_EXPR.match(s) or re.search(r"[a-z)]\.", s) or re.search(r"\d{13,}", s):
        return False
    # Python number syntax the tokenizer would read: 1e999999 (a float sympy then expands for
    # minutes), 0x1f, 0b1, 0o7, 1j
    if re.search(r"[0-9.][ej]|(?<![0-9])0[xob]", s):
        return False
    if any(len(n) > 1 and n not in _ALLOWED_NAMES for n in _NAMES.findall(s)):
        return False
    # exponents: a digit or a letter, six at most (the exponent itself, not what follows it:
    # ``x^2+1`` has the exponent 2)
    powers = re.findall(r"(?:\^|\*\*)\s*(\(\s*-?[0-9a-z]+\s*\)|-?[0-9]+|[a-z]|.?)", s)
    powers = [p.strip("() ") for p in powers]
    if len(powers) > MAX_POWERS or any(not re.fullmatch(r"-?[0-9]|[a-z]", p) for p in powers):
        return False
    if len(powers) > 1 and _power_of_power(s):
        return False
    depth = 0
    for ch in s:
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_DEPTH or depth < 0:
            return False
    return depth == 0 and len(_symbols(s)) <= MAX_SYMBOLS


_POW = re.compile(r"\^|\*\*")


def _power_of_power(s: str) -> bool:
    """``a^b^c``, ``(x^9)^9``, ``((x+1)^9)^9``: a power whose base or exponent holds a power (the
    tower that builds a number of millions of digits, or a product of the exponents' size)."""
    t = _POW.sub("^", s.replace(" ", ""))
    for i, ch in enumerate(t):
        if ch != "^":
            continue
        rest = t[i + 1 :]
        m = re.match(r"\(?-?[0-9a-z]+\)?", rest)
        if m and rest[m.end() : m.end() + 1] == "^":  # a^b^c
            return True
        if i and t[i - 1] == ")":  # the base is a group: does it hold a power?
            depth, j = 0, i - 1
            while j >= 0:
                depth += (t[j] == ")") - (t[j] == "(")
                if depth == 0:
                    break
                j -= 1
            if "^" in t[max(j, 0) : i]:
                return True
    return False


def _symbols(s: str) -> set[str]:
    """The single-letter symbols of a whitelisted answer (``sqrt`` and ``pi`` are not symbols)."""
    return {n for n in _NAMES.findall(s) if n not in _ALLOWED_NAMES}


def _sympy_expr(s: str):
    """A sympy expression of a whitelisted answer, or None. Never evaluates anything else: only
    numbers, single-letter symbols, sqrt, pi and arithmetic pass, with six one-character
    exponents at most. Runs in the bounded worker (:mod:`ptops.recipes.trl.bounded`), never in
    the trainer."""
    if not _safe_syntax(s):
        return None
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return None
    names = {chr(c): sympy.Symbol(chr(c)) for c in range(ord("a"), ord("z") + 1)}
    names.update(sqrt=sympy.sqrt, pi=sympy.pi)
    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(s, local_dict=names, transformations=transforms, evaluate=True)
    except Exception:  # noqa: BLE001 - anything sympy rejects is "not an answer"
        return None


def _symbolic_equal(a: str, b: str) -> bool:
    """Symbolic equality with sympy, unbounded: called only inside the bounded worker."""
    ea, eb = _sympy_expr(a), _sympy_expr(b)
    if ea is None or eb is None:
        return False
    import sympy

    diff = ea - eb
    if diff == 0:
        return True
    if _terms_bound(diff) > MAX_TERMS:  # (a+b+c+d+e)^9 and the like: not an honest final answer
        return False
    # cheap and sound refusal first: a difference that is clearly non-zero at one rational point
    # (at a number, for a numeric answer) is not identically zero; near zero is no proof: go on
    point = dict(
        zip(sorted(diff.free_symbols, key=str), (sympy.Rational(p, p + 4) for p in _PRIMES))
    )
    try:
        value = diff.evalf(30, subs=point)
        if value.is_Number and value.is_finite and abs(value) > 1e-12:
            return False
    except Exception:  # noqa: BLE001 - no number: decide symbolically
        pass
    expanded = sympy.expand(diff)
    if expanded == 0:
        return True
    # simplify only what is small: its cost grows fast with the expression
    return sympy.count_ops(expanded) <= 12 and bool(sympy.simplify(expanded) == 0)


_PRIMES = (
    3,
    5,
    7,
    11,
    13,
    17,
    19,
    23,
    29,
    31,
    37,
    41,
    43,
    47,
    53,
    59,
    61,
    67,
    71,
    73,
    79,
    83,
    89,
    97,
)


def _terms_bound(e) -> int:
    """An upper bound on the terms of ``e`` once expanded, from its unexpanded tree (cheap): sums
    add, products multiply, a power of an n-term sum by k has at most C(n+k-1, k) terms."""
    from math import comb

    if e.is_Add:
        return sum(min(_terms_bound(a), 10**9) for a in e.args)
    if e.is_Mul:
        out = 1
        for a in e.args:
            out = min(out * _terms_bound(a), 10**9)
        return out
    if e.is_Pow:
        n, k = _terms_bound(e.base), e.exp
        if k.is_Integer and int(k) > 0:
            return min(comb(n + int(k) - 1, int(k)), 10**9) if n < 10**6 else 10**9
        return n
    return 1


# per process: symbolic comparisons asked of the worker, answers refused before any symbolic work
# (outside the whitelist, over a cap, or symbols that differ from the expected answer's), and
# comparisons without a verdict within the bound
MATH_STATS = {"symbolic": 0, "refused": 0, "overrun": 0}


def answers_equal(got: str, want: str, symbolic: bool = True) -> bool:
    """Exact equality of two final answers: as fractions (``0.5`` == ``1/2`` == ``\\frac{1}{2}``),
    else symbolically with sympy (``2x+1`` == ``1+2*x``) in a bounded worker process (a deadline,
    CPU and memory limits enforced from outside it: :mod:`ptops.recipes.trl.bounded`; no verdict
    within the bound is False), else as normalised text. Refused before any symbolic work: answers
    outside the whitelist, and answers whose symbols differ from the expected one's (a numeric
    expected answer refuses every answer with a free symbol). ``symbolic=False``: fractions and
    text only."""
    a, b = normalise_answer(got), normalise_answer(want)
    if a == b and a:
        return True
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return False
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    if not symbolic:
        return False
    if not (_safe_syntax(a) and _safe_syntax(b)) or _symbols(a) != _symbols(b):
        MATH_STATS["refused"] += 1
        return False
    from ptops.recipes.trl.bounded import comparer

    MATH_STATS["symbolic"] += 1
    verdict = comparer().equal(a, b)
    if verdict is None:
        MATH_STATS["overrun"] += 1
    return bool(verdict)


def math_verifier(completions, answer, prompts=None, log_metric=None, **_: object) -> list[float]:
    """1.0 when the completion's final answer (:func:`extract_answer`) equals the row's ``answer``,
    else 0.0. An answer whose comparison overran its bound scores 0 and is counted
    (``math/overrun`` per call, with ``math/refused``: symbolic answers refused cheaply)."""
    prompts = prompts if prompts is not None else [None] * len(completions)
    before = dict(MATH_STATS)
    out = []
    for completion, expected, prompt in zip(completions, answer, prompts):
        got, _how = extract_answer(completion, prompt)
        out.append(1.0 if got is not None and answers_equal(got, str(expected)) else 0.0)
    if callable(log_metric):
        log_metric("math/overrun", float(MATH_STATS["overrun"] - before["overrun"]))
        log_metric("math/refused", float(MATH_STATS["refused"] - before["refused"]))
    return out


math_verifier.__name__ = "math"


def math_dataset(n: int = 256, seed: int = 5) -> list[dict]:
    """GRPO rows ``{"prompt", "answer"}``: fraction and decimal arithmetic whose answers need the
    verifier's normalisation (``3/4`` vs ``0.75`` vs ``\\frac{3}{4}``)."""
    import random
    from fractions import Fraction

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, b = (
                Fraction(rng.randint(1, 9), rng.randint(2, 9)),
                Fraction(rng.randint(1, 9), rng.randint(2, 9)),
            )
            q, ans = f"What is {a} + {b}?", a + b
        elif kind == 1:
            a, b = rng.randint(1, 40) / 4, rng.randint(1, 40) / 4
            q, ans = f"What is {a} plus {b}?", Fraction(a) + Fraction(b)
        else:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            q, ans = f"What is {a * b} divided by {b}?", Fraction(a)
        rows.append(
            {
                "prompt": [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}],
                "answer": str(ans),
            }
        )
    return rows


# ---------------------------------------------------------------- code reward

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)

CODE_TASKS = (
    ("add(a, b)", "returns a plus b", "add", lambda a, b: a + b),
    ("sub(a, b)", "returns a minus b", "sub", lambda a, b: a - b),
    ("mul(a, b)", "returns a times b", "mul", lambda a, b: a * b),
    ("biggest(a, b)", "returns the larger of a and b", "biggest", max),
    ("smallest(a, b)", "returns the smaller of a and b", "smallest", min),
)


def extract_code(completion) -> str:
    """The completion's last fenced Python block, or the whole text when it has none."""
    text = _text(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _compiles(code: str) -> bool:
    import ast

    try:
        ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return bool(code.strip())


def code_format(completions, **_: object) -> list[float]:
    """Shaped: 1.0 when the completion's code parses as Python (parsed, never run)."""
    return [1.0 if _compiles(extract_code(c)) else 0.0 for c in completions]


class CodeReward:
    """Fraction of the row's ``tests`` (assert statements) that pass when the completion's code runs
    in :func:`ptops.recipes.trl.sandbox.run_code`: each assert is split, its call runs inside, its
    expected value stays here and the comparison is made here on strictly decoded plain data (the
    threat model: ``docs/rewards.md``). Every completion runs, even one that does not parse (it
    scores 0 there): one path for all, and the sandbox is exercised from the first step of a tiny
    run. ``workers`` sandboxes run at once (as root: each has a uid of its own; otherwise one at a
    time, since RLIMIT_NPROC would count the others). ``last`` keeps the latest results for
    logging."""

    __name__ = "code"

    def __init__(self, limits=None, workers: int | None = None) -> None:
        import os

        from ptops.recipes.trl.sandbox import Limits

        self.limits = limits or Limits()
        self.workers = workers or (min(8, os.cpu_count() or 1) if os.geteuid() == 0 else 1)
        self.last: list = []

    def __call__(self, completions, tests, log_metric=None, **_: object) -> list[float]:
        from ptops.recipes.trl.sandbox import run_code, split_tests

        jobs = [(extract_code(c), list(t)) for c, t in zip(completions, tests)]
        for _code, t in jobs:
            split_tests(t)  # an assert that cannot be split raises here, before anything runs
        if self.workers > 1 and len(jobs) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.workers, len(jobs))) as pool:
                self.last = list(pool.map(lambda j: run_code(j[0], j[1], self.limits), jobs))
        else:
            self.last = [run_code(code, t, self.limits) for code, t in jobs]
        if callable(
            log_metric
        ):  # per step: how many ran, and how many ended badly (sandbox_* records)
            log_metric("sandbox/runs", float(len(self.last)))
            log_metric(
                "sandbox/killed", float(sum(r.status in ("killed", "timeout") for r in self.last))
            )
            log_metric("sandbox/hostile", float(sum(r.status == "hostile" for r in self.last)))
            log_metric(
                "sandbox/failed", float(sum(r.status == "launcher_failed" for r in self.last))
            )
            # the kernel refused the isolation and the recipe did not opt in: nothing was graded
            log_metric("sandbox/refused", float(sum(r.status == "refused" for r in self.last)))
            # a result channel tampered with (extra or malformed records, or none after an exit 0):
            # no honest solution does that, so a policy learning to forge shows here before anywhere
            # else
            forged = sum(r.status in ("malformed", "no_result") for r in self.last)
            log_metric("sandbox/forged", float(forged))
        return [r.reward for r in self.last]


def _example_args(rng, n_shown: int, n_hidden: int) -> tuple[list, list]:
    """Distinct argument pairs: the first ``n_shown`` go in the prompt, the rest are the hidden
    tests."""
    seen: list = []
    while len(seen) < n_shown + n_hidden:
        a = (rng.randint(-9, 9), rng.randint(-9, 9))
        if a not in seen:
            seen.append(a)
    return seen[:n_shown], seen[n_shown:]


def code_dataset(n: int = 256, seed: int = 6) -> list[dict]:
    """GRPO rows ``{"prompt", "examples", "tests"}``: write a two-argument function. The prompt
    shows two ``examples`` (asserts, for reference); the reward runs the three hidden ``tests`` on
    other inputs, so a completion that special-cases the shown inputs scores low. Hidden tests that
    an answer solving nothing passes (``return a`` for ``biggest`` when ``a`` is the larger three
    times, ``return b`` for ``smallest`` when ``b`` is the smaller: 23 of the first 256 rows
    before issue 49) are drawn again."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sig, does, name, fn = CODE_TASKS[i % len(CODE_TASKS)]
        shown, hidden = _example_args(rng, 2, 3)
        tests = [f"assert {name}({a}, {b}) == {fn(a, b)}" for a, b in hidden]
        redraw = random.Random(seed * 1_000_003 + i)  # the other rows stay as they were
        while vacuous_test(tests):  # e.g. biggest(a, b) with a > b three times: `return a` passes
            shown, hidden = _example_args(redraw, 2, 3)
            tests = [f"assert {name}({a}, {b}) == {fn(a, b)}" for a, b in hidden]
        examples = [f"assert {name}({a}, {b}) == {fn(a, b)}" for a, b in shown]
        eg = "; ".join(f"{name}({a}, {b}) == {fn(a, b)}" for a, b in shown)
        rows.append(
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Write a Python function {sig} that {does}. For example: {eg}.",
                    }
                ],
                "examples": examples,
                "tests": tests,
            }
        )
    return check_code_rows(rows)


# answers a one-line completion returns without solving anything (issue 49 point 5): a row that one
# of them passes entirely, or that a function returning one of its own arguments passes, is vacuous
TRIVIAL_ANSWERS = ("", 0, None, [], {}, (), False, True, 1, -1, "0", " ")
_NO_ARG = object()


def _nth_literal_arg(probe: str, n: int):
    """The ``n``-th positional argument of the call ``probe`` when it is a literal, else
    _NO_ARG."""
    import ast

    try:
        node = ast.parse(probe, mode="eval").body
        if isinstance(node, ast.Call) and len(node.args) > n:
            return ast.literal_eval(node.args[n])
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        pass
    return _NO_ARG


def _wanted(c) -> str:
    """What a check expects, in words (``== 3``, ``truthy``, ``in 'abc'``)."""
    return {
        "eq": f"== {c.expected!r}",
        "is": f"is {c.expected!r}",
        "in": f"in {c.expected!r}",
        "truthy": "truthy",
        "falsy": "falsy",
    }.get(c.kind, f"close to {c.expected!r}")


def vacuous_test(tests: list[str]) -> str | None:
    """Why a row's ``tests`` (assert statements that split) pass for an answer that solves nothing,
    or None: a check whose probe is a literal (``assert True``, ``assert 1 == 1``: no completion
    involved), ``in`` a string (the empty string is in every string), one trivial answer
    (:data:`TRIVIAL_ANSWERS`: ``""``, ``0``, ``None``, ``[]``...) passing every test, or a function
    returning one of its arguments passing every test. Judged on decoded values with the grader's
    own comparison (:func:`ptops.recipes.trl.sandbox.holds`), nothing run."""
    import ast

    from ptops.recipes.trl.sandbox import holds, split_tests

    split = split_tests(tests)
    for t, clauses in zip(tests, split):
        for c in clauses:
            try:
                ast.literal_eval(c.probe)
                return f"test {t!r}: {c.probe} is a literal, not the completion's answer"
            except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
                pass
            if c.kind == "in" and isinstance(c.expected, str):
                return (
                    f"test {t!r}: `in` the string {c.expected!r} is passed by the empty string "
                    "(expected a comparison with ==)"
                )
    every = [c for clauses in split for c in clauses]
    wanted = [_wanted(c) for c in every]
    for v in TRIVIAL_ANSWERS:
        if all(holds(c, v) for c in every):
            return (
                f"tests {list(tests)!r}: an answer of {v!r} passes every one (expected: "
                f"{', '.join(wanted)})"
            )
    for n in range(3):
        args = [_nth_literal_arg(c.probe, n) for c in every]
        if all(a is not _NO_ARG for a in args) and all(holds(c, a) for c, a in zip(every, args)):
            return (
                f"tests {list(tests)!r}: a function returning its argument {n + 1} passes every "
                f"one (expected: {', '.join(wanted)})"
            )
    return None


def check_code_rows(rows: list[dict], source: str = "code data") -> list[dict]:
    """The rows, once every test assert splits into a call and an expected value (see
    :func:`ptops.recipes.trl.sandbox.split_assert`), no graded call is shown in the prompt or
    among the row's ``examples``, and no answer that solves nothing passes the row's tests
    (:func:`vacuous_test`); else ValueError with one line naming the source, the row and the
    assert."""
    from ptops.recipes.trl.sandbox import AssertRefused, split_assert

    def probes(asserts, i: int) -> set[str]:
        out = set()
        for t in asserts:
            try:
                out.update(c.probe for c in split_assert(t))
            except AssertRefused as e:
                raise ValueError(f"{source} row {i}: {e}") from None
        return out

    for i, row in enumerate(rows):
        if not row.get("tests"):
            raise ValueError(f"{source} row {i}: no tests")
        hidden = probes(row["tests"], i)
        why = vacuous_test([str(t) for t in row["tests"]])
        if why:
            raise ValueError(f"{source} row {i}: vacuous: {why}")
        shown = probes(row.get("examples") or [], i)
        prompt = re.sub(r"\s+", "", _prompt_text(row.get("prompt")))
        for p in sorted(hidden):
            if "(" in p and (p in shown or re.sub(r"\s+", "", p) in prompt):
                raise ValueError(
                    f"{source} row {i}: the graded call {p} is shown in the prompt "
                    "(tests must be hidden)"
                )
    return rows


def reward_dataset(section, n: int | None = None) -> list[dict]:
    """The GRPO rows the recipe's reward reads: arithmetic (correct, length, judge), math or
    code."""
    from ptops.recipes import assets

    n = n if n is not None else section.dataset_size
    if section.reward == "math":
        return math_dataset(n)
    if section.reward == "code":
        return code_dataset(n)
    return assets.prompt_dataset(n)


REWARD_FUNCS = [correct, format]
REWARD_WEIGHTS = [1.0, 0.2]


def reward_setup(
    reward: str = "correct", with_verifier: bool = False, section=None, probe=None
) -> tuple[list, list[float]]:
    """(reward functions, weights) for ``[trl] reward`` / ``[trl] verifier``.

    ``correct``: correctness + 0.2 x format (the default). ``length``: the gameable length
    reward, with the held-out ``verifier`` always logged at weight 0. ``with_verifier`` adds
    the weight-0 verifier to ``correct`` too (logged only; the training reward is unchanged).
    ``math``: the math verifier + 0.2 x format. ``judge``: the ``[trl.judge]`` judge's score (loaded
    here, before training: see judge.py). ``code``: the sandboxed test pass rate + 0.2 x
    code_format. Rank 0 of ``probe`` reports a ``reward_source`` event: which reward, and the
    judge's identity or the sandbox's isolation, so that a run scored by the wrong judge, or
    by a sandbox without its namespaces, is visible in the run directory.
    """
    source: dict = {"reward": reward}
    if reward == "length":
        funcs, weights = [length, verifier], [1.0, 0.0]
    elif reward == "correct":
        funcs, weights = list(REWARD_FUNCS), list(REWARD_WEIGHTS)
        if with_verifier:
            funcs.append(verifier)
            weights.append(0.0)
    elif reward == "math":
        from ptops.recipes.trl.bounded import DEADLINE_S, MEMORY_MB, comparer

        funcs, weights = [math_verifier, format], [1.0, 0.2]
        # the bounded worker starts here (sympy's import), not inside the first step's deadline
        helper = comparer().equal("x", "x") is True
        source["math_bound"] = {"deadline_s": DEADLINE_S, "memory_mb": MEMORY_MB, "helper": helper}
    elif reward == "judge":
        from ptops.recipes.trl.judge import JudgeReward, load_judge

        judge = load_judge(section.judge)
        reward_fn = JudgeReward(judge)
        funcs, weights = [reward_fn], [1.0]
        source.update(judge.identity())
        # the bounded helper loads the judge here, not inside the first step's deadline
        source["judge_bound"] = {
            "deadline_s": reward_fn.bound.deadline_s,
            "memory_mb": reward_fn.bound.memory_mb,
            "helper": reward_fn.bound.start(),
        }
    elif reward == "code":
        from ptops.recipes.trl.sandbox import Limits, isolation_available

        limits = Limits(**section.sandbox.model_dump()) if section is not None else Limits()
        funcs, weights = [CodeReward(limits), code_format], [1.0, 0.2]
        source["sandbox"] = isolation_available(limits)  # its start line: the recipe's opt-in
        source["sandbox_limits"] = section.sandbox.model_dump() if section is not None else {}
    else:
        raise ValueError(
            f"[trl].reward: unknown reward {reward!r} (expected correct, length, math, judge or "
            "code)"
        )
    if probe is not None and getattr(probe, "rank", 0) == 0:
        probe.event(
            "reward_source",
            **source,
            weights=weights,
            funcs=[getattr(f, "__name__", type(f).__name__) for f in funcs],
        )
    return funcs, weights
