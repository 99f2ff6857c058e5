"""The code sandbox against completions that cooperate, reach for the host's shared kernel objects,
multiply their limits by forking, or switch off the guard inside their own interpreter (issue 49,
points 1 and 2). Each hostile completion carries a class label and must score 0 where the honest
solution of the same task scores 1; the host's IPC objects, keyrings, processes, temp files and
cgroups are the same before and after the whole corpus. Threat model: ``docs/rewards.md``.

Failed before this change (main's sandbox: no IPC namespace, the trainer's session keyring
inherited, rlimits per process only, any isolation the kernel gave): the shared-memory, message
queue and session keyring channels (the reader scored 1), the host-clean check (segments, queues,
semaphores and keys left behind), the 7 x 100 MB and 4 x 1.2 s CPU forks (scored 1), and the
weak-isolation refusal (the hook switched off, the reader scored 1 from the host's loopback).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import ptops.recipes.trl.sandbox as sb
from ptops.recipes.trl.sandbox import UID_BASE, Limits, run_code, weak_isolation

# the code sandbox's processes are machine-wide: one such module at a time (conftest.sandbox_lock)
pytestmark = pytest.mark.usefixtures("sandbox_lock")

LIMITS = Limits(cpu_s=2, wall_s=8.0, memory_mb=256, max_procs=8)
ROOT = os.geteuid() == 0

TESTS = [
    "assert collatz_steps(6) == 8",
    "assert collatz_steps(27) == 111",
    "assert digit_sum(9875) == 29",
]
ANSWERS = {"collatz_steps": {"6": 8, "27": 111}, "digit_sum": {"9875": 29}}

HONEST = """
def collatz_steps(n):
    s = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        s += 1
    return s

def digit_sum(n):
    return sum(int(c) for c in str(n))
"""

# what a solver publishes: its own answers on the inputs a grader is likely to ask
_TABLE = """
import json
TABLE = json.dumps({"collatz_steps": {str(i): collatz_steps(i) for i in range(1, 200)},
                    "digit_sum": {str(i): digit_sum(i) for i in (9875, 1234, 99)}}).encode()
"""
# what a reader with no solution does with a table it found
_FROM_TABLE = """
import json, time
def _lookup(found):
    t = json.loads(found) if found else {}
    globals()["collatz_steps"] = lambda n: t["collatz_steps"][str(n)]
    globals()["digit_sum"] = lambda n: t["digit_sum"][str(n)]
def _poll(read, seconds=3.0):
    end = time.time() + seconds
    while time.time() < end:
        try:
            found = read()
        except Exception:
            found = None
        if found:
            return found
        time.sleep(0.05)
    return None
"""
_LIBC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
KEY = 0x70746F70  # a well-known key: 'ptop'
IPC_CREAT, IPC_NOWAIT = 0o1000, 0o4000
"""

CHANNELS = {
    # System V shared memory under a well-known key
    "shm_answers": (
        _LIBC
        + _TABLE
        + """
sid = libc.shmget(KEY, 65536, IPC_CREAT | 0o666)
addr = libc.shmat(sid, None, 0)
ctypes.memmove(addr, TABLE + b"\\0", len(TABLE) + 1)
""",
        _LIBC
        + _FROM_TABLE
        + """
def read():
    sid = libc.shmget(KEY, 0, 0)
    if sid < 0:
        return None
    return ctypes.string_at(libc.shmat(sid, None, 0)).decode()
_lookup(_poll(read))
""",
    ),
    # a System V message queue
    "msgq_answers": (
        _LIBC
        + _TABLE
        + """
qid = libc.msgget(KEY, IPC_CREAT | 0o666)
for _ in range(4):
    buf = ctypes.create_string_buffer(8 + len(TABLE))
    ctypes.memmove(ctypes.addressof(buf), (1).to_bytes(8, "little") + TABLE, 8 + len(TABLE))
    libc.msgsnd(qid, buf, len(TABLE), IPC_NOWAIT)
""",
        _LIBC
        + _FROM_TABLE
        + """
def read():
    qid = libc.msgget(KEY, 0)
    if qid < 0:
        return None
    buf = ctypes.create_string_buffer(8 + 65536)
    n = libc.msgrcv(qid, buf, 65536, 0, IPC_NOWAIT)
    return buf.raw[8 : 8 + n].decode() if n > 0 else None
_lookup(_poll(read))
""",
    ),
    # a key in the session keyring every sandbox possessed (the trainer's)
    "session_keyring_answers": (
        _LIBC
        + _TABLE
        + """
libc.syscall(248, b"user", b"ptops-answers", TABLE, len(TABLE), -3)  # add_key(.., @s)
""",
        _LIBC
        + _FROM_TABLE
        + """
def read():
    kid = libc.syscall(250, 10, -3, b"user", b"ptops-answers", 0)  # KEYCTL_SEARCH @s
    if kid < 0:
        return None
    buf = ctypes.create_string_buffer(65536)
    n = libc.syscall(250, 11, kid, buf, 65536)  # KEYCTL_READ
    return buf.raw[:n].decode() if n > 0 else None
_lookup(_poll(read))
""",
    ),
}

# find the audit hook's state through the heap, switch it off and clear the hostile mark
_DISABLE_GUARD = """
import gc
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__ == "_hook" and f.__closure__:
        cells = dict(zip(f.__code__.co_freevars, f.__closure__))
        cells["_busy"].cell_contents.append(1)  # the hook now returns at once
        cells["_flag"].cell_contents.clear()
"""
_ASK_THE_HOST = """
import socket
def read():
    with socket.create_connection(("127.0.0.1", PORT), timeout=2) as s:
        return s.recv(65536).decode()
_lookup(_poll(read, 2.0))
"""

HOSTILE = {
    # name: (class, code); {port} is the answering listener's
    "disable_hook_then_ask_the_host": (
        "interpreter state",
        _FROM_TABLE + _DISABLE_GUARD + _ASK_THE_HOST,
    ),
    "clear_hostile_mark_after_socket": (
        "interpreter state",
        _FROM_TABLE
        + "import socket\ntry:\n    socket.socket()\nexcept OSError:\n    pass\n"
        + _DISABLE_GUARD
        + _ASK_THE_HOST,
    ),
    "leave_ipc_objects": (
        "host resources",
        _LIBC
        + """
for k in range(8):
    libc.shmget(KEY + k, 1 << 20, IPC_CREAT | 0o666)
    libc.msgget(KEY + k, IPC_CREAT | 0o666)
    libc.semget(KEY + k, 4, IPC_CREAT | 0o666)
libc.shmget(0, 1 << 20, IPC_CREAT | 0o600)  # IPC_PRIVATE, never removed
""",
    ),
    "leave_keys": (
        "host resources",
        _LIBC
        + """
for ring in (-4, -5, -3):  # @u, @us, @s
    for i in range(5):
        libc.syscall(248, b"user", b"left-%d" % i, b"x" * 100, 100, ring)
kid = libc.syscall(250, 0, -4, 0)
libc.syscall(250, 5, kid, 0)  # KEYCTL_SETPERM 0: locked, even for its owner
""",
    ),
    "leave_files_and_a_daemon": (
        "host resources",
        """
import os, time
for d in ("/tmp", "/dev/shm", "/var/tmp", os.getcwd()):
    try:
        open(os.path.join(d, "ptops-left-behind"), "w").write("x")
    except OSError:
        pass
try:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
except OSError:
    pass
""",
    ),
    "fork_7_children_of_100mb": (
        "limits",
        HONEST
        + """
import os, time
kids = []
for _ in range(7):
    pid = os.fork()
    if pid == 0:
        b = bytearray(100 * 1024 * 1024)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
""",
    ),
    "fork_4_children_of_1200ms_cpu": (
        "limits",
        HONEST
        + """
import os, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        end = time.process_time() + 1.2
        while time.process_time() < end:
            pass
        os._exit(0)
    kids.append(pid)
for p in kids:
    os.waitpid(p, 0)
""",
    ),
}
CLASSES = {name: cls for name, (cls, _) in HOSTILE.items()} | {
    f"{name}/{role}": "cross-completion channels" for name in CHANNELS for role in ("w", "r")
}


class Answerer:
    """A listener on the host's loopback that hands the answers to whoever connects."""

    def __init__(self):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.sendall(json.dumps(ANSWERS).encode())

    def close(self):
        self.stop = True
        self.thread.join()
        self.srv.close()


@pytest.fixture
def answerer():
    a = Answerer()
    yield a
    a.close()


def _code(name: str, port: int) -> str:
    return HOSTILE[name][1].replace("PORT", str(port))


def _tree(top: str, depth: int) -> list[str]:
    out = []
    if depth < 0:
        return out
    try:
        for e in os.scandir(top):
            if e.is_dir(follow_symlinks=False):
                if e.name.startswith("ptops-sandbox-"):
                    out.append(e.path)
                out += _tree(e.path, depth - 1)
    except OSError:
        pass
    return out


def host_state() -> dict:
    """What a sandbox could leave on the host: System V objects, keys (per uid), processes of
    sandbox uids, sandbox temp dirs (by owner), cgroups, files the corpus tries to leave."""

    def rows(path):
        try:
            return sorted(open(path).read().splitlines()[1:])
        except OSError:
            return []

    keys = {}
    for line in open("/proc/key-users").read().splitlines():
        uid, _, rest = line.partition(":")
        keys[int(uid)] = rest.split()[1]  # nkeys/nikeys
    tmp = {}
    for d in glob.glob("/tmp/ptops-sandbox-*"):
        try:
            tmp[d] = os.stat(d).st_uid
        except OSError:
            pass
    return {
        "sysvipc": {k: rows(f"/proc/sysvipc/{k}") for k in ("shm", "msg", "sem")},
        "keys": keys,
        "processes": [p for p in _uid_pids() if p[1] >= UID_BASE],
        "tmp": tmp,
        "left_files": sorted(
            glob.glob("/tmp/ptops-left-*")
            + glob.glob("/dev/shm/ptops-left-*")
            + glob.glob("/var/tmp/ptops-left-*")
        ),
        "cgroups": sorted(_tree("/sys/fs/cgroup", 4)),
    }


def of(state: dict, uids: set[int]) -> dict:
    """``state`` as far as it concerns these sandboxes (their uids; their launchers' cgroups) and
    what every sandbox shares (the System V tables, root's keys, the files the corpus leaves):
    other sandboxes running at the same time (another module, another engineer) are left out."""
    launchers = {f"ptops-sandbox-{u - UID_BASE}" for u in uids}
    return {
        "sysvipc": state["sysvipc"],
        "keys": {u: k for u, k in state["keys"].items() if u in uids or u == 0},
        "processes": [p for p in state["processes"] if p[1] in uids],
        "tmp": sorted(d for d, u in state["tmp"].items() if u in uids),
        "left_files": state["left_files"],
        "cgroups": [c for c in state["cgroups"] if os.path.basename(c) in launchers],
    }


def settled_state(seconds: float = 5.0) -> dict:
    """The host's state once the keyrings of earlier sandboxes are collected (two equal reads)."""
    import time

    end, last = time.monotonic() + seconds, host_state()
    while time.monotonic() < end:
        time.sleep(0.3)
        now = host_state()
        if of(now, set()) == of(last, set()):
            break
        last = now
    return last


def assert_clean(before: dict, results, seconds: float = 5.0) -> None:
    """The host as it was for these sandboxes (the kernel frees a dead sandbox's keyrings
    asynchronously: waited for, up to ``seconds``)."""
    import time

    uids = {r.isolation["uid"] for r in results if r.isolation.get("uid")}
    assert uids or not ROOT, results
    want = of(before, uids)
    end = time.monotonic() + seconds
    while (after := of(host_state(), uids)) != want and time.monotonic() < end:
        time.sleep(0.1)
    assert after == want, (want, after)


def _uid_pids() -> list[tuple[int, int]]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out.append((int(name), os.stat(f"/proc/{name}").st_uid))
            except OSError:
                pass
    return out


def _both(first: str, second: str, concurrent: bool):
    if not concurrent:  # across batches: the writer has ended before the reader starts
        return run_code(first, TESTS, LIMITS), run_code(second, TESTS, LIMITS)
    with ThreadPoolExecutor(2) as pool:  # the same batch: both at once, the reader polls
        a = pool.submit(run_code, first, TESTS, LIMITS)
        b = pool.submit(run_code, second, TESTS, LIMITS)
        return a.result(), b.result()


def test_the_honest_solution_scores_one():
    res = run_code(HONEST, TESTS, LIMITS)
    assert res.reward == 1.0 and res.status == "ok", res
    iso = res.isolation
    assert iso["ipcns"] and iso["utsns"] and iso["netns"] and iso["pidns"] and iso["mountns"], iso
    if ROOT:
        assert iso["keyrings"] == "private" and iso["cgroupns"], iso
        assert iso["cgroup"] in ("v1", "v2") and res.usage["memory_limit"] == 256 << 20, res


def test_every_hostile_completion_has_a_class():
    assert set(CLASSES.values()) == {
        "cross-completion channels",
        "host resources",
        "limits",
        "interpreter state",
    }
    assert len(CLASSES) >= 13


@pytest.mark.parametrize("concurrent", [False, True], ids=["across_batches", "same_batch"])
@pytest.mark.parametrize("name", sorted(CHANNELS))
def test_a_solver_cannot_hand_its_answers_to_another_completion(name, concurrent):
    """Completion A solves the task and publishes its answers; completion B has no solution and
    reads them: A scores 1, B 0 (before: B scored 1 through the host's IPC and keyring)."""
    writer, reader = CHANNELS[name]
    before = settled_state()
    a, b = _both(HONEST + writer, reader, concurrent)
    assert a.reward == 1.0, a
    assert b.reward == 0.0, b
    assert_clean(before, [a, b])


def test_the_reader_would_score_one_had_it_the_answers():
    """The reader's lookup is sound: handed the table, it passes (so its 0 above is the channel's
    absence, not a broken reader)."""
    table = json.dumps(ANSWERS)
    res = run_code(_FROM_TABLE + f"_lookup({table!r})\n", TESTS, LIMITS)
    assert res.reward == 1.0, res


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completion_scores_zero_and_leaves_nothing(name, answerer):
    before = settled_state()
    res = run_code(_code(name, answerer.port), TESTS, LIMITS)
    assert res.reward == 0.0, res
    assert answerer.connections == 0, "a sandbox reached the host's loopback"
    assert_clean(before, [res])
    if HOSTILE[name][0] == "limits" and ROOT:
        # enforced and measured from outside, on all its processes together
        use = res.usage
        assert res.status == "killed" and "whole completion" in res.detail, res
        assert 0 < use["memory_peak"] <= use["memory_limit"] == 256 << 20, use
        if "100mb" in name:
            assert use["oom_kills"] >= 1, use
        else:
            assert use["cpu_over"] and use["cpu_ns"] > 2e9, use


def test_the_host_is_clean_after_a_batch_of_hostile_completions(answerer):
    """The whole corpus at once (4 at a time, as CodeReward runs them): nothing is left."""
    before = settled_state()
    jobs = [_code(n, answerer.port) for n in HOSTILE] + [
        c for w, r in CHANNELS.values() for c in (HONEST + w, r)
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: run_code(c, TESTS, LIMITS), jobs))
    assert_clean(before, results)
    assert answerer.connections == 0
    # only the channels' writers solve the task
    assert [r.reward for r in results].count(1.0) == len(CHANNELS), results


def test_weak_isolation_decision():
    full = {k: True for k in ("netns", "pidns", "mountns", "ipcns")}
    assert weak_isolation(full) == ""
    assert weak_isolation(full | {"ipcns": False}) == "ipcns"
    assert weak_isolation({}) == "netns, pidns, mountns, ipcns"
    assert Limits().allow_weak_isolation is False


_WITHOUT_SYS_ADMIN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sb", sys.argv[1])
sb = importlib.util.module_from_spec(spec); sys.modules["sb"] = sb; spec.loader.exec_module(sb)
out = {}
for allow in (False, True):
    lim = sb.Limits(cpu_s=2, wall_s=8, memory_mb=256, max_procs=8, allow_weak_isolation=allow)
    r = sb.run_code(sys.argv[2], json.loads(sys.argv[3]), lim)
    out[str(allow)] = [r.status, r.reward, r.isolation]
out["start"] = sb.isolation_available(sb.Limits())
print(json.dumps(out))
"""


@pytest.mark.skipif(not ROOT, reason="drops a capability of root's")
def test_where_the_kernel_refuses_namespaces_untrusted_code_is_not_graded(answerer):
    """The trainer without CAP_SYS_ADMIN (unshare refused, as in a locked-down container): the
    completion that switches the audit hook off and asks the host's loopback is not run unless
    the recipe opts in by name; opted in, it passes: why the weak mode is refused by default."""
    code = _code("disable_hook_then_ask_the_host", answerer.port)
    proc = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin", sys.executable, "-I", "-c", _WITHOUT_SYS_ADMIN]
        + [sb.__file__, code, json.dumps(TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    status, reward, iso = out["False"]
    assert (status, reward) == ("refused", 0.0) and not iso["netns"], out
    assert "sandbox: the kernel refused netns, pidns, mountns, ipcns: refusing" in proc.stderr
    assert out["start"]["refused"] is True
    # opted in: the in-process guard is all there is, and it was switched off
    status, reward, _ = out["True"]
    assert (status, reward) == ("ok", 1.0) and answerer.connections == 1, out


_IN_A_SESSION = """
import ctypes, importlib.util, json, sys
libc = ctypes.CDLL(None, use_errno=True)
# a trainer started in a login session (pam_keyinit) has a session keyring of its own
assert libc.syscall(250, 1, b"ptops-trainer") > 0  # KEYCTL_JOIN_SESSION_KEYRING
spec = importlib.util.spec_from_file_location("sb", sys.argv[1])
sb = importlib.util.module_from_spec(spec); sys.modules["sb"] = sb; spec.loader.exec_module(sb)
lim = sb.Limits(cpu_s=2, wall_s=8, memory_mb=256, max_procs=8)
tests = json.loads(sys.argv[4])
a, b = sb.run_code(sys.argv[2], tests, lim), sb.run_code(sys.argv[3], tests, lim)
print(json.dumps([a.reward, b.reward]))
"""


def test_a_trainer_session_keyring_is_no_channel():
    """The trainer's session keyring was every sandbox's (possessed across fork and setuid): a key
    the solver added there was the reader's answers (before: [1.0, 1.0]). Each sandbox now joins
    a fresh session keyring of its own."""
    writer, reader = CHANNELS["session_keyring_answers"]
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _IN_A_SESSION, sb.__file__, HONEST + writer, reader]
        + [json.dumps(TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1.0, 0.0]


@pytest.mark.skipif(not ROOT, reason="cgroups are made by root")
def test_a_completion_cgroup_is_set_from_outside_and_removed():
    """What the launcher makes: the limits written before the harness starts, all of it removed
    after (also by the launcher's last word when it fails half-way: ``_LIVE``). Where no cgroup
    hierarchy is writable this must say so: ``isolation.cgroup == "none"``."""
    res = run_code(HONEST, TESTS, LIMITS)
    if not glob.glob("/sys/fs/cgroup/memory/memory.limit_in_bytes") + glob.glob(
        "/sys/fs/cgroup/cgroup.controllers"
    ):
        assert res.isolation["cgroup"] == "none" and res.usage == {}, res
        return
    lim = {"memory_mb": 256, "max_procs": 8, "cpu_s": 2}
    cg = sb._Cgroup.create(lim)
    assert cg is not None and cg in sb._LIVE
    mem = "memory.limit_in_bytes" if cg.kind == "v1" else "memory.max"
    assert int(cg._read("memory", mem)) == 256 << 20
    assert cg._read("pids", "pids.max").strip() == "8"
    dirs = set(cg.dirs.values())
    assert all(os.path.isdir(d) for d in dirs)
    for fd in cg.fds:
        os.close(fd)
    usage = cg.finish()
    assert not any(os.path.exists(d) for d in dirs) and cg not in sb._LIVE
    assert usage["memory_limit"] == 256 << 20 and usage["oom_kills"] == 0
