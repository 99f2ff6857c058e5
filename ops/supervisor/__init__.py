"""The supervisor: runs a recipe's attempts under watch (see ``core``), one per run directory
(``lock``).

What the folder holds: the run loop (`core.py`), one attempt (`attempt.py`), channel messages as a
table (`messages.py`), hangs and stacks (`hangs.py`, `stacks.py`), stop (`stop.py`), pure blame
(`blame.py`), pure policy tables (`policy.py`), their effects (`actions.py`), the launcher (torchrun
command line), processes, the channel server, the warm pool's lifetime (`warmpool.py`), sidecar
processes of a run (`sidecar.py`: an engine's servers, e.g. `trl vllm-serve`, health-checked,
restarted, under a PDEATHSIG guard). May import (of ptops): runrecord, rank (protocol), monitors,
ckpt, faultinject (spec), recipes (schema, rollback contract).

The names below load on first use: the node agent, started on every attempt, imports ``procs`` and
``stacks`` (stdlib only) and must not pay for the supervisor's ~0.7 s of imports each restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptops.ops.runrecord.lock import LockedError
    from ptops.ops.supervisor.core import Supervisor
    from ptops.ops.supervisor.outcome import Outcome

__all__ = ["LockedError", "Outcome", "Supervisor"]

_WHERE = {
    "LockedError": "ptops.ops.runrecord.lock",
    "Supervisor": "ptops.ops.supervisor.core",
    "Outcome": "ptops.ops.supervisor.outcome",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
