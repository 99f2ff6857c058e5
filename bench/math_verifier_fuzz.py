"""Fuzz the GRPO math verifier with adversarial answers (issues 23, 49): never a wrong pass, never
a hang.

Each case is (completion, expected answer, prompt, may_pass): hedges (many different boxed values,
the right one among them), answer spam, enormous numbers and expressions, unicode digits, LaTeX
tricks, text echoed from the prompt, near misses; plus honest answers in several spellings
(``may_pass``), so that a verifier that refuses everything is caught too. Every call is timed on its
own.

    .venv/bin/python bench/math_verifier_fuzz.py [--n 3000] [--seed 0] [--json OUT] [--kill 50]

prints one line: cases, wrong passes, honest passes / honest cases, per-call CPU (this process) and
wall time (the symbolic worker's included) p50 / p99 / max (ms), overruns; then the kill path's
cost (``--kill``: comparisons killed at a 10 ms deadline, and the call after each).
``tests/trl/test_trl_rewards.py::test_math_verifier_fuzz`` runs a smaller draw of the same cases.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from fractions import Fraction

DIGITS = {"arabic-indic": 0x0660, "devanagari": 0x0966, "fullwidth": 0xFF10, "bengali": 0x09E6}
SUPERSCRIPT = str.maketrans(
    "0123456789", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
)


def _spell(f: Fraction, rng: random.Random) -> str:
    """An honest spelling of ``f``."""
    if f.denominator == 1:
        return rng.choice([str(f.numerator), f"{f.numerator}.0", f"{f.numerator:,}"])
    return rng.choice(
        [
            f"{f.numerator}/{f.denominator}",
            f"\\frac{{{f.numerator}}}{{{f.denominator}}}",
            f"\\dfrac{{{f.numerator}}}{{{f.denominator}}}",
        ]
    )


def _wrong(f: Fraction, rng: random.Random) -> Fraction:
    d = Fraction(rng.choice([1, 2, 3, 7, 10]), rng.choice([1, 1, 2, 1000, 10**9]))
    return f + d if rng.random() < 0.5 else f - d


def _unicode(s: str, base: int) -> str:
    return "".join(chr(base + int(c)) if c.isdigit() else c for c in s)


def cases(n: int, seed: int = 0):
    """``n`` adversarial cases and honest ones: (kind, completion, expected, prompt, may_pass)."""
    rng = random.Random(seed)
    kinds = [
        "hedge",
        "hedge_many",
        "spam_then_wrong",
        "right_not_final",
        "huge_number",
        "exponent_bomb",
        "expression_bomb",
        "unicode_digits",
        "superscript",
        "latex_hidden",
        "unbalanced",
        "prompt_echo",
        "near_miss",
        "long_padding",
        "nested_boxes",
        "honest",
        # issue 49: answers whose symbolic comparison would cost seconds and memory
        "many_symbols",
        "nested_powers",
        "products_of_sums",
        "huge_factorial",
        "deep_nesting",
        "radical_bomb",
        "honest_symbolic",
    ]
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        right = Fraction(a, rng.choice([1, 1, 2, 3, 4, 8]))
        want = str(right)
        prompt = [
            {
                "role": "user",
                "content": f"What is {right * b} divided by {b}? Put it in \\boxed{{}}.",
            }
        ]
        wrong = _wrong(right, rng)
        r, w = _spell(right, rng), _spell(wrong, rng)
        may_pass = False
        if kind == "hedge":
            boxes = [r, w] if rng.random() < 0.5 else [w, r]
            text = " or ".join(f"\\boxed{{{x}}}" for x in boxes)
        elif kind == "hedge_many":
            vals = [
                _spell(Fraction(k, right.denominator), rng) for k in range(rng.randint(3, 400))
            ] + [r]
            rng.shuffle(vals)
            text = " ".join(f"\\boxed{{{x}}}" for x in vals)
        elif kind == "spam_then_wrong":
            text = f"The answer is {r}. " * rng.randint(1, 2000) + f"The answer is {w}."
        elif kind == "right_not_final":
            text = f"I first thought {r}, but the final answer is \\boxed{{{w}}}"
        elif kind == "huge_number":
            text = (
                f"\\boxed{{{r}{'0' * rng.randint(5000, 30000)}}}"
                if rng.random() < 0.5
                else f"\\boxed{{{a}{'9' * rng.randint(20, 4000)}/{'9' * rng.randint(20, 4000)}}}"
            )
        elif kind == "exponent_bomb":
            text = rng.choice(
                [
                    f"\\boxed{{1e{10 ** rng.randint(6, 12)}}}",
                    f"\\boxed{{{a}^{{{a}^{{{b}}}}}}}",
                    "\\boxed{9^9^9^9}",
                    f"\\boxed{{{a}**{b}**{b}}}",
                    "\\boxed{10^{10^{10}}}",
                ]
            )
        elif kind == "expression_bomb":
            text = rng.choice(
                [
                    "\\boxed{" + "+".join(["1"] * rng.randint(1000, 50000)) + "}",
                    "\\boxed{" + "\\frac{1}{" * 3000 + "1" + "}" * 3000 + "}",
                    "\\boxed{" + "sqrt(" * 20 + "2" + ")" * 20 + "}",
                    f"\\boxed{{(x+1)^{rng.randint(5, 9)} - (x-1)^{rng.randint(5, 9)}}}",
                    "\\boxed{" + "(" * 5000 + str(a) + ")" * 5000 + "}",
                ]
            )
        elif kind == "unicode_digits":
            base = DIGITS[rng.choice(sorted(DIGITS))]
            text = f"\\boxed{{{_unicode(str(right), base)}}}"
        elif kind == "superscript":  # 2^7 written 2⁷: NFKC would read it as 27
            text = f"\\boxed{{{str(a)[0]}{str(b).translate(SUPERSCRIPT)}}}"
            want = f"{str(a)[0]}{b}"
        elif kind == "latex_hidden":
            text = rng.choice(
                [
                    f"\\phantom{{\\boxed{{{r}}}}}\\boxed{{{w}}}",
                    f"\\text{{\\boxed{{{r}}}}} \\boxed{{{w}}}",
                    f"% \\boxed{{{r}}}\n\\boxed{{{w}}}",
                    f"\\boxed{{{w}}}\\iffalse\\boxed{{{r}}}\\fi",
                ]
            )
        elif kind == "unbalanced":  # boxes left open around (or after) the right answer
            text = rng.choice(
                [
                    "\\boxed{" * rng.randint(1, 20000) + f"\\boxed{{{r}}}",
                    f"\\boxed{{{w} \\boxed{{{r}}}",
                    f"\\boxed{{{r}}} \\boxed{{{w}",
                ]
            )
        elif kind == "prompt_echo":
            text = prompt[0]["content"] + rng.choice(["", " ", " Hmm.", f" {a}"])
            may_pass = text.endswith(f" {a}") and right == a
        elif kind == "near_miss":
            text = f"\\boxed{{{float(right) + rng.choice([1e-9, -1e-6, 1e-3]):.12f}}}"
        elif kind == "long_padding":
            text = f"\\boxed{{{w}}}" + " " * rng.randint(32_000, 80_000) + f"\\boxed{{{r}}}"
        elif kind == "nested_boxes":
            text = f"\\boxed{{\\boxed{{{w}}} {r}}}"
        elif kind == "many_symbols":  # (a+b+...)^k: C(n+k-1, k) terms once expanded
            syms = letters[: rng.randint(3, 12)]
            text = f"\\boxed{{({'+'.join(syms)})^{rng.randint(5, 9)}}}"
            if rng.random() < 0.5:  # an expected answer with the same symbols reaches the worker
                want = "+".join(syms)
        elif kind == "nested_powers":
            text = (
                "\\boxed{"
                + rng.choice(
                    [
                        "((x+1)^9)^9",
                        "(x^9)^9",
                        "x^9^9",
                        "2^2^2^2^2",
                        "((a+b)^9)^9",
                        "(x+1)**9**9",
                        "(x+1)^(9)^(9)",
                        "((x+y)^9)^(x+1)",
                    ]
                )
                + "}"
            )
            want = rng.choice([want, "x+1", "x"])
        elif kind == "products_of_sums":
            pick = rng.randint(0, 3)
            if pick == 0:
                text = "\\boxed{" + "(a+b+c+d)" * rng.randint(4, 7) + "}"
                want = "a+b+c+d"
            elif pick == 1:
                text, want = "\\boxed{(x*y+z)^9*(x+y)^9}", "x*y*z"
            elif pick == 2:
                text, want = "\\boxed{(a+b)^9(c+d)^9(a+c)^9}", "a*b*c*d"
            else:
                text, want = "\\boxed{(x+y+z)^9*(x+y)^9*(y+z)^9}", "x+y+z"
        elif kind == "huge_factorial":
            text = (
                "\\boxed{"
                + rng.choice(
                    [
                        "factorial(10**6)",
                        "1000000!",
                        "(10^6)!",
                        "\\Gamma(10^6)",
                        "10^6!",
                        "x!",
                        "gamma(99999)",
                        "binomial(10**6, 5*10**5)",
                    ]
                )
                + "}"
            )
        elif kind == "deep_nesting":
            k = rng.choice([2, 5, 7, 12, 60, 400, 5000])
            text = rng.choice(
                [
                    "\\boxed{" + "(" * k + "x+1" + ")" * k + "}",
                    "\\boxed{" + "sqrt(" * k + "2" + ")" * k + "}",
                    "\\boxed{" + "-(" * k + "x" + ")" * k + "}",
                ]
            )
            want = rng.choice([want, "x+2", "2"])
        elif kind == "radical_bomb":
            roots = [f"sqrt({p})" for p in (2, 3, 5, 7, 11, 13, 17)[: rng.randint(3, 7)]]
            text = f"\\boxed{{({'+'.join(roots)})^{rng.randint(6, 9)}}}"
        elif kind == "honest_symbolic":
            text, want = rng.choice(
                [
                    ("\\boxed{1+2x}", "2*x+1"),
                    ("\\boxed{(x+1)^2}", "x^2+2*x+1"),
                    ("\\boxed{\\frac{x}{2}}", "x/2"),
                    ("\\boxed{\\sqrt{2}/2}", "1/sqrt(2)"),
                    ("\\boxed{(a+b)(a-b)}", "a^2-b^2"),
                    ("\\boxed{2 \\cdot \\pi}", "2pi"),
                    ("\\boxed{(x+y)^3}", "x^3+3*x^2*y+3*x*y^2+y^3"),
                ]
            )
            may_pass = True
        else:
            text = rng.choice(
                [f"So the answer is \\boxed{{{r}}}.", f"Final answer: {r}", f"$\\boxed{{ {r} }}$"]
            )
            if "," in r and not text.startswith("So"):
                text = f"\\boxed{{{r}}}"
            may_pass = True
        out.append((kind, text, want, prompt, may_pass))
    return out


def run(n: int, seed: int = 0) -> dict:
    from ptops.recipes.trl.rewards import MATH_STATS, math_verifier

    # starts the bounded worker (sympy imported once), outside the timings
    math_verifier(["\\boxed{x+1}"], ["1+x"])
    overrun0 = MATH_STATS["overrun"]
    wrong, honest_ok, honest_n, times, walls, worst = [], 0, 0, [], [], ("", 0.0)
    for kind, text, want, prompt, may_pass in cases(n, seed):
        t0, w0 = time.process_time(), time.monotonic()
        got = math_verifier([text], [want], prompts=[prompt])[0]
        dt, wall = time.process_time() - t0, time.monotonic() - w0
        times.append(dt)
        walls.append(wall)
        if wall > worst[1]:
            worst = (kind, wall)
        if kind.startswith("honest"):
            honest_n += 1
            honest_ok += got == 1.0
        elif got != 0.0 and not may_pass:
            wrong.append((kind, text[:120], want))
    times.sort()
    walls.sort()
    ms = lambda q: round(1000 * times[min(len(times) - 1, int(q * len(times)))], 3)  # noqa: E731
    wms = lambda q: round(1000 * walls[min(len(walls) - 1, int(q * len(walls)))], 3)  # noqa: E731
    return {
        "cases": n,
        "seed": seed,
        "wrong_passes": len(wrong),
        "wrong_examples": wrong[:5],
        "honest_passed": honest_ok,
        "honest_cases": honest_n,
        "cpu_ms_p50": ms(0.5),
        "cpu_ms_p99": ms(0.99),
        "cpu_ms_max": round(1000 * times[-1], 3),
        "wall_ms_p50": wms(0.5),
        "wall_ms_p99": wms(0.99),
        "wall_ms_max": round(1000 * walls[-1], 3),
        "overruns": MATH_STATS["overrun"] - overrun0,
        "slowest_kind": worst[0],
    }


def kill_path(n: int = 50) -> dict:
    """The bound's own cost: ``n`` comparisons that overrun a 10 ms deadline (denesting
    ``sqrt(5+2sqrt(6))``, ~50 ms) sent straight to the worker, each followed by an honest one
    (answered by the replacement worker). Wall ms per call: the overrun's answer, the next call."""
    from ptops.recipes.trl.bounded import BoundedComparer

    cmp = BoundedComparer()
    try:
        t0 = time.monotonic()
        assert cmp.equal("x", "x") is True
        start = time.monotonic() - t0
        over, nxt, verdicts = [], [], 0
        for _ in range(n):
            t0 = time.monotonic()
            verdicts += (
                cmp.equal("sqrt(2)+sqrt(3)", "sqrt(5+2sqrt(6))", deadline_s=0.01) is not None
            )
            over.append(time.monotonic() - t0)
            t0 = time.monotonic()
            verdicts += cmp.equal("1+2x", "2x+1") is not True
            nxt.append(time.monotonic() - t0)
    finally:
        cmp.close()
    over.sort()
    nxt.sort()
    q = lambda xs, p: round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 2)  # noqa: E731
    return {
        "helper_start_ms": round(1000 * start, 1),
        "overrun_ms_p50": q(over, 0.5),
        "overrun_ms_max": round(1000 * over[-1], 2),
        "next_call_ms_p50": q(nxt, 0.5),
        "next_call_ms_max": round(1000 * nxt[-1], 2),
        "unexpected": verdicts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--kill", type=int, default=50, help="overruns timed (the kill path)")
    args = ap.parse_args()
    res = run(args.n, args.seed)
    if args.kill:
        res["kill_path"] = kill_path(args.kill)
        print(f"kill path ({args.kill} overruns at a 10 ms deadline): {res['kill_path']}")
    print(
        f"math verifier fuzz: {res['cases']} cases (seed {res['seed']}), "
        f"wrong passes {res['wrong_passes']}, "
        f"honest {res['honest_passed']}/{res['honest_cases']}, CPU per call p50 "
        f"{res['cpu_ms_p50']} ms, "
        f"p99 {res['cpu_ms_p99']} ms, max {res['cpu_ms_max']} ms; wall per call p50 "
        f"{res['wall_ms_p50']} ms, p99 {res['wall_ms_p99']} ms, max {res['wall_ms_max']} ms "
        f"({res['slowest_kind']}); overruns (killed at the deadline, scored 0) {res['overruns']}"
    )
    if res["wrong_examples"]:
        print(json.dumps(res["wrong_examples"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
