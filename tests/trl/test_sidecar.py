"""Sidecar processes (the vLLM server of a GRPO run) on CPU, with a fake server: a tiny Python HTTP
server that answers ``/health`` and keeps a worker child in its process group, as vLLM does.

Started and healthy, a death recorded and restarted, an unhealthy server restarted, restarts spent,
never healthy, stopped with its workers, and no orphan when the owner is SIGKILLed. Waits are for
observed conditions (events, pids gone), bounded generously; nothing asserts a duration."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptops.ops.runrecord.events import INCIDENT_KINDS, EventKind, missing_fields
from ptops.ops.runrecord.rundir import RunDir, read_jsonl
from ptops.ops.supervisor.procs import alive
from ptops.ops.supervisor.sidecar import Sidecar, SidecarSpec, healthy, run_sidecars

FAKE = textwrap.dedent("""
    import http.server, os, subprocess, sys
    port, state = int(sys.argv[1]), sys.argv[2]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # same process group
    with open(os.path.join(state, "pids"), "a") as f:
        f.write(f"{os.getpid()} {worker.pid}\\n")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            sick = os.path.exists(os.path.join(state, "sick"))
            self.send_response(500 if sick or self.path != "/health" else 200)
            self.end_headers()
        def log_message(self, *a):
            pass
    if os.path.exists(os.path.join(state, "never")):
        import time; time.sleep(600)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")  # noqa: E501


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(cond, what: str, limit: float = 60.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not observed within {limit:.0f} s: {what}")


class Fake:
    def __init__(self, tmp: Path, **spec):
        self.state = tmp / "state"
        self.state.mkdir()
        (tmp / "fake_server.py").write_text(FAKE)
        self.port = _port()
        self.run = RunDir(tmp / "run")
        self.run.path.mkdir()
        self.spec = SidecarSpec(
            name="vllm",
            argv=[sys.executable, str(tmp / "fake_server.py"), str(self.port), str(self.state)],
            health_url=f"http://127.0.0.1:{self.port}/health",
            interval_s=0.2,
            **{"health_timeout_s": 30.0, "grace_s": 2.0, **spec},
        )

    def pids(self) -> list[tuple[int, int]]:
        f = self.state / "pids"
        return (
            [tuple(map(int, ln.split())) for ln in f.read_text().splitlines()] if f.exists() else []
        )

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in read_jsonl(self.run.events) if kind is None or e["kind"] == kind]


def test_start_death_restart_and_stop(tmp_path):
    fake = Fake(tmp_path, max_restarts=2)
    sc = Sidecar(fake.spec, fake.run.path, fake.run.event)
    sc.start()
    try:
        assert healthy(fake.spec.health_url)
        ((server, worker),) = fake.pids()
        (started,) = fake.events("sidecar_started")
        assert (
            started["pid"] == sc.proc.pid
            and started["restarts"] == 0
            and missing_fields(started) == []
        )
        # the server dies: recorded as an incident, restarted, healthy again
        os.kill(server, signal.SIGKILL)
        _until(lambda: fake.events("sidecar_restarted"), "sidecar_restarted")
        (died,) = fake.events("sidecar_died")
        assert died["name"] == "vllm" and died["gave_up"] is False and died["restarts"] == 0
        assert "exited" in died["reason"] and missing_fields(died) == []
        assert EventKind.SIDECAR_DIED in INCIDENT_KINDS
        assert healthy(fake.spec.health_url) and len(fake.pids()) == 2
        _until(lambda: not alive(worker), "the dead server's worker killed with its group")
        # alive but unhealthy: restarted too
        (fake.state / "sick").touch()
        _until(lambda: len(fake.events("sidecar_died")) == 2, "second sidecar_died")
        (fake.state / "sick").unlink()
        _until(lambda: len(fake.events("sidecar_restarted")) == 2, "second restart")
        assert "health checks" in fake.events("sidecar_died")[1]["reason"]
    finally:
        sc.stop()
    for server, worker in fake.pids():
        assert not alive(server) and not alive(worker), (server, worker)
    assert not healthy(fake.spec.health_url)


def test_restarts_spent_gives_up(tmp_path):
    fake = Fake(tmp_path, max_restarts=1)
    with run_sidecars([vars(fake.spec)], fake.run.path, fake.run.event) as (sc,):
        os.kill(fake.pids()[0][0], signal.SIGKILL)
        _until(lambda: fake.events("sidecar_restarted"), "restart")
        os.kill(fake.pids()[1][0], signal.SIGKILL)
        _until(lambda: sc.gave_up, "gave up")
        died = fake.events("sidecar_died")
        assert [d["gave_up"] for d in died] == [False, True]
        assert len(fake.pids()) == 2  # no third start
    for server, worker in fake.pids():
        assert not alive(server) and not alive(worker)


def test_never_healthy_fails_the_start_cleanly(tmp_path):
    fake = Fake(tmp_path, health_timeout_s=2.0)
    (fake.state / "never").touch()
    with pytest.raises(
        RuntimeError,
        match=r"sidecar vllm: no answer from http://127\.0\.0\.1:\d+/health within 2 s",
    ):
        with run_sidecars([vars(fake.spec)], fake.run.path, fake.run.event):
            pytest.fail("the body must not run")
    (died,) = fake.events("sidecar_died")
    assert died["gave_up"] is True and not fake.events("sidecar_started")
    for server, worker in fake.pids():
        assert not alive(server) and not alive(worker)


OWNER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.supervisor.sidecar import Sidecar, SidecarSpec
    spec = SidecarSpec(**json.loads(sys.argv[1]))
    run = RunDir(Path(sys.argv[2]))
    sc = Sidecar(spec, run.path, run.event)
    sc.start()
    print("READY", sc.proc.pid, flush=True)
    time.sleep(600)
""")


def test_no_orphan_when_the_owner_is_killed(tmp_path):
    """The owner (a supervisor) is SIGKILLed: the kernel tells the guard, which takes the server and
    its worker down; a later start would also sweep anything still marked with the run."""
    fake = Fake(tmp_path)
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen(
        [sys.executable, str(script), json.dumps(vars(fake.spec)), str(fake.run.path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = owner.stdout.readline()
        assert line.startswith("READY"), line
        guard = int(line.split()[1])
        ((server, worker),) = fake.pids()
        assert alive(guard) and alive(server) and alive(worker)
        owner.kill()
        owner.wait()
        _until(
            lambda: not any(alive(p) for p in (guard, server, worker)),
            "guard, server and worker gone",
        )
    finally:
        if owner.poll() is None:
            owner.kill()
    assert not healthy(fake.spec.health_url)


def test_launch_side_specs_come_from_the_engine():
    """The TRL engine's hook: no server without a GPU (the ranks fall back), none for other
    trainers."""
    from ptops.recipes.engines import sidecar_specs
    from ptops.recipes.schema import load

    assert sidecar_specs(load("trl-grpo-tiny")[0]) == []
    assert (
        sidecar_specs(load("trl-grpo-tiny", ['trl.vllm.mode="server"'])[0]) == []
    )  # this CPU machine
    assert sidecar_specs(load("titan-tiny")[0]) == []


def test_launch_keeps_sidecars_for_the_whole_launch(tmp_path, monkeypatch):
    """``ptops launch``'s path (ops/cli/launch.py): the engine's sidecars are healthy while the
    attempts run and gone after; one that never answers fails the launch with a ``failed`` event and
    exit
    1."""
    import ptops.recipes.engines as engines
    from ptops.ops.cli.launch import _with_sidecars
    from ptops.recipes.schema import load

    fake = Fake(tmp_path)
    monkeypatch.setattr(engines, "sidecar_specs", lambda rec: [vars(fake.spec)])
    rec, _ = load("trl-grpo-tiny")
    seen = {}

    def body():
        seen["healthy"] = healthy(fake.spec.health_url)
        seen["pids"] = fake.pids()
        return 0

    fd = os.open(tmp_path / "lockfile", os.O_CREAT | os.O_RDWR)
    assert _with_sidecars(rec, fake.run, fd, body) == 0
    assert seen["healthy"] is True and len(seen["pids"]) == 1
    for pid in seen["pids"][0]:
        assert not alive(pid)
    (fake.state / "never").touch()
    fake.spec.health_timeout_s = 1.0
    assert (
        _with_sidecars(rec, fake.run, fd, lambda: pytest.fail("the attempts must not start")) == 1
    )
    (failed,) = fake.events("failed")
    assert failed["reason"].startswith("sidecar vllm: no answer") and missing_fields(failed) == []
    for server, worker in fake.pids():
        assert not alive(server) and not alive(worker)
