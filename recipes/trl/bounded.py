"""Bounded symbolic comparison for the math verifier (issue 49 point 3): each call has a wall-clock
deadline, a CPU limit and a memory limit enforced OUTSIDE the evaluation.

A sympy expansion (``(a+b+c+d+e+f+g+h)^9``: ~28 s of CPU, memory until a cap) cannot be
interrupted from inside the process that runs it, so it never runs in the trainer. The trainer
starts one small helper process (the *zygote*: a fresh interpreter, single-threaded, that imports
sympy and the verifier once and warms sympy's caches) which forks one *worker*; the worker compares
answers, the zygote only relays and times. Per call the zygote hands the worker the two answers and
waits at most ``deadline_s``; on overrun (or a worker killed by its RLIMIT_AS / RLIMIT_CPU) the
zygote SIGKILLs and reaps it, answers "no verdict" at once, then forks a fresh worker (a fork of a
warm process: milliseconds, not a sympy import). The trainer waits for the zygote's answer with a
margin and, if that too fails, kills the zygote and starts another on the next call.

"No verdict" scores 0: the policy is searching for the cheapest pass, so an answer that costs more
than the bound must never pass; it is counted (``STATS``, logged by the verifier as
``math/overrun``). The zygote is started lazily, once per process (again after a fork of the
trainer), and dies with its parent (its stdin closes).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

DEADLINE_S = 0.3  # wall clock per symbolic comparison, enforced by a SIGKILL from outside
MEMORY_MB = 1024  # RLIMIT_AS of the worker (sympy's own footprint is ~150-250 MB of it)
MARGIN_S = 2.0  # how much longer the trainer waits for the zygote itself

# calls, verdicts, overruns (deadline), deaths (a worker killed by its limits), zygote failures
STATS = {"calls": 0, "overrun": 0, "died": 0, "zygote_failed": 0}


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from ``fd`` before ``deadline`` (monotonic), else None (EOF or overrun)."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > 1 << 16:
            return None
    return buf


def _worker_loop(rfd: int, wfd: int, memory_mb: int) -> None:
    """In the forked worker: compare answers until the zygote closes the pipe."""
    import resource

    from ptops.recipes.trl.rewards import _symbolic_equal

    cap = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    _symbolic_equal("2*x+1", "1+2*x")  # touches its pages (copy-on-write) before any deadline runs
    while True:
        line = _read_line(rfd, time.monotonic() + 3600)
        if line is None:
            os._exit(0)
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime) + 2  # SIGXCPU if the deadline's kill is late
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        try:
            a, b = json.loads(line)[:2]
            verdict = _symbolic_equal(str(a), str(b))
        except MemoryError:
            os._exit(3)  # the heap may be half-built: a fresh worker answers the next call
        except Exception:  # noqa: BLE001 - anything else is "not equal"
            verdict = False
        os.write(wfd, b"1\n" if verdict else b"0\n")


def _fork_worker(memory_mb: int) -> tuple[int, int, int]:
    r1, w1 = os.pipe()  # zygote -> worker
    r2, w2 = os.pipe()  # worker -> zygote
    pid = os.fork()
    if pid == 0:
        try:
            os.close(w1)
            os.close(r2)
            null = os.open(os.devnull, os.O_RDWR)  # the zygote's stdio is the trainer's pipe
            os.dup2(null, 0)
            os.dup2(null, 1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _worker_loop(r1, w2, memory_mb)
        finally:
            os._exit(1)
    os.close(r1)
    os.close(w2)
    return pid, w1, r2


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _zygote(deadline_s: float, memory_mb: int) -> None:
    """The helper's main loop: stdin carries ``[a, b, deadline_s]`` lines, stdout gets ``1`` /
    ``0`` / ``overrun`` / ``died`` lines, one per request, each within its deadline (at most
    ``deadline_s``, the helper's own) of the request."""
    from ptops.recipes.trl.rewards import _symbolic_equal

    _symbolic_equal("2*x+1", "1+2*x")  # imports and warms sympy before any fork
    _symbolic_equal("sqrt(2)/2", "1/sqrt(2)")
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    pid, wfd, rfd = _fork_worker(memory_mb)
    stdin = sys.stdin.buffer.fileno()
    while True:
        line = _read_line(stdin, time.monotonic() + 10**9)
        if line is None:
            _kill(pid)
            return
        try:
            limit = min(float(json.loads(line)[2]), deadline_s)
        except (ValueError, TypeError, IndexError):
            limit = deadline_s
        try:
            os.write(wfd, line)
            reply = _read_line(rfd, time.monotonic() + limit)
        except OSError:
            reply = None
        if reply in (b"1\n", b"0\n"):
            out.write(reply)
            out.flush()
            continue
        # overrun or dead: answer first (the caller's bound), then replace the worker
        try:
            status = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:
            status = pid
        out.write(b"died\n" if status else b"overrun\n")
        out.flush()
        if not status:  # a reaped pid is not signalled again: it may be another process's by now
            _kill(pid)
        os.close(wfd)
        os.close(rfd)
        pid, wfd, rfd = _fork_worker(memory_mb)


class BoundedComparer:
    """The trainer's handle on the zygote. ``equal(a, b)`` is True / False, or None when the
    comparison had no verdict within the bound (overrun, limits, no helper): callers score None
    as 0."""

    def __init__(self, deadline_s: float = DEADLINE_S, memory_mb: int = MEMORY_MB) -> None:
        self.deadline_s, self.memory_mb = deadline_s, memory_mb
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen | None:
        code = (
            "import sys; from ptops.recipes.trl.bounded import _zygote; "
            f"_zygote({self.deadline_s!r}, {self.memory_mb!r})"
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                start_new_session=True,  # a signal to the trainer's group is not the helper's
            )
        except OSError:
            return None
        if _read_line(proc.stdout.fileno(), time.monotonic() + 120) != b"ready\n":
            self._stop(proc)
            return None
        return proc

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def equal(self, a: str, b: str, deadline_s: float | None = None) -> bool | None:
        """True / False, or None: no verdict within ``deadline_s`` (default, and at most, the
        comparer's own), the worker's limits, or no helper."""
        deadline = self.deadline_s if deadline_s is None else min(deadline_s, self.deadline_s)
        with self._lock:
            if os.getpid() != self._owner:  # a forked copy of the trainer: its own helper
                self._proc, self._owner = None, os.getpid()
            STATS["calls"] += 1
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
                if self._proc is None:
                    STATS["zygote_failed"] += 1
                    return None
            proc = self._proc
            try:
                proc.stdin.write(json.dumps([a, b, deadline]).encode() + b"\n")
                proc.stdin.flush()
                reply = _read_line(proc.stdout.fileno(), time.monotonic() + deadline + MARGIN_S)
            except OSError:
                reply = None
            if reply == b"1\n":
                return True
            if reply == b"0\n":
                return False
            if reply == b"overrun\n":
                STATS["overrun"] += 1
            elif reply == b"died\n":
                STATS["died"] += 1
            else:
                STATS["zygote_failed"] += 1
                self._stop(proc)
                self._proc = None
            return None

    def worker_pid(self) -> int | None:
        """The pid of the helper's current worker (for tests and diagnostics), else None."""
        if self._proc is None:
            return None
        try:
            with open(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and os.getpid() == self._owner:
                self._stop(self._proc)
            self._proc = None


_COMPARER: BoundedComparer | None = None
_COMPARER_LOCK = threading.Lock()


def comparer() -> BoundedComparer:
    """The process's shared :class:`BoundedComparer` (its helper is started on first use)."""
    global _COMPARER
    with _COMPARER_LOCK:
        if _COMPARER is None:
            import atexit

            _COMPARER = BoundedComparer()
            atexit.register(_COMPARER.close)
        return _COMPARER
