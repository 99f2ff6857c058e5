"""A restart's ranks forked straight from the warm pool: what torchrun does for one node, without
torchrun.

Why: with a warm pool (``ops/rank/warm.py``) a restart still paid for a new torchrun (it imports
torch, ~1-2 s idle and several seconds on a busy box, then its rendezvous and a 0.5 s monitor
interval) before its ranks could be handed to the pool. For one node, all torchrun adds is the
ranks' environment and watching them, so this light process (no torch) does both: it asks the pool
for ``--nproc`` children with the environment torchrun would give them (rank 0 hosts the store on
``MASTER_PORT``), and stands where torchrun stood for the supervisor:

- on the first child that fails it writes torchrun's own line, ``failed (exitcode: N) local_rank:
  R`` (``ops/supervisor/attempt.py`` reads it), stops the others (each then gets an ``exited
  (exitcode: N) local_rank: R`` line) and exits 1; it exits 0 when all do;
- SIGTERM/SIGINT are forwarded to the children; each child dies with this process (the pool's pidfd
  watch on the requester) and with the pool (``PR_SET_PDEATHSIG``), and carries the run's
  ``PTOPS_RUN_DIR``.

When the pool does not answer (not ready yet, or gone) it becomes the torchrun command it was given
(``os.execv``), so an attempt always starts.

    python -m ptops.ops.rank.warmlaunch --nproc N --port P -- <torchrun argv>
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from ptops import envnames
from ptops.ops.rank.warm import request

STOP_GRACE_S = 5.0  # torchrun's: SIGTERM to the others, then SIGKILL


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment torchrun gives local rank ``rank`` of a one-node world (static
    rendezvous)."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "ptops-warm", "TORCHELASTIC_USE_AGENT_STORE": "False",
    })  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _code(status: int) -> int:
    """A wait status as torchrun reports it: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _status(line: str) -> int:
    """A child's code from the pool's status line."""
    try:
        return _code(int(json.loads(line)["status"]))
    except (ValueError, KeyError, TypeError):
        return -signal.SIGKILL  # the pool died under its child (which dies with it)


def launch(nproc: int, port: int, fallback: list[str]) -> int:
    name = os.environ.get(envnames.WARM_SOCKET, "")
    entry = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry.py")]
    started: list[tuple[socket.socket, Any, int]] = []
    try:
        for rank in range(nproc):
            started.append(request(name, rank_env(dict(os.environ), rank, nproc, port), entry))
    except (OSError, ValueError, KeyError) as e:
        _kill([pid for _, _, pid in started], signal.SIGKILL)
        print(
            f"[ptops.warmlaunch] the warm pool did not answer ({type(e).__name__}: {e}); "
            "starting torchrun",
            flush=True,
        )
        os.execv(fallback[0], fallback)
    pids = [pid for _, _, pid in started]
    print(f"[ptops.warmlaunch] {nproc} ranks forked from the warm pool: pids {pids}", flush=True)

    def forward(signum: int, _frame: object) -> None:
        _kill(pids, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    live = {s.fileno(): (rank, s) for rank, (s, _, _) in enumerate(started)}
    files = {s.fileno(): f for s, f, _ in started}
    failed: tuple[int, int] | None = None
    while live:
        try:
            ready, _, _ = select.select(list(live), [], [])
        except InterruptedError:
            continue
        for fd in ready:
            if fd not in live:  # read by _stop_rest after an earlier failure in this batch
                continue
            rank, s = live.pop(fd)
            code = _status(files[fd].readline())
            s.close()
            if failed is not None:
                _exited(rank, code, pids)
            elif code != 0:
                failed = (rank, code)
                print(
                    f"[ptops.warmlaunch] failed (exitcode: {code}) local_rank: {rank} (pid: "
                    f"{pids[rank]})",
                    flush=True,
                )
                others = [pids[r] for r, _ in live.values()]
                _kill(others, signal.SIGTERM)
                _stop_rest(live, files, pids, time.monotonic() + STOP_GRACE_S)
                _kill([pids[r] for r, _ in live.values()], signal.SIGKILL)  # their statuses follow
    return 0 if failed is None else 1


def _exited(rank: int, code: int, pids: list[int]) -> None:
    """How a child after the first failure ended: the supervisor's blame tells a child this process
    stopped (SIGTERM) from one that died on its own in the same ``select`` (two statuses ready at
    once come in rank order, so the ``failed`` line alone is no order of death)."""
    print(
        f"[ptops.warmlaunch] exited (exitcode: {code}) local_rank: {rank} (pid: {pids[rank]})",
        flush=True,
    )


def _stop_rest(live: dict, files: dict, pids: list[int], deadline: float) -> None:
    """After a failure: wait for the others until ``deadline``, then SIGKILL whoever is left."""
    while live:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(live), [], [], left)
        for fd in ready:
            if fd not in live:  # read by _stop_rest after an earlier failure in this batch
                continue
            rank, s = live.pop(fd)
            code = _status(files[fd].readline())
            s.close()
            _exited(rank, code, pids)


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    opts, fallback = argv[:sep], argv[sep + 1 :]
    nproc = int(opts[opts.index("--nproc") + 1])
    port = int(opts[opts.index("--port") + 1])
    return launch(nproc, port, fallback)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
