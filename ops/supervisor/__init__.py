"""The supervisor: runs a recipe's attempts under watch (see ``core``), one per run directory
(``lock``)."""

from ptops.ops.runrecord.lock import LockedError
from ptops.ops.supervisor.core import Supervisor
from ptops.ops.supervisor.outcome import Outcome

__all__ = ["LockedError", "Outcome", "Supervisor"]
