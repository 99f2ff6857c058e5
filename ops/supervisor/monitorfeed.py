"""The pure metric monitors (``ptops.monitors``) as the supervisor runs them live.

Why a part of its own: a monitor config that cannot be built used to be swallowed
(the run went on with zero monitors, and nobody knew). Now it is a recipe error at
launch (one line naming the file and the key, exit 2), and a monitor that raises on a
record at run time is recorded once (``monitor_error``) while the others keep running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptops.monitors.config import MonitorsSection
from ptops.recipes.schema import build_monitors_of


def build(section: MonitorsSection | None, origin: str) -> list:
    """Fresh monitors of a ``[monitors]`` section, or :class:`RecipeError` naming the monitor that fails
    (the schema's own check: a recipe that loaded builds here too)."""
    return build_monitors_of(section or MonitorsSection(), origin)


@dataclass
class MonitorFeed:
    """Feeds each metric record to every monitor; a monitor that raises is reported once, never dropped silently."""

    monitors: list
    errors: dict[str, int] = field(default_factory=dict)  # monitor name -> records it raised on

    def feed(self, rec: dict[str, Any]) -> tuple[list, list[tuple[str, Exception]]]:
        """(findings, first errors): the findings of every monitor, and (name, exception) for each
        monitor that raised on this record for the first time in the run."""
        findings: list = []
        first_errors: list[tuple[str, Exception]] = []
        for m in self.monitors:
            try:
                findings.extend(m.feed(rec) or ())
            except Exception as e:  # noqa: BLE001 - one monitor's bug must not blind the others
                name = getattr(m, "name", type(m).__name__)
                self.errors[name] = self.errors.get(name, 0) + 1
                if self.errors[name] == 1:
                    first_errors.append((name, e))
        return findings, first_errors
