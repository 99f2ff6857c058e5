"""The warm pool of a supervised run (``[supervisor.restart] warm_spare``): started once, kept
across attempts.

Why: a restart's ranks otherwise import torch and the engine again (most of the time from a crash to
the next productive step). The pool (``ops/rank/warm.py``) imports them once, in the background,
started with the first attempt's ranks; the ranks of every later attempt are forked from it, without
a new torchrun (``launch_command``). It carries the run's ``PTOPS_RUN_DIR`` (so its children are
found by the supervisor's sweeps) but is kept out of the sweeps between attempts (``procs.KEEP``);
it dies with the supervisor (``PR_SET_PDEATHSIG``) and is stopped at the supervisor's end.

Each attempt asks ``source()`` where its ranks come from; the answer goes into the ``launch`` event
(``ranks_from``; ``cold_why`` and ``cold_detail`` when cold). The pool imports alongside the first
attempt's ranks, because its import takes 30-35 s on two busy cores: started after the first step,
a crash 8 s in would find nothing listening and restart cold, competing with that import. A restart
that finds it still importing waits for it (up to ``[supervisor.hang] import_s`` from its start)
rather than importing everything again next to it. A pool that exited is replaced when the next
attempt starts.

A *standing* pool (``ptops warm``, named by ``PTOPS_STANDING_POOL``) is not the run's: the run
neither starts nor stops it, and every attempt, the first included, asks it (:meth:`source`) whether
it imported the same interpreter, ptops, engine and import-time environment as this launch; a pool
that is gone or differs means a cold start that says why.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ptops import envnames
from ptops.ops.rank.warm import connect_own, fits, standing_name
from ptops.ops.supervisor import launcher, procs


class WarmPool:
    def __init__(self, recipe, run, standing: str = "") -> None:
        self.recipe, self.run = recipe, run
        self.standing = standing_name(standing, recipe.engine) if standing else ""
        self.name = self.standing or f"ptops-warm-{secrets.token_hex(8)}"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.declined = ""  # the pool's own "no warm pool: ..." (exit 0): not started again
        self.log = Path(run.path) / "supervisor" / "warm.log"

    def env(self) -> dict[str, str]:
        """What a warm attempt's launcher needs to find the pool (a cold attempt's ranks are not
        told of it)."""
        return {envnames.WARM_SOCKET: self.name}

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def wanted(self) -> bool:
        """Start one (again): none runs, and none declined (a GPU its forked children could not
        use)."""
        return self.proc is None and not self.declined and not self.standing

    def launch_command(self, cmd: launcher.RankCommand, nproc: int) -> launcher.RankCommand:
        """An attempt's ranks forked straight from the pool (``ops/rank/warmlaunch.py``) instead of
        a new torchrun; the torchrun command stays its fallback when the pool does not answer."""
        port = cmd.argv[cmd.argv.index("--master-port") + 1]
        argv = [
            sys.executable,
            "-P",  # as every interpreter ptops starts (launcher.rank_command)
            "-m",
            "ptops.ops.rank.warmlaunch",
            "--nproc",
            str(nproc),
            "--port",
            port,
            "--",
            *cmd.argv,
        ]
        return launcher.RankCommand(argv, cmd.env)

    def start(self) -> None:
        env = launcher.rank_command(self.recipe, self.run, 0).env
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = procs.spawn(
            [sys.executable, "-P", "-m", "ptops.ops.rank.warm", self.name, self.recipe.engine],
            env,
            self.log,
        )
        self.started_at = time.monotonic()
        procs.KEEP.add(self.proc.pid)

    def answers(self) -> bool:
        """The pool listens (it binds its socket only once the engine is imported and checked)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                connect_own(s, self.name)
            except OSError:  # none listens yet, or another user's process took the name
                return False
        return True  # closed without a request: the pool takes it for a probe

    def source(self, budget_s: float, stop: Callable[[], bool]) -> dict:
        """Where the next attempt's ranks come from: ``{"ranks_from": "warm", "warm_wait_s": S}``,
        or ``{"ranks_from": "cold", "cold_why": CODE, "cold_detail": TEXT}``. Waits while the pool
        is still importing, until it answers, exits, ``budget_s`` after its start has passed, or
        ``stop()``."""
        if self.standing:
            return self._standing_source()
        if self.declined:
            return _cold("pool_declined", self.declined)
        if self.proc is None:
            return _cold(
                "pool_not_started", "the pool starts with this attempt's ranks (none ran before)"
            )
        t0 = time.monotonic()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                detail = f"the pool exited with code {rc}: {self._last_line()}"
                if rc == 0:
                    self.declined = detail
                self._forget()  # else a new one starts after the next attempt's first step
                return _cold("pool_exited", detail)
            if self.answers():
                return {"ranks_from": "warm", "warm_wait_s": round(time.monotonic() - t0, 2)}
            if stop():
                return _cold("stopping", "the supervisor was asked to stop while the pool imported")
            if time.monotonic() - self.started_at > budget_s:
                detail = (
                    f"the pool was still importing {time.monotonic() - self.started_at:.0f} "
                    "s after its start"
                )
                self.stop()  # hung: it must not compete with the cold start; a new one starts later
                return _cold("pool_not_ready", detail)
            time.sleep(0.05)

    def _standing_source(self) -> dict:
        env = {**os.environ, **launcher.rank_constants(self.recipe.launch.omp_num_threads)}
        why, detail = fits(self.name, self.recipe.engine, env)  # as every rank of this launch
        if why:
            return _cold(why, detail)
        return {"ranks_from": "warm", "warm_wait_s": 0.0, "standing_pool": self.name}

    def _last_line(self) -> str:
        try:
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no warm.log)"
        return lines[-1][-300:] if lines else "(warm.log is empty)"

    def _forget(self) -> None:
        if self.proc is not None:
            procs.KEEP.discard(self.proc.pid)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:  # a standing pool is never ours to stop
            return
        procs.killpg(self.proc.pid, 9)
        procs.signal_all([self.proc.pid], 9)  # also when it is not a group leader
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._forget()


def _cold(why: str, detail: str) -> dict:
    return {"ranks_from": "cold", "cold_why": why, "cold_detail": detail}
