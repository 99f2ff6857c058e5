"""The supervisor: runs a recipe's attempts under watch (see ``core``), one per run directory (``lock``)."""

from ptops.ops.supervisor.core import Outcome, Supervisor
from ptops.ops.supervisor.lock import LockedError

__all__ = ["LockedError", "Outcome", "Supervisor"]
