"""Grader calls bounded from outside the evaluation (issue 49 point 3): each call has a
wall-clock deadline, a CPU limit and a memory limit enforced by another process.

A sympy expansion (``(a+b+c+d+e+f+g+h)^9``: ~28 s of CPU, memory until a cap) or a judge's forward
over a completion built to be long cannot be interrupted from inside the process that runs it, so
neither runs in the trainer. A :class:`Bounded` grader starts one small helper process (the
*zygote*: a fresh interpreter, single-threaded, that runs the grader's ``setup`` once: imports
sympy, or loads the judge's weights, and warms them) which forks one *worker*; the worker answers
calls, the zygote only relays and times. Per call the zygote hands the worker the arguments and
waits at most ``deadline_s``; on overrun (or a worker killed by its RLIMIT_AS / RLIMIT_CPU) the
zygote SIGKILLs and reaps it, answers "no verdict" at once, then forks a fresh worker (a fork of a
warm process: milliseconds, not an import). The trainer waits for the zygote's answer with a
margin and, if that too fails, kills the zygote and starts another on the next call.

What "no verdict" is worth is the caller's decision, counted either way (``stats``): the math
verifier scores it 0 (an answer that costs more than the bound is the answer's doing, and must
never pass: ``math/overrun``); the judge returns None, which TRL treats as unscorable (no reward
and no advantage: ``judge/no_verdict``), since a judge's input is bounded and its overrun is the
machine's, not the completion's. The zygote is started lazily (or by :meth:`Bounded.start`), once
per process (again after a fork of the trainer), and dies with its parent (its stdin closes).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

DEADLINE_S = 0.3  # wall clock per symbolic comparison, enforced by a SIGKILL from outside
MEMORY_MB = 1024  # RLIMIT_AS of the math worker (sympy's own footprint is ~150-250 MB of it)
MARGIN_S = 2.0  # how much longer the trainer waits for the zygote itself
MAX_LINE = 1 << 20  # a request or a reply longer than this is no verdict (never read unbounded)

# the math comparer's counts: calls, overruns (deadline), deaths (a worker killed by its limits),
# errors (the call raised), zygote failures
STATS = {"calls": 0, "overrun": 0, "died": 0, "error": 0, "zygote_failed": 0}


def _read_line(fd: int, deadline: float, cap: int = MAX_LINE) -> bytes | None:
    """One line from ``fd`` before ``deadline`` (monotonic), else None (EOF, overrun, too long)."""
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
        if len(buf) > cap:
            return None
    return buf


def _vm_size_mb() -> int:
    """This process's virtual size (what RLIMIT_AS counts), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) >> 10
    return 0


def _worker_loop(rfd: int, wfd: int, fn, warm, memory_mb: int, headroom: bool) -> None:
    """In the forked worker: answer calls until the zygote closes the pipe."""
    import resource

    cap = (memory_mb + (_vm_size_mb() if headroom else 0)) << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if warm is not None:
        fn(*warm)  # touches its pages (copy-on-write) before any deadline runs
    while True:
        line = _read_line(rfd, time.monotonic() + 3600)
        if line is None:
            os._exit(0)
        used = resource.getrusage(resource.RUSAGE_SELF)
        try:
            request = json.loads(line)
            # SIGXCPU if the deadline's kill is late
            cpu = int(used.ru_utime + used.ru_stime + float(request["d"])) + 2
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
            reply = {"v": fn(*request["a"])}
        except MemoryError:
            os._exit(3)  # the heap may be half-built: a fresh worker answers the next call
        except Exception as e:  # noqa: BLE001 - the call's own failure: no verdict, reported
            reply = {"e": type(e).__name__}
        try:
            out = json.dumps(reply).encode() + b"\n"
        except (TypeError, ValueError):
            out = b'{"e": "unencodable"}\n'
        os.write(wfd, out)


def _fork_worker(fn, warm, memory_mb: int, headroom: bool) -> tuple[int, int, int]:
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
            _worker_loop(r1, w2, fn, warm, memory_mb, headroom)
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


def _zygote(spec: dict) -> None:
    """The helper's main loop. ``spec``: ``setup`` (``module:function``, called once with ``arg``:
    returns the call and the arguments of one warm call, or None), ``deadline_s``, ``memory_mb``,
    ``headroom`` (the memory limit is on top of what the worker holds at its fork). Stdin carries
    ``{"d": deadline_s, "a": args}`` lines, stdout gets one line per request, each within its
    deadline (at most the helper's own) of the request: ``{"v": value}``, ``{"e": error}``,
    ``"overrun"`` or ``"died"``."""
    mod, _, name = spec["setup"].partition(":")
    fn, warm = getattr(importlib.import_module(mod), name)(spec.get("arg"))
    deadline_s, memory_mb, headroom = spec["deadline_s"], spec["memory_mb"], spec["headroom"]
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    pid, wfd, rfd = _fork_worker(fn, warm, memory_mb, headroom)
    stdin = sys.stdin.buffer.fileno()
    while True:
        line = _read_line(stdin, time.monotonic() + 10**9)
        if line is None:
            _kill(pid)
            return
        try:
            limit = min(float(json.loads(line)["d"]), deadline_s)
        except (ValueError, TypeError, KeyError):
            limit = deadline_s
        try:
            os.write(wfd, line)
            reply = _read_line(rfd, time.monotonic() + limit)
        except OSError:
            reply = None
        if reply is not None:
            out.write(reply)
            out.flush()
            continue
        # overrun or dead: answer first (the caller's bound), then replace the worker
        try:
            status = os.waitpid(pid, os.WNOHANG)[0]
        except ChildProcessError:
            status = pid
        out.write(b'"died"\n' if status else b'"overrun"\n')
        out.flush()
        if not status:  # a reaped pid is not signalled again: it may be another process's by now
            _kill(pid)
        os.close(wfd)
        os.close(rfd)
        pid, wfd, rfd = _fork_worker(fn, warm, memory_mb, headroom)


class Bounded:
    """The trainer's handle on one grader's helper. ``call(*args)`` is ``("ok", value)``, or
    ``(why, None)`` when the call had no verdict within the bound: ``overrun`` (the deadline),
    ``died`` (the worker's limits), ``error`` (the call raised), ``failed`` (no helper)."""

    def __init__(
        self,
        setup: str,
        arg=None,
        deadline_s: float = DEADLINE_S,
        memory_mb: int = MEMORY_MB,
        headroom: bool = False,
        stats: dict | None = None,
        start_s: float = 120.0,
    ) -> None:
        self.spec = {
            "setup": setup,
            "arg": arg,
            "deadline_s": deadline_s,
            "memory_mb": memory_mb,
            "headroom": headroom,
        }
        self.deadline_s, self.memory_mb, self.start_s = deadline_s, memory_mb, start_s
        self.stats = stats if stats is not None else dict.fromkeys(STATS, 0)
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen | None:
        code = (
            "import json, sys; from ptops.recipes.trl.bounded import _zygote; "
            "_zygote(json.loads(sys.argv[1]))"
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(self.spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                start_new_session=True,  # a signal to the trainer's group is not the helper's
            )
        except OSError:
            return None
        if _read_line(proc.stdout.fileno(), time.monotonic() + self.start_s) != b"ready\n":
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

    def _ready(self) -> subprocess.Popen | None:
        if os.getpid() != self._owner:  # a forked copy of the trainer: its own helper
            self._proc, self._owner = None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        return self._proc

    def start(self) -> bool:
        """Start the helper now (outside any call's deadline); whether it is up."""
        with self._lock:
            return self._ready() is not None

    def call(self, *args, deadline_s: float | None = None) -> tuple[str, object]:
        """``("ok", value)``, or ``(why, None)``: no verdict within ``deadline_s`` (default, and
        at most, the helper's own), the worker's limits, an error, or no helper."""
        deadline = self.deadline_s if deadline_s is None else min(deadline_s, self.deadline_s)
        with self._lock:
            self.stats["calls"] += 1
            proc = self._ready()
            if proc is None:
                self.stats["zygote_failed"] += 1
                return "failed", None
            request = json.dumps({"d": deadline, "a": list(args)}).encode() + b"\n"
            if len(request) > MAX_LINE:
                self.stats["error"] += 1
                return "error", None
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = _read_line(proc.stdout.fileno(), time.monotonic() + deadline + MARGIN_S)
                reply = json.loads(reply) if reply is not None else None
            except (OSError, ValueError):
                reply = None
            if isinstance(reply, dict) and "v" in reply:
                return "ok", reply["v"]
            why = reply if reply in ("overrun", "died") else "error" if reply else "failed"
            self.stats[why if why != "failed" else "zygote_failed"] += 1
            if why == "failed":
                self._stop(proc)
                self._proc = None
            return why, None

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


def _math_setup(_arg):
    """The math comparer's zygote: sympy imported and warmed before any fork."""
    from ptops.recipes.trl.rewards import _symbolic_equal

    def equal(a, b) -> bool:
        try:
            return _symbolic_equal(str(a), str(b))
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - anything sympy raises is "not equal"
            return False

    equal("2*x+1", "1+2*x")
    equal("sqrt(2)/2", "1/sqrt(2)")
    return equal, ("2*x+1", "1+2*x")


class BoundedComparer(Bounded):
    """The math verifier's symbolic comparison, bounded. ``equal(a, b)`` is True / False, or None
    when the comparison had no verdict within the bound (overrun, limits, no helper): the
    verifier scores None as 0."""

    def __init__(self, deadline_s: float = DEADLINE_S, memory_mb: int = MEMORY_MB) -> None:
        super().__init__(
            "ptops.recipes.trl.bounded:_math_setup",
            deadline_s=deadline_s,
            memory_mb=memory_mb,
            stats=STATS,
        )

    def equal(self, a: str, b: str, deadline_s: float | None = None) -> bool | None:
        """True / False, or None: no verdict within ``deadline_s`` (default, and at most, the
        comparer's own), the worker's limits, or no helper."""
        why, value = self.call(a, b, deadline_s=deadline_s)
        return bool(value) if why == "ok" else None


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
