"""The code sandbox's isolation itself (issue 49, points 1 and 2): what each completion gets
(namespaces, a fresh keyring, a cgroup made from outside and removed after), and where the kernel
refuses the namespaces, that untrusted code is not graded. The hostile completions (cross-completion
channels, host resources, limits, the guard switched off), each scoring 0 with the host clean
after them, are entries of the hostile corpus (``tests/data/hostile/``,
``tests/trl/test_hostile_corpus.py``); the tests here run some of them under other conditions.

Failed before this change (main's sandbox: no IPC namespace, the trainer's session keyring
inherited, rlimits per process only, any isolation the kernel gave): the session keyring channel
(the reader scored 1) and the weak-isolation refusal (the hook switched off, the reader scored 1
from the host's loopback).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import hostile
import pytest

import ptops.recipes.trl.sandbox as sb
from ptops.recipes.trl.sandbox import Limits, run_code, weak_isolation

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


@pytest.fixture
def answerer():
    a = hostile.Answerer(ANSWERS)
    yield a
    a.close()


def _code(name: str, port: int) -> str:
    return hostile.entry(name).render(port=port)


def test_the_honest_solution_scores_one():
    res = run_code(HONEST, TESTS, LIMITS)
    assert res.reward == 1.0 and res.status == "ok", res
    iso = res.isolation
    assert iso["ipcns"] and iso["utsns"] and iso["netns"] and iso["pidns"] and iso["mountns"], iso
    if ROOT:
        assert iso["keyrings"] == "private" and iso["cgroupns"], iso
        assert iso["cgroup"] in ("v1", "v2") and res.usage["memory_limit"] == 256 << 20, res


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
    writer = hostile.writer("session_keyring_answers").code
    reader = hostile.entry("session_keyring_answers").code
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _IN_A_SESSION, sb.__file__, writer, reader]
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
