"""What a run really reached when no checkpoint of ptops says so: a script's own saves.

An unchanged script keeps its state in files of its own (``snapshot.pt``); its rank reports each
save (``script_save``) and a later attempt's load of one (``script_resume``; both sent by
recipes/script/watch.py). The restart policy judges progress by the newest of these as by a good
checkpoint, and a restart tells the user what the script will find, not "from scratch".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ptops.ops.runrecord.events import EventKind


@dataclass
class Reached:
    saved_step: int = 0  # the newest step a script saved a file of its own at
    saved_path: str = ""
    resumed_step: int = 0  # the step this attempt's script loaded its state from (0: none)

    def note(self, kind: str, fields: dict[str, Any]) -> None:
        """A rank's ``script_save`` or ``script_resume`` (other kinds: nothing)."""
        try:
            step = int(fields.get("step", 0))
        except (TypeError, ValueError):
            return
        if kind == EventKind.SCRIPT_SAVE and step > self.saved_step:
            self.saved_step, self.saved_path = step, str(fields.get("path", ""))
        elif kind == EventKind.SCRIPT_RESUME and step > self.resumed_step:
            self.resumed_step = step

    def new_attempt(self) -> None:
        self.resumed_step = 0

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> "Reached":
        """An adopted run's saves so far."""
        r = cls()
        for e in events:
            r.note(str(e.get("kind")), e)
        r.new_attempt()
        return r

    def restart_phrase(self, good_step: int) -> str:
        """Where the next attempt starts, as far as ptops can know."""
        if good_step:
            return f"from checkpoint step {good_step}"
        if self.saved_step:
            where = f" ({self.saved_path})" if self.saved_path else ""
            return f"from the script's own save of step {self.saved_step} if it loads it{where}"
        return "from scratch"
