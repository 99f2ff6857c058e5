"""Run a model's Python completion against test asserts, isolated: the GRPO ``code`` reward.

Reward = passed asserts / all asserts, and 0.0 unless the harness ran to its end: a crash,
``sys.exit``, a kill, a limit hit (CPU, memory, processes, wall clock) all score 0, so the
outcome depends on the code only and not on timing (a program near its CPU limit is the
exception). What a completion can do to the host, and what stops it:

=====================  =============================================================
fork bomb              RLIMIT_NPROC for a uid of its own (so concurrent sandboxes of the
                       two ranks never share the count), a fresh pid namespace whose init is
                       the harness (all of it dies with the harness), and a ``kill(-1)`` as
                       that uid afterwards (nothing of it outlives the call)
infinite loop          RLIMIT_CPU (SIGXCPU then SIGKILL) and a wall-clock kill
memory bomb            RLIMIT_AS
``rm -rf`` / writes    an unprivileged uid that owns nothing but its private work dir
                       (cwd, HOME, TMPDIR); a private mount namespace with tmpfs /tmp,
                       /var/tmp, /dev/shm (size-limited, gone at exit); RLIMIT_FSIZE
network                a fresh network namespace (no interface up, not even loopback);
                       where namespaces are not permitted, an audit hook in the harness
                       that refuses ``socket.*``, ``subprocess``/``exec``/``spawn`` and
                       ``ctypes`` (no seccomp: a weaker guard, reported as such)
signals to the trainer the parent is outside the pid namespace (``getppid()`` is 0) and
                       of another uid (EPERM)
=====================  =============================================================

Not root: no uid of its own (files are the trainer's: only the audit hook guards them), but an
unprivileged user namespace still gives the network and pid namespaces (``userns``); RLIMIT_NPROC
is then the trainer's own task count + ``max_procs``.

Which isolation was used is reported in every result (``isolation``) and by the
trainer's ``reward_source`` event. The launcher (this file run as a script, standard
library only) is a separate process because the training rank is multi-threaded: namespaces
and uids are set in a fresh single-threaded process, never with ``preexec_fn``.

Known limit: the asserts run in the same interpreter as the completion, so a completion that
searches its own memory for the harness's per-run token could forge a pass. Printed
"PASS" lines, ``sys.exit(0)``, ``os._exit(0)`` and a redefined ``AssertionError`` cannot.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

# clone(2) flags and mount(2) flags (linux/sched.h, linux/mount.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
UID_BASE = 200_000  # sandbox uid = UID_BASE + the launcher's pid: unique among live sandboxes
OUTPUT_CAP = 64 * 1024


@dataclass(frozen=True)
class Limits:
    """Per-completion limits (``[trl.sandbox]``)."""

    cpu_s: int = 2
    wall_s: float = 10.0
    memory_mb: int = 512
    max_procs: int = 16
    file_mb: int = 8


@dataclass
class Result:
    passed: int = 0
    total: int = 0
    status: str = "ok"  # ok | error (the harness ran, code raised) | killed | timeout | no_result
    reward: float = 0.0
    isolation: dict = field(default_factory=dict)
    detail: str = ""
    wall_s: float = 0.0  # launcher-measured, harness start to reap


def _harness(code: str, tests: list[str]) -> str:
    """The program the sandbox runs: the completion, then each assert, in one namespace; one result
    line with the per-run token on a private descriptor (the completion's own output goes nowhere).
    An audit hook refuses, and marks as hostile (reward 0), what a solution never needs: the
    network, new programs, signals to anything but its own children, writes outside the work dir."""
    return f'''import sys, os
_STRICT = False
{_GUARD_MARK}
def _install(_flag, _strict=_STRICT):
    _work = os.path.realpath(os.getcwd())
    _ppid, _rp, _fs = os.getppid(), os.path.realpath, os.fsdecode
    _paths = ("os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "os.replace", "os.chmod", "os.chown",
              "os.truncate", "os.link", "os.symlink", "os.utime", "os.mkdir", "os.chflags", "os.setxattr")
    _spawn = ("subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile", "pty.")
    _strict_deny = ("ctypes.", "os.fork", "os.forkpty")
    _busy = []

    def _inside(p):
        if isinstance(p, int):
            return True
        r = _rp(_fs(p))
        return r == _work or r.startswith(_work + "/") or r == "/dev/null"

    def _hostile(event, args):
        if event.startswith("socket.") or event.startswith(_spawn) or event == "os.killpg":
            return True
        if event == "os.kill":
            return args[0] <= 1 or args[0] == _ppid
        if event in _paths:
            return any(not _inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike)))
        if event == "open":
            path, mode, flags = args
            w = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            return w and not isinstance(path, int) and not _inside(path)
        return _strict and event.startswith(_strict_deny)

    def _hook(event, args):
        if _busy:
            return
        _busy.append(1)
        try:
            bad = _hostile(event, args)
        except Exception:
            bad = False
        finally:
            _busy.clear()
        if bad:
            _flag.append(event)
            raise PermissionError("sandbox: " + event + " refused")
    sys.addaudithook(_hook)

def _main(_W=os.write, _exit=os._exit):
    _t = sys.stdin.readline().strip()
    _fd = os.dup(1)
    _null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(_null, 1)
    _flag = []
    _install(_flag)
    _g = {{"__name__": "__main__", "__builtins__": __builtins__}}
    _tests = {tests!r}
    _ok = 0
    try:
        exec(compile({code!r}, "<completion>", "exec"), _g)
        _loaded = True
    except BaseException:
        _loaded = False
    if _loaded:
        for _x in _tests:
            try:
                exec(compile(_x, "<test>", "exec"), _g)
                _ok += 1
            except BaseException:
                pass
    _W(_fd, ("%s %d %d %s\\n" % (_t, 0 if _flag else _ok, len(_tests), (_flag or ["-"])[0])).encode())
    _exit(0)
_main()
'''


_GUARD_MARK = "# <guard>"
# Without a network namespace the harness is stricter (no seccomp: a weaker guard, reported as such).
_GUARD = "_STRICT = True"


def _world_reachable(path: str) -> bool:
    """Whether any uid may execute ``path`` (every directory above it o+x, the file o+rx)."""
    import stat

    path = os.path.realpath(path)
    try:
        parts = path.split("/")
        for i in range(2, len(parts)):
            if not os.stat("/".join(parts[:i]) or "/").st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


def sandbox_python(root: bool | None = None) -> str | None:
    """An interpreter the unprivileged sandbox uid can run (this one, else the system's);
    None when there is none (as root, the sandbox then refuses to run rather than run as root)."""
    root = os.geteuid() == 0 if root is None else root
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and os.path.exists(cand) and (not root or _world_reachable(cand)):
            return os.path.realpath(cand)
    return None


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _try(libc, fn: str, *args) -> bool:
    return getattr(libc, fn)(*args) == 0


# ---------------------------------------------------------------- the launcher (a process of its own)


def _launch(cfg: dict) -> dict:
    """Runs in a fresh single-threaded process: isolate, fork the harness, wait, clean up, report."""
    import resource

    work, limits, token = cfg["work"], cfg["limits"], cfg["token"]
    iso = {"uid": None, "userns": False, "netns": False, "pidns": False, "mountns": False, "network": "none"}
    root = os.geteuid() == 0
    libc = _libc() if sys.platform.startswith("linux") else None
    uid = UID_BASE + os.getpid() if root else os.getuid()
    if cfg["python"] is None:
        raise RuntimeError("no Python interpreter the sandbox uid can execute (tried this one and /usr/bin/python3)")
    if root:
        iso["uid"] = uid
        os.chown(work, uid, uid)
        _kill_uid(uid)  # a leftover of an earlier sandbox with the same uid (cannot happen; belt and braces)
    if libc is not None and root and cfg.get("namespaces", True):
        iso["netns"] = _try(libc, "unshare", CLONE_NEWNET)
        iso["pidns"] = _try(libc, "unshare", CLONE_NEWPID)
        if _try(libc, "unshare", CLONE_NEWNS) and _try(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None):
            iso["mountns"] = True
            for d in ("/tmp", "/var/tmp", "/dev/shm"):
                if os.path.isdir(d):
                    opts = f"size={limits['file_mb'] * 2}m,mode=1777".encode()
                    _try(libc, "mount", b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts)
    elif libc is not None and cfg.get("namespaces", True):
        # not root: an unprivileged user namespace still gives no network and a pid namespace
        # (files stay the trainer's own uid's: only the audit hook guards them)
        if _try(libc, "unshare", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID):
            iso["userns"] = iso["netns"] = iso["pidns"] = True
    nproc = int(limits["max_procs"]) if root else _tasks_of(uid) + int(limits["max_procs"])
    os.makedirs(work, mode=0o700, exist_ok=True)  # under the fresh tmpfs /tmp when mountns
    if root:
        os.chown(work, uid, uid)
    iso["network"] = "netns" if iso["netns"] else "audit-hook"
    harness = cfg["program"]
    if not iso["netns"]:
        harness = harness.replace(_GUARD_MARK, _GUARD)
    prog = os.path.join(work, "main.py")
    with open(prog, "w") as f:
        f.write(harness)
    if root:
        os.chown(prog, uid, uid)
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the harness: pid 1 of its namespace when pidns
        try:
            os.close(out_r)
            os.close(in_w)
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.setsid()
            if iso["pidns"] and iso["mountns"] and _try(libc, "unshare", CLONE_NEWNS):
                # its own /proc (sees only its namespace), in a mount namespace of its own so that the
                # launcher's /proc stays the host's
                _try(libc, "mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            os.chdir(work)
            cpu = int(limits["cpu_s"])
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            mem = int(limits["memory_mb"]) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            fsize = int(limits["file_mb"]) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            if root:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            # counted per uid: as root the uid is the sandbox's own, so the count is the sandbox's; else
            # the trainer's tasks are counted too, and the sandbox gets max_procs on top of them
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            if libc is not None:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher dies -> so does the harness
            os.umask(0o077)
            env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
            os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", prog], env)
        finally:
            os._exit(127)
    os.close(out_w)
    os.close(in_r)
    try:
        os.write(in_w, (token + "\n").encode())
    except OSError:
        pass
    os.close(in_w)
    deadline = t0 + float(limits["wall_s"])
    out, timed_out = _read_until(out_r, pid, deadline)
    os.close(out_r)
    status_code = _reap(pid, deadline)
    if status_code is None:  # still running past the wall clock
        timed_out = True
        _kill(pid)
        status_code = _reap(pid, time.monotonic() + 5.0)
    if not iso["pidns"]:  # what is left of its session: children that outlived the harness (a member keeps the id)
        _kill(pid, group_only=True)
    if root:
        _kill_uid(uid)
    return {"out": out.decode("utf-8", "replace"), "timed_out": timed_out, "wait_status": status_code,
            "wall_s": round(time.monotonic() - t0, 3), "isolation": iso}


def _read_until(fd: int, pid: int, deadline: float) -> tuple[bytes, bool]:
    """The harness's stdout until EOF (every writer gone) or the deadline; capped."""
    import select

    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill(pid)
            return buf, True
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if not ready:
            # the harness gone but a grandchild holds the pipe (no pid namespace): stop reading
            try:
                gone = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:
                gone = True
            if gone:
                return buf, False
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return buf, False
        if len(buf) < OUTPUT_CAP:
            buf += chunk[: OUTPUT_CAP - len(buf)]


def _reap(pid: int, deadline: float) -> int | None:
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done == pid:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _kill(pid: int, group_only: bool = False) -> None:
    for target in (-pid,) if group_only else (-pid, pid):  # its group, then itself (pid 1 of its namespace: all of it)
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: a child that becomes ``uid`` and sends ``kill(-1)``
    (reaches all of that uid's processes at once, so a fork bomb cannot outrun it), repeated
    until /proc shows none."""
    for _ in range(20):
        if not _pids_of(uid):
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.01)


def _tasks_of(uid: int) -> int:
    """Threads of ``uid`` (RLIMIT_NPROC counts threads)."""
    n = 0
    for pid in _pids_of(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _pids_of(uid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out


# ---------------------------------------------------------------- the caller's side


def run_code(code: str, tests: list[str], limits: Limits = Limits(), namespaces: bool = True) -> Result:
    """Run ``code`` then each of ``tests`` (assert statements) in a sandbox; never raises for what the code does.

    ``namespaces=False`` takes the fallback path (as where unshare is not permitted): tests use it."""
    if not tests:
        return Result(status="no_tests")
    # under /tmp: a directory the sandbox uid can reach (a private TMPDIR may not be)
    work = tempfile.mkdtemp(prefix="ptops-sandbox-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(work, 0o700)
    token = secrets.token_hex(16)
    cfg = {"work": work, "limits": asdict(limits), "token": token, "program": _harness(code, list(tests)),
           "python": sandbox_python(), "namespaces": namespaces}
    try:
        proc = subprocess.run(
            [os.path.realpath(sys.executable), "-I", "-S", "-B", os.path.abspath(__file__), "--launch"],
            input=json.dumps(cfg), capture_output=True, text=True, timeout=float(limits.wall_s) + 30.0,
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        report = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        report, proc = None, e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if report is None:
        err = getattr(proc, "stderr", "") or str(proc)
        return Result(status="launcher_failed", detail=str(err)[-500:])
    return _score(report, token, len(tests))


def _score(report: dict, token: str, total: int) -> Result:
    res = Result(total=total, isolation=report["isolation"], wall_s=report["wall_s"])
    lines = [ln.split() for ln in report["out"].splitlines()]
    mine = [ln for ln in lines if len(ln) == 4 and ln[0] == token]
    status = report["wait_status"]
    if report["timed_out"]:
        res.status = "timeout"
    elif status is None or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        res.status = "killed" if status is not None and os.WIFSIGNALED(status) else "error"
        res.detail = f"wait status {status}"
    elif len(mine) != 1:
        res.status = "no_result"
    else:
        passed, n = int(mine[0][1]), int(mine[0][2])
        if mine[0][3] != "-":
            res.status, res.detail = "hostile", mine[0][3]
        elif n == total and 0 <= passed <= n:
            res.passed = passed
            res.reward = passed / total
            res.status = "ok"
        else:
            res.status = "no_result"
    return res


def isolation_available() -> dict:
    """What a sandbox here would get (for the reward_source event): one harmless run."""
    return run_code("x = 1", ["assert x == 1"]).isolation


if __name__ == "__main__" and sys.argv[1:] == ["--launch"]:
    _cfg = json.loads(sys.stdin.read())
    try:
        _out = _launch(_cfg)
    except Exception as _e:  # noqa: BLE001 - one line to the caller, who scores it 0
        print(f"sandbox launcher failed: {type(_e).__name__}: {_e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(_out))
