"""The pure metric monitors (``ptops.monitors``) as the supervisor runs them live.

Why a part of its own: a monitor config that cannot be built used to be swallowed
(the run went on with zero monitors, and nobody knew). Now it is a recipe error at
launch (one line naming the file and the key, exit 2), and a monitor that raises on a
record at run time is recorded once (``monitor_error``) while the others keep running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ptops.monitors import fast_entries
from ptops.monitors.base import step_and_rank
from ptops.monitors.config import MonitorsSection
from ptops.monitors.shared import SharedRankedMonitor
from ptops.recipes.schema import build_monitors_of


def build(section: MonitorsSection | None, origin: str) -> list:
    """Fresh monitors of a ``[monitors]`` section, or :class:`RecipeError` naming the monitor that
    fails (the schema's own check: a recipe that loaded builds here too)."""
    return build_monitors_of(section or MonitorsSection(), origin)


@dataclass
class MonitorFeed:
    """Feeds each metric record to every monitor; a monitor that raises is reported once, never
    dropped silently.

    Why the fast path: the record is parsed once for all monitors (its keys, step and rank, handed
    to each monitor's ``feed_at``; see ``ptops.monitors.fast_entries``) instead of once per monitor
    in ``feed``.
    """

    monitors: list
    errors: dict[str, int] = field(default_factory=dict)  # monitor name -> records it raised on

    def __post_init__(self) -> None:
        self._calls: list = []
        # the monitors ``_calls`` was built for (``monitors`` may be changed in place)
        self._of: list = []
        self._reps: list = []  # per call: the monitor's ``repeat`` where ``like`` goes, or None

    def feed(
        self, rec: dict[str, Any], like: tuple | None = None
    ) -> tuple[list, list[tuple[str, Exception]]]:
        """(findings, first errors): the findings of every monitor, and (name, exception) for each
        monitor that raised on this record for the first time in the run.

        ``like``: (rank, keys) when a node agent's batch certified this record equal to that
        rank's record of the step (fed just before) but for those keys (``unbatch``): the monitors
        that share state across ranks move the rank on without reading the record where those keys
        are none they read (``SharedRankedMonitor.repeat``); the rest are fed as usual."""
        findings: list = []
        first_errors: list[tuple[str, Exception]] = []
        step, rank = step_and_rank(rec)  # once for every monitor
        keys = rec.keys()
        if self._of != self.monitors:  # identity first, in C: ~0.1 µs
            self._of = list(self.monitors)
            self._calls = list(zip(self._of, fast_entries(self._of)))
            self._reps = [m.repeat if _repeats(m, f) else None for m, f in self._calls]
        calls = self._calls
        if step is None:  # no step: each monitor's plain feed (the monitors here ignore it)
            calls = [(m, _plain(m)) for m, _ in calls]
            like = None
        reps = self._reps if like is not None else repeat(None)  # (zip stops at the calls)
        for (m, f), rep in zip(calls, reps):
            try:
                if rep is not None:
                    found = rep(rec, keys, step, rank, like[0], like[1])
                else:
                    found = f(rec, keys, step, rank)
                if found:
                    findings.extend(found)
            except Exception as e:  # noqa: BLE001 - one monitor's bug must not blind the others
                name = getattr(m, "name", type(m).__name__)
                self.errors[name] = self.errors.get(name, 0) + 1
                if self.errors[name] == 1:
                    first_errors.append((name, e))
        return findings, first_errors


def _repeats(m: Any, entry: Any) -> bool:
    """Whether ``m`` can move a certified repeat on (``feed`` not redefined past ``feed_at``)."""
    return (
        isinstance(m, SharedRankedMonitor)
        and m.share
        and getattr(entry, "__self__", None) is m
        and getattr(entry, "__name__", "") == "feed_at"
    )


def _plain(m: Any) -> Any:
    return lambda rec, keys, step, rank: m.feed(rec)
