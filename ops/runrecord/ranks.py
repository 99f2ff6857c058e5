"""Ranks as a person reads them: ranges and a count, never thousands of numbers (an all-rank hang at
8,192 ranks printed 8,192 numbers). The one formatter: the hang line, events' ``ranks_text``,
``ptops status``, ``ptops diagnose`` and its incidents all use it."""

from __future__ import annotations

from typing import Any, Iterable


def rank_list(ranks: Iterable[int], show: int = 16, *, bare: bool = False) -> str:
    """``[3]``, ``[0-7, 9]``; a long list as its first ``show`` ranges and a count:
    ``[0-7, 9, 12-4095] (4090 ranks)``. ``bare``: no brackets, commas alone (``0-7,9,12-4095``),
    for titles that said ``rank(s) 1,2``."""
    given = list(ranks)
    if not all(type(r) is int for r in given):  # not rank numbers (a tool's strings): as given
        return ("," if bare else ", ").join(map(str, given))
    uniq = sorted(set(given))
    spans: list[list[int]] = []
    for r in uniq:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans]
    sep = "," if bare else ", "
    more = f"{sep}... ({len(spans) - show} more ranges)" if len(spans) > show else ""
    count = f" ({len(uniq)} ranks)" if len(uniq) > show else ""
    body = sep.join(text[:show]) + more
    return (body if bare else "[" + body + "]") + count


# event fields that list ranks without "rank" in their name (the hang event's)
RANK_LIST_KEYS = frozenset({"stalled", "blamed", "also_quiet"})


def compact(key: str, value: Any, show: int = 16) -> Any:
    """An event field for a printed line: a long list of ints under a key that names ranks
    (``ranks``, ``stalled``, ...) as its ranges; a long map keyed by rank (the hang event's
    ``stack_sources``) as its values with their ranks' ranges; anything else as it is."""
    if (
        ("rank" in key or key in RANK_LIST_KEYS)
        and isinstance(value, list)
        and len(value) > show
        and all(type(x) is int for x in value)
    ):
        return rank_list(value, show, bare=True)
    if (
        isinstance(value, dict)
        and len(value) > show
        and all(isinstance(k, str) and k.isdecimal() for k in value)
    ):
        by: dict[str, list[int]] = {}
        for k, v in value.items():
            by.setdefault(str(v), []).append(int(k))
        return "; ".join(f"{v}: {rank_list(r, show, bare=True)}" for v, r in by.items())
    return value
