"""The supervisor: runs a recipe's attempts under watch (see ``core``), one per run directory
(``lock``).

What the folder holds: the run loop (`core.py`), one attempt (`attempt.py`), channel messages as a
table (`messages.py`), hangs and stacks (`hangs.py`, `stacks.py`), stop (`stop.py`), pure blame
(`blame.py`), pure policy tables (`policy.py`), their effects (`actions.py`), the launcher (torchrun
command line), processes, the channel server, the warm pool's lifetime (`warmpool.py`), sidecar
processes of a run (`sidecar.py`: an engine's servers, e.g. `trl vllm-serve`, health-checked,
restarted, under a PDEATHSIG guard). May import (of ptops): runrecord, rank (protocol), monitors,
ckpt, faultinject (spec), recipes (schema, rollback contract).
"""

from ptops.ops.runrecord.lock import LockedError
from ptops.ops.supervisor.core import Supervisor
from ptops.ops.supervisor.outcome import Outcome

__all__ = ["LockedError", "Outcome", "Supervisor"]
