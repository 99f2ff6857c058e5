"""How one attempt ended: the value every part of the supervisor passes back to the run loop.

A leaf module (imports nothing of ptops) so that the attempt, the hang handling and the
finding actions can all build one without importing the loop that consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    kind: str  # completed | crash | hang | early_exit | interrupted | stop | rollback
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
