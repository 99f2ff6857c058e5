"""What the RL monitors share: episodes (open, escalate, resolved), the base class that reports an
episode's transition once across ranks, and the two spellings of TRL's keys."""

from __future__ import annotations

from collections import deque
from typing import Any, Mapping

from ..base import Finding, RankedMonitor
from ..shared import SharedRankedMonitor


def _spellings(*keys: str | None) -> tuple[str, ...]:
    """Both spellings of each key (TRL's ``a/b`` and the adapter's ``a_b``), for a cheap presence
    test."""
    out: list[str] = []
    for k in keys:
        if k:
            out += [k, k.replace("/", "_")]
    return tuple(dict.fromkeys(out))


class _Episode:
    """One episode at a time: open -> (escalate) -> resolved after ``clear`` quiet steps."""

    __slots__ = ("n", "level", "quiet")

    def __init__(self) -> None:
        self.n = 0  # episodes opened so far (the next one's number is n + 1)
        self.level = 0  # 0 none open, 1 warning, 2 critical
        self.quiet = 0

    def update(self, level: int, quiet: bool, clear: int) -> str | None:
        """The phase this step starts (``open`` / ``escalate`` / ``resolved``), or None."""
        if level > self.level:
            phase = "open" if self.level == 0 else "escalate"
            if self.level == 0:
                self.n += 1
            self.level = level
            self.quiet = 0
            return phase
        if self.level and quiet:
            self.quiet += 1
            if self.quiet >= clear:
                self.level = 0
                self.quiet = 0
                return "resolved"
        else:
            self.quiet = 0
        return None

    def forget(self) -> None:
        """The run rewound: the redone timeline starts with no episode open (numbering goes on)."""
        self.level = 0
        self.quiet = 0


class _St:
    """Per-rank state: an episode plus whatever the monitor keeps (set in its ``_new_state``)."""

    def __init__(self) -> None:
        self.ep = _Episode()


_SEVERITY = {1: "warning", 2: "critical"}


class _RL(RankedMonitor):
    """Base of the RL monitors: per-rank state, episodes, and which records may rewind the state."""

    keys: tuple[str, ...] = ()  # a record carrying none of these is not this monitor's
    _own: tuple[str, ...] = ()

    # ``_gate`` and ``_rewind_keys``: ``_own`` (set in each monitor's __init__). A record with none
    # of the monitor's keys (pre-training, SFT, an eval) changes nothing: no rewind (``_rewinds``
    # needs one of them), no value to read; one C-level test instead of a feed.

    def _new_state(self) -> _St:
        return _St()

    def _rewind(self, st: _St, step: int) -> None:
        st.ep.forget()

    # each RL monitor's ``_rewinds``: only a record with its own training key rewinds (an eval
    # record logged before, after or between training steps never does)

    def _report(
        self,
        out: list[Finding],
        st: _St,
        record: Mapping[str, Any],
        step: int,
        rank: int,
        phase: str,
        level: int,
        value: float | None,
        detail: str,
        cleared: str,
    ) -> None:
        """Report the step's episode transition (``st.ep.update`` said which), once across ranks.
        The monitors build their texts only when there is a transition: no string work on a quiet
        step."""
        if self._silent:
            return
        key = (step, f"{phase}#{st.ep.n}")
        tried = self._tried
        if tried is None and key in self._fired:
            return
        if phase == "resolved":
            severity, text = "info", f"all clear (episode {st.ep.n}): {cleared}"
        else:
            severity = _SEVERITY[level]
            text = detail if phase == "open" else f"escalated (episode {st.ep.n}): {detail}"
        if tried is not None:  # a shared state's transition: the ranks that follow it replay this
            tried.append((key, step, value, text, severity, st.ep.n, phase))
            if key in self._fired:
                return
        self._fire(out, key, record, step, rank, value, text, severity, st.ep.n, phase)


class _SharedRL(_RL, SharedRankedMonitor):
    """An RL monitor whose ranks share one state while their inputs agree (TRL logs gathered
    values)."""


class _BoundRL(_SharedRL):
    """One key's value past a bound (``stale_rollout``, ``train_inference_gap``): an episode opens
    when it passes ``bound``, all clear after ``cfg.clear_steps`` steps within it. A subclass
    names the bound and the two texts."""

    cfg: Any

    def _bound(self) -> float:
        raise NotImplementedError

    def _texts(self, key: str, value: float) -> tuple[str, str]:
        """(the finding's detail, the all-clear's)."""
        raise NotImplementedError

    def _apply(
        self, st: _St, inputs: tuple, record: Mapping[str, Any], step: int, rank: int
    ) -> list[Finding]:
        key, value = inputs
        if value is None:
            return []
        over = value > self._bound()
        if not over and not st.ep.level:
            # within the bound, no episode open: update() would change nothing (quiet is 0 then)
            return []
        out: list[Finding] = []
        phase = st.ep.update(1 if over else 0, not over, self.cfg.clear_steps)
        if phase is not None:
            detail, cleared = self._texts(key, value)
            self._report(
                out, st, record, step, rank, phase, 1 if over else 0, value, detail, cleared
            )
        return out


_NO_VALUE = (None,)


def _median_small(q: deque) -> float:
    """Median of a few (step, value) pairs (the smoothing window: a handful of values)."""
    vals = sorted([p[1] for p in q])
    n = len(vals)
    mid = n // 2
    return vals[mid] if n % 2 else 0.5 * (vals[mid - 1] + vals[mid])
