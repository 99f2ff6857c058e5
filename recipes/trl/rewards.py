"""Programmatic, verifiable GRPO rewards for the arithmetic prompt data set.

``correct`` is the verifiable reward: 1.0 when the last number in the completion
equals the row's ``answer`` column, else 0.0. ``format`` gives a small shaped
reward for answering with a number at all, so that a freshly initialised tiny
model still sees non-zero reward variance (and GRPO a non-zero advantage).
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


REWARD_FUNCS = [correct, format]
REWARD_WEIGHTS = [1.0, 0.2]
