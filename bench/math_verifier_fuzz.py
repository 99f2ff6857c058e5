"""Fuzz the GRPO math verifier with adversarial answers (issue 23): never a wrong pass, never a
hang.

Each case is (completion, expected answer, prompt, may_pass): hedges (many different boxed values,
the right one among them), answer spam, enormous numbers and expressions, unicode digits, LaTeX
tricks, text echoed from the prompt, near misses; plus honest answers in several spellings
(``may_pass``), so that a verifier that refuses everything is caught too. Every call is timed on its
own.

    .venv/bin/python bench/math_verifier_fuzz.py [--n 3000] [--seed 0] [--json OUT]

prints one line: cases, wrong passes, honest passes / honest cases, per-call CPU p50 / p99 / max
(ms). ``tests/trl/test_trl_rewards.py::test_math_verifier_fuzz`` runs a smaller draw of the same
cases.
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
    ]
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
    from ptops.recipes.trl.rewards import math_verifier

    math_verifier(["\\boxed{x+1}"], ["1+x"])  # imports sympy once, outside the timings
    wrong, honest_ok, honest_n, times, worst = [], 0, 0, [], ("", 0.0)
    for kind, text, want, prompt, may_pass in cases(n, seed):
        t0 = time.process_time()
        got = math_verifier([text], [want], prompts=[prompt])[0]
        dt = time.process_time() - t0
        times.append(dt)
        if dt > worst[1]:
            worst = (kind, dt)
        if kind == "honest":
            honest_n += 1
            honest_ok += got == 1.0
        elif got != 0.0 and not may_pass:
            wrong.append((kind, text[:120], want))
    times.sort()
    ms = lambda q: round(1000 * times[min(len(times) - 1, int(q * len(times)))], 3)  # noqa: E731
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
        "slowest_kind": worst[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = run(args.n, args.seed)
    print(
        f"math verifier fuzz: {res['cases']} cases (seed {res['seed']}), "
        f"wrong passes {res['wrong_passes']}, "
        f"honest {res['honest_passed']}/{res['honest_cases']}, CPU per call p50 "
        f"{res['cpu_ms_p50']} ms, "
        f"p99 {res['cpu_ms_p99']} ms, max {res['cpu_ms_max']} ms ({res['slowest_kind']})"
    )
    if res["wrong_examples"]:
        print(json.dumps(res["wrong_examples"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
