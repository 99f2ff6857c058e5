"""Warm spare ranks: one process per node that has already imported the engine forks each rank of a
restart.

Why: after a crash, most of the time back to training is start-up: every new rank imports torch and
the engine (TorchTitan: 10-20 s on an idle 2-core box, 30+ s when busy). The supervisor starts this
*warm pool* once per run (``[supervisor.restart] warm_spare = true``), alongside the first attempt's
ranks; it imports the engine and waits. A rank that torchrun starts (``ops/rank/entry.py``) hands
itself over: it sends its environment, argv, working directory and stdin/stdout/stderr to the pool,
the pool forks a child that already has the engine imported and runs the rank there, and the thin
rank that torchrun watches mirrors that child: signals it receives are forwarded, and it exits with
the child's status (a SIGKILLed child makes it SIGKILL itself, so torchrun and the supervisor see
what they would have seen).

A restart that comes while the pool is still importing waits for it (``ops/supervisor/warmpool.py``)
rather than starting cold: a cold start would import the same modules from nothing while competing
with the pool for the same cores (on 2 busy cores the pool needs ~30 s to import; a crash 8 s in
that went cold would be no faster than the first start). A connection that sends
nothing is the supervisor's readiness probe.

No orphans: the pool dies with the supervisor (``PR_SET_PDEATHSIG``, and the supervisor kills it at
the end); each child dies with the pool (``PR_SET_PDEATHSIG``) and with its thin rank (a pidfd
watch); the children carry the run's ``PTOPS_RUN_DIR`` like every rank, so the supervisor's sweeps
find them. When the pool is not listening yet (still importing) or is gone, the rank starts cold as
before.

A *standing* pool (``ptops warm ENGINE``) is the same loop started by hand, outside any run: on a
workstation or in a test session, every launch whose ``PTOPS_WARM_POOL`` names it starts its first
attempt warm too (``ops/supervisor/warmpool.py``). It carries no run directory; a child writes its
run's into its ``/proc/PID/environ`` (``environslot.py``) so the supervisor's sweeps find it, and
the pool SIGKILLs a child the moment the connection of the rank (or ``warmlaunch``) that asked for
it closes.

Only the pool's own user is served, and ranks hand over only to a pool of their own user
(``SO_PEERCRED`` both ways): an abstract socket has no file mode and its name goes to whoever binds
it first, while a request decides what its child runs and carries the rank's stdio and token.

Protocol (an abstract Unix socket ``\\0<PTOPS_WARM_SOCKET>``): the rank sends an 8-byte length with
its three fds (SCM_RIGHTS), then that many bytes of JSON ``{env, argv, cwd, pid}``; the pool answers
one JSON line ``{"pid": child}`` and, when the child ends, one line ``{"status": waitstatus}``. A
length of 0 without fds asks what the pool is (:func:`describe`): one JSON line, then it closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from ptops import envnames
from ptops.ops.rank import environslot
from ptops.ops.runrecord import ranklog

# read once, at import (libgomp's thread count, huggingface_hub's and transformers' offline flags):
# a child keeps its pool's values whatever its request says, so a launch must match them
IMPORT_ENV = ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
WARM_LINE = "warm rank: forked from pool {pool} with the engine imported"
# what a request may run besides a rank: ptops's own engine-side dry runs (ops/rank/warmrun.py)
MODULES = ("ptops.recipes.titan.dryrun", "ptops.recipes.trl.dryrun")
_SLOT: tuple[int, int] | None = None  # environslot.find() in the pool, before any fork
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)


def standing_name(name: str, engine: str) -> str:
    """Where the standing pool ``name`` (``ptops warm --name``) serves ``engine``."""
    return f"{name}-{engine}"


# ----------------------------------------------------------------------------- the requester's side
def request(
    name: str,
    env: dict[str, str],
    argv: list[str],
    fds: tuple[int, int, int] = (0, 1, 2),
    module: str = "",
) -> tuple[socket.socket, Any, int]:
    """Ask the pool ``name`` for one child running ``argv`` with ``env`` (and this process' cwd and
    the stdio ``fds``): a rank, or ``module`` (one of :data:`MODULES`). The child dies with this
    process. Returns the connection, an unbuffered reader of it (the child's status line comes on
    it later; unbuffered, so nothing of it hides in a buffer from a ``select`` on the socket) and
    the child's pid. Raises ``OSError`` / ``ValueError`` / ``KeyError`` when no pool answers, or it
    starts no child."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connect_own(s, name)
        req = {"env": env, "argv": argv, "cwd": os.getcwd(), "pid": os.getpid()}
        body = json.dumps({**req, "module": module} if module else req).encode()
        socket.send_fds(s, [struct.pack("!Q", len(body))], list(fds))
        s.sendall(body)
        f = s.makefile("rb", buffering=0)
        first = f.readline()
        child = int(json.loads(first)["pid"]) if first else 0
        if not child:
            raise ConnectionError("the pool started no child")
    except BaseException:
        s.close()
        raise
    return s, f, child


def peer_uid(s: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def connect_own(s: socket.socket, name: str) -> None:
    """Connect to the pool ``name``, refusing one another user runs: an abstract name can be
    taken by anyone first, and a request hands over this rank's stdio, env and channel token."""
    s.connect("\0" + name)
    uid = peer_uid(s)
    if uid != os.getuid():
        raise PermissionError(f"the pool at {name} runs as uid {uid}, not {os.getuid()}")


def describe(name: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """What the pool ``name`` imported and with what (:func:`identity`); raises ``OSError`` /
    ``ValueError`` when none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        connect_own(s, name)
        s.sendall(struct.pack("!Q", 0))
        line = s.makefile("rb").readline()
    out = json.loads(line)
    if not isinstance(out, dict):
        raise ValueError(f"the pool answered {line[:200]!r}")
    return out


def fits(name: str, engine: str, env: dict[str, str]) -> tuple[str, str]:
    """``("", "")`` when the pool ``name`` imported what a process of ``engine`` started with
    ``env`` would import (:func:`identity`), else ``(why, detail)``: ``standing_pool_gone`` (none
    answers) or ``standing_pool_differs``."""
    try:
        pool = describe(name)
    except (OSError, ValueError) as e:
        return "standing_pool_gone", f"no standing pool answers at {name} ({type(e).__name__}: {e})"
    ours = identity(engine)
    ours["env"] = {k: env.get(k, "") for k in IMPORT_ENV}
    differ = [
        f"{k}: pool {pool.get(k)!r}, this launch {ours[k]!r}"
        for k in ("engine", "python", "ptops", "env")
        if pool.get(k) != ours[k]
    ]
    return ("standing_pool_differs", f"{name}: " + "; ".join(differ)) if differ else ("", "")


def identity(engine: str) -> dict[str, Any]:
    """What a forked child inherits and cannot change afterwards: the interpreter, the ptops code
    it imported, the engine, and the environment read at import (:data:`IMPORT_ENV`). A launch
    uses a standing pool only when all of them match its own."""
    import ptops

    return {
        "pid": os.getpid(),
        "engine": engine,
        "python": sys.executable,
        "ptops": os.path.dirname(os.path.abspath(ptops.__file__)),
        "env": {k: os.environ.get(k, "") for k in IMPORT_ENV},
    }


# --------------------------------------------------------------------------- the rank's side (thin)
def handoff() -> None:
    """In a rank torchrun started: run this rank in a warm child and exit with its status (never
    returns), or return at once when no pool answers (the rank then starts cold)."""
    name = os.environ.get(envnames.WARM_SOCKET)
    if not name:
        return
    try:
        s, f, child = request(name, dict(os.environ), sys.argv)
    except (OSError, ValueError, KeyError):
        return  # no pool (not warm yet, or gone): start cold

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(child, signum)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        line = f.readline()
        status = int(json.loads(line)["status"]) if line else None
    except (OSError, ValueError, KeyError):
        status = None
    if status is None:  # the pool died under us: take the child with us
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (
            signal.SIGKILL,
            signal.SIGSTOP,
        ):  # those two cannot be caught: nothing to reset
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout.flush()
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


# ----------------------------------------------------------------------------- the pool
def say(msg: str) -> None:
    """One line of ``supervisor/warm.log``, stamped: its order against the run's events must be
    readable."""
    ranklog.get("warm").info("%s %s", time.strftime("%H:%M:%S"), msg)


def preload(engine: str) -> None:
    """Import what every rank of ``engine`` imports (torch, the engine and its ptops adapter)."""
    import importlib

    import torch  # noqa: F401

    from ptops.recipes.engines import get

    module = get(engine).entry.split(":")[0]
    mod = importlib.import_module(module)
    pre = getattr(mod, "preload", None)
    if pre is not None:
        pre()


def forked_child_status(fn: Any) -> int:
    """Run ``fn`` in a child forked from this process; its wait status (0: it returned)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:
            os._exit(1)
        os._exit(0)
    return os.waitpid(pid, 0)[1]


def cuda_fork_problem() -> str:
    """Why the ranks forked from this pool could not use the GPUs, or "" (no GPU, or they can).

    Checked once, with a real forked child, because the pool has imported torch and the engine, and
    anything in them that initialised CUDA here would make every warm rank fail at its first CUDA
    call (a restart loop, not a fast restart). A pool that fails the check serves nothing: the
    launcher then starts torchrun (``ops/rank/warmlaunch.py``)."""
    import torch

    try:
        if torch.cuda.device_count() == 0:
            return ""
    except Exception:  # no usable driver: the ranks will say so themselves
        return ""

    def touch() -> None:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()

    status = forked_child_status(touch)
    return "" if status == 0 else f"a child forked from it cannot use CUDA (wait status {status})"


def serve(name: str, engine: str, target: Any = None) -> None:
    """The pool's main loop: single-threaded (it forks), reaping children and reporting their
    status. ``target`` (tests): what a child runs instead of the rank (``entry.run_rank``)."""
    from ptops.ops.rank.entry import die_with_parent

    global _SLOT
    t0 = time.monotonic()
    die_with_parent()  # the supervisor
    _SLOT = environslot.find()  # a standing pool's: where a child writes its run (environslot.py)
    if target is None:
        # torch.cuda.is_available() (TorchTitan calls it at import) would otherwise initialise the
        # CUDA driver here, and a child forked after that cannot use CUDA; NVML answers the same
        # question
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        preload(engine)
        why = cuda_fork_problem()
        if why:
            say(f"no warm pool: {why}; restarts start through torchrun")
            return
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(64)
    me = identity(engine)
    say(f"pool {os.getpid()} ready ({engine}) after {time.monotonic() - t0:.1f} s")
    waiting: dict[int, socket.socket] = {}  # child pid -> its requester's connection
    exits: dict[int, int] = {}  # pidfd -> child pid: a child's exit is reported at once
    while True:
        asked = {conn.fileno(): pid for pid, conn in waiting.items() if conn.fileno() >= 0}
        ready, _, _ = select.select([srv, *exits, *asked], [], [], 1.0)
        if srv in ready:
            conn, _ = srv.accept()
            try:
                child = _start(srv, conn, target, me)
            except Exception as e:  # a bad request must not end the pool
                say(f"request failed: {type(e).__name__}: {e}")
                conn.close()
            else:
                if child is None:  # a readiness probe, or a question answered
                    conn.close()
                    continue
                waiting[child] = conn
                try:
                    exits[os.pidfd_open(child)] = child
                except OSError:
                    pass  # reaped by the periodic waitpid below
        for fd in [fd for fd in ready if fd in exits]:
            os.close(fd)
            del exits[fd]
        for fd in [fd for fd in ready if fd in asked]:
            _requester_gone(waiting[asked[fd]], asked[fd])
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _requester_gone(conn: socket.socket, child: int) -> None:
    """A requester never sends after its request: a readable connection is a closed one (the thin
    rank or ``warmlaunch`` died), and its child must not outlive it."""
    try:
        gone = conn.recv(4096, socket.MSG_DONTWAIT) == b""  # bytes after a request: dropped
    except BlockingIOError:
        return
    except OSError:
        gone = True
    if gone:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
        conn.close()  # its status, when reaped, goes nowhere


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("rank hung up")
        out += chunk
    return out


def _start(
    srv: socket.socket, conn: socket.socket, target: Any = None, me: dict | None = None
) -> int | None:
    """Fork the child a request asks for; None for a readiness probe (a connection closed
    unsaid) or a question (:func:`describe`)."""
    uid = peer_uid(conn)
    if uid != os.getuid():
        # an abstract socket has no file mode: anyone on the host can connect, and a child runs
        # whatever the request's env and argv say, as this user
        raise PermissionError(f"a request from uid {uid}, not this pool's uid {os.getuid()}")
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if not head and not fds:
        return None
    if head == struct.pack("!Q", 0) and not fds:
        conn.sendall(json.dumps(me or {}).encode() + b"\n")
        return None
    try:
        if len(head) != 8 or len(fds) != 3:
            raise ValueError("bad handoff header")
        req = json.loads(_recv_exact(conn, struct.unpack("!Q", head)[0]))
        if req.get("module", "") not in ("", *MODULES):
            raise ValueError(f"module {req['module']!r} is not one a pool runs")
    except BaseException:
        for fd in fds:  # a refused request leaves none of the requester's fds open in the pool
            os.close(fd)
        raise
    pid = os.fork()
    if pid == 0:  # the warm rank
        try:
            srv.close()
            conn.close()
            _become(req, fds, target)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            os._exit(code)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _become(req: dict, fds: list[int], target: Any = None) -> None:
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # the pool's pid: the rank's log says it started warm
    os.environ[envnames.WARM_POOL] = str(os.getppid())
    if req["env"].get(envnames.RUN_DIR):  # so the sweeps of its run find it
        environslot.write(_SLOT, envnames.RUN_DIR, req["env"][envnames.RUN_DIR])
    sys.argv = list(req["argv"])
    from ptops.ops.rank import entry

    entry._prctl(entry.PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the pool
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _die_with(int(req["pid"]))
    if req.get("module"):  # checked against MODULES before the fork
        import runpy

        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        return
    (target or entry.run_rank)()


def _die_with(pid: int) -> None:
    """SIGKILL this process when ``pid`` (the thin rank torchrun watches) is gone."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ptops-thin-rank-watchdog", daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
