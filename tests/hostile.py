"""The hostile corpus (issue 49 point 6) and what the tests that run it share: its entries read from
``tests/data/hostile/`` and the host's state before and after a batch of sandboxes.

Code entries are completions, one file each, under a folder per class; a file's first lines say
what it tries, the task it pretends to solve and why it must fail (``# expect:`` the sandbox
statuses it may end with; ``@PORT@``, ``@PROBES@`` and ``@TEST_FILE@`` are filled in when it runs).
A ``NAME.writer.py`` next to a cross-completion reader is the solver that publishes its answers:
an honest solution (it scores 1), not an entry. Math and judge entries are TOML tables with a
comment each (``verifier_cost.toml``, ``judge_injection.toml``).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "hostile"
# the folder of each class of code entries, and the class's name in docs/rewards.md
CODE_CLASSES = {
    "result_value": "result value",
    "result_channel": "result channel",
    "interpreter_state": "interpreter state",
    "cross_completion": "cross-completion channels",
    "host_resources": "host resources",
    "limits": "limits",
}


@dataclass(frozen=True)
class CodeEntry:
    cls: str
    name: str
    tries: str
    task: str
    expect: frozenset
    code: str

    def render(self, **subs) -> str:
        out = self.code
        for key, value in subs.items():
            out = out.replace(f"@{key.upper()}@", str(value))
        return out


def _read(path: Path) -> CodeEntry:
    text = path.read_text()
    head = dict(line[2:].split(": ", 1) for line in text.splitlines()[:3] if line.startswith("# "))
    return CodeEntry(
        cls=CODE_CLASSES[path.parent.name],
        name=path.name.removesuffix(".py"),
        tries=head.get("tries", "").strip(),
        task=head.get("task", "").strip(),
        expect=frozenset(x for x in head.get("expect", "").strip().split("|") if x),
        code=text,
    )


def code_entries() -> list[CodeEntry]:
    """Every hostile code completion (writers are not entries), sorted by class and name."""
    paths = sorted(p for d in CODE_CLASSES for p in (CORPUS / d).glob("*.py"))
    return [_read(p) for p in paths if not p.name.endswith(".writer.py")]


def writer(name: str) -> CodeEntry:
    """The solver that publishes its answers for the cross-completion reader ``name``."""
    return _read(CORPUS / "cross_completion" / f"{name}.writer.py")


def entry(name: str) -> CodeEntry:
    (found,) = [e for e in code_entries() if e.name == name]
    return found


def math_entries() -> list[dict]:
    """``{name, answer, expected}``: ``wrap``/``times`` expanded."""
    out = []
    for e in tomllib.loads((CORPUS / "verifier_cost.toml").read_text())["math"]:
        answer = e["answer"]
        if "wrap" in e:
            answer = e["wrap"][0] * e["times"] + answer + e["wrap"][1] * e["times"]
        out.append({"name": e["name"], "answer": answer, "expected": e["expected"]})
    return out


def judge_entries() -> list[dict]:
    """``{name, words}``: what is appended to an answer."""
    return tomllib.loads((CORPUS / "judge_injection.toml").read_text())["judge"]


# ------------------------------------------------------------------ the host, before and after

UID_BASE = 200_000  # recipes/trl/sandbox.py's (asserted equal by the tests that import both)


class Answerer:
    """A listener on the host's loopback that hands ``answers`` to whoever connects."""

    def __init__(self, answers: dict):
        self.payload = json.dumps(answers).encode()
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
                conn.sendall(self.payload)

    def close(self):
        self.stop = True
        self.thread.join()
        self.srv.close()


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


def _uid_pids() -> list[tuple[int, int]]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out.append((int(name), os.stat(f"/proc/{name}").st_uid))
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
    left = ("ptops-left-*", "ptops-answers*", "ptops-fill-*")
    return {
        "sysvipc": {k: rows(f"/proc/sysvipc/{k}") for k in ("shm", "msg", "sem")},
        "keys": keys,
        "processes": [p for p in _uid_pids() if p[1] >= UID_BASE],
        "tmp": tmp,
        "left_files": sorted(
            f
            for d in ("/tmp", "/dev/shm", "/var/tmp")
            for pat in left
            for f in glob.glob(f"{d}/{pat}")
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
    end, last = time.monotonic() + seconds, host_state()
    while time.monotonic() < end:
        time.sleep(0.3)
        now = host_state()
        if of(now, set()) == of(last, set()):
            break
        last = now
    return last


def assert_clean(before: dict, results, root: bool, seconds: float = 5.0) -> None:
    """The host as it was for these sandboxes (the kernel frees a dead sandbox's keyrings
    asynchronously: waited for, up to ``seconds``)."""
    uids = {r.isolation["uid"] for r in results if r.isolation.get("uid")}
    assert uids or not root, results
    want = of(before, uids)
    end = time.monotonic() + seconds
    while (after := of(host_state(), uids)) != want and time.monotonic() < end:
        time.sleep(0.1)
    assert after == want, (want, after)
