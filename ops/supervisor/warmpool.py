"""The warm pool of a supervised run (``[supervisor.restart] warm_spare``): started once, kept across attempts.

Why: a restart's ranks otherwise import torch and the engine again (most of the time from a crash to the
next productive step). The pool (``ops/rank/warm.py``) imports them once, in the background, after the
first attempt is training (not before: on a small box it would slow the first start-up); the ranks of
every later attempt are forked from it, without a new torchrun (``launch_command``). It carries the run's ``PTOPS_RUN_DIR`` (so its children are found
by the supervisor's sweeps) but is kept out of the sweeps between attempts (``procs.KEEP``); it dies with
the supervisor (``PR_SET_PDEATHSIG``) and is stopped at the supervisor's end.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

from ptops.ops.rank.warm import ENV_SOCKET
from ptops.ops.supervisor import launcher, procs


class WarmPool:
    def __init__(self, recipe, run) -> None:
        self.recipe, self.run = recipe, run
        self.name = f"ptops-warm-{secrets.token_hex(8)}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """What a rank needs to find the pool (it starts cold while the pool is not listening yet)."""
        return {ENV_SOCKET: self.name}

    @property
    def started(self) -> bool:
        return self.proc is not None

    def launch_command(self, cmd: launcher.RankCommand, nproc: int) -> launcher.RankCommand:
        """An attempt's ranks forked straight from the pool (``ops/rank/warmlaunch.py``) instead of a new
        torchrun; the torchrun command stays its fallback when the pool does not answer."""
        port = cmd.argv[cmd.argv.index("--master-port") + 1]
        argv = [sys.executable, "-m", "ptops.ops.rank.warmlaunch", "--nproc", str(nproc), "--port", port, "--", *cmd.argv]
        return launcher.RankCommand(argv, cmd.env)

    def start(self) -> None:
        env = launcher.rank_command(self.recipe, self.run, 0).env
        log = Path(self.run.path) / "supervisor" / "warm.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = procs.spawn([sys.executable, "-m", "ptops.ops.rank.warm", self.name, self.recipe.engine], env, log)
        procs.KEEP.add(self.proc.pid)

    def stop(self) -> None:
        if self.proc is None:
            return
        procs.killpg(self.proc.pid, 9)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        procs.KEEP.discard(self.proc.pid)
        self.proc = None
