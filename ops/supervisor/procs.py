"""Processes of a supervised attempt: spawn torchrun so it dies with us, find and kill what is left.

No orphans, in layers:

1. torchrun is spawned in its own session with ``PR_SET_PDEATHSIG=SIGKILL``:
   if the supervisor dies (even by SIGKILL), the kernel kills torchrun;
2. each rank sets ``PR_SET_PDEATHSIG=SIGKILL`` towards torchrun and watches
   its parent (``ops/rank/entry.py``), and kills itself when the supervisor's
   channel closes (``ops/rank/probe.py``);
3. on teardown and on adoption the supervisor sweeps ``/proc`` for every process
   whose environment carries this run's ``PTOPS_RUN_DIR`` and kills it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from ptops import envnames

PR_SET_PDEATHSIG = 1
# a local attempt's node agent: the launcher it runs (JSON list) and the file its output goes to
# (here, not in ops/node, so the supervisor names them without importing the agent)

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec: keep it tiny
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (the node agent under slurmstepd)."""
    _die_with_parent()


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children by /proc's PPid), so a whole tree can be
    killed."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start torchrun in its own session; the kernel SIGKILLs it when this process dies."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


# Processes of this supervisor that carry the run's PTOPS_RUN_DIR but outlive an attempt (the warm
# pool, ops/supervisor/warmpool.py): sweeps between attempts leave them; the supervisor stops them
# at its end.
KEEP: set[int] = set()


def run_processes(run_dir: Path, exclude: set[int] | None = None) -> list[int]:
    """Pids of live processes whose environment has ``PTOPS_RUN_DIR`` = this run (same user or
    root)."""
    want = envnames.RUN_DIR.encode() + b"=" + str(Path(run_dir).resolve()).encode()
    skip = {os.getpid()} | KEEP | (exclude or set())
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip:
            continue
        if want in _environ(pid).split(b"\0") and not is_zombie(pid):
            out.append(pid)
    return sorted(out)


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def zombie_exit_code(pid: int) -> int | None:
    """The exit code of ``pid`` if it has exited and its parent has not reaped it yet, as torchrun
    reports it (minus the signal for a signal death), else None. Why: torchrun reaps a dead rank
    only at its monitor interval (0.5 s); the kernel has the status in ``/proc/PID/stat`` (field 52,
    Linux >= 3.5) until then."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X") or len(fields) < 50:
            return None
        status = int(fields[49])
    except (OSError, ValueError, IndexError):
        return None
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not is_zombie(pid)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def teardown(
    proc: subprocess.Popen | None, run_dir: Path, rank_pids: list[int], grace_s: float
) -> list[int]:
    """Stop torchrun and every rank of this run: SIGTERM (+SIGCONT), wait ``grace_s``, then SIGKILL.

    ``grace_s=0`` kills at once (a hung attempt). Returns the pids that needed SIGKILL.
    """
    pids = sorted(set(rank_pids) | set(run_processes(run_dir)))
    if proc is not None and proc.poll() is None:
        pids = sorted(set(pids) | {proc.pid})
    if grace_s > 0:
        signal_all(pids, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        if proc is not None and proc.poll() is None:
            killpg(proc.pid, signal.SIGTERM)
        signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            if not any(alive(p) for p in pids):
                break
            time.sleep(0.1)
    killed = [p for p in pids if alive(p)]
    if proc is not None and proc.poll() is None:
        killpg(proc.pid, signal.SIGKILL)
    signal_all(killed, signal.SIGKILL)
    # anything started in between (a rank mid-spawn) goes too
    for _ in range(50):
        if proc is not None:
            proc.poll()
        left = [p for p in run_processes(run_dir) if alive(p)]
        if not left and (proc is None or proc.poll() is not None):
            break
        signal_all(left, signal.SIGKILL)
        time.sleep(0.1)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return killed
