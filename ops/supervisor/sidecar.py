"""Sidecar processes of a run (e.g. the vLLM server of a GRPO run): started before the ranks,
health-checked, restarted when they die, their deaths recorded incidents, never orphans.

An engine declares its sidecars as plain dicts (``Engine.sidecars``: ``name``, ``argv``,
``env``, ``health_url``, ``health_timeout_s``, ``max_restarts``); :func:`run_sidecars` keeps
them for the whole launch (one server across the run's attempts, not one per attempt).

No orphans, in layers (as for torchrun in ``procs.py``):

1. each sidecar runs under a *guard* (``python -m ptops.ops.supervisor.sidecar -- ARGV``) with
   ``PR_SET_PDEATHSIG=SIGTERM``: if the owner dies, even by SIGKILL, the kernel signals the
   guard, which kills the sidecar's whole process group (a server's workers included) and exits;
2. :meth:`Sidecar.stop` SIGTERMs the guard, waits, then SIGKILLs the group;
3. every sidecar carries ``PTOPS_SIDECAR_OF=<run dir>`` in its environment, and a new start
   kills whatever still carries it (a leftover of a dead owner). Not ``PTOPS_RUN_DIR``: the
   supervisor's sweep between attempts must leave the run's server alive.

Events: ``sidecar_started {name, pid, restarts}``, ``sidecar_died {name, exit_code, reason,
restarts, gave_up}`` (an incident), ``sidecar_restarted {name, pid, restarts}``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ptops.ops.supervisor.procs import PR_SET_PDEATHSIG, _prctl, alive, killpg, signal_all

MARK = "PTOPS_SIDECAR_OF"


@dataclass
class SidecarSpec:
    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)
    health_timeout_s: float = 600.0
    max_restarts: int = 3
    interval_s: float = 1.0  # between liveness/health polls
    unhealthy_after: int = (
        3  # consecutive failed health checks of a live sidecar before it is restarted
    )
    grace_s: float = 10.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SidecarSpec":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a local health endpoint
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _marked(run_dir: Path) -> list[int]:
    want = f"{MARK}={Path(run_dir).resolve()}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                pass
    return [p for p in out if alive(p)]


def sidecar_pids(run_dir: Path) -> list[int]:
    """The live processes of ``run_dir``'s sidecars (a server and the workers it started)."""
    return _marked(run_dir)


def kill_leftovers(run_dir: Path, wait_s: float = 5.0) -> list[int]:
    """Processes of ``run_dir``'s sidecars still alive (a worker its server left, or sidecars that
    outlived their owner): SIGKILLed, waited for (a signalled process is not gone yet), their pids
    returned."""
    pids = _marked(run_dir)
    signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


class Sidecar:
    """One sidecar: :meth:`start` (blocks until healthy), a watcher thread, :meth:`stop`."""

    def __init__(
        self,
        spec: SidecarSpec,
        run_dir: Path,
        emit: Callable[..., Any],
        log_dir: Path | None = None,
    ):
        self.spec, self.run_dir, self.emit = spec, Path(run_dir), emit
        self.log = (log_dir or self.run_dir / "logs" / "sidecars") / f"{spec.name}.log"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.gave_up = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- process
    def _spawn(self) -> subprocess.Popen:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env, MARK: str(self.run_dir.resolve())}
        env.pop("PTOPS_RUN_DIR", None)  # not a rank: the attempts' sweep must not take it
        with open(self.log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-P", "-m", "ptops.ops.supervisor.sidecar", "--", *self.spec.argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_healthy(self, proc: subprocess.Popen) -> str | None:
        """None when healthy; else why not (it exited, or the timeout passed)."""
        deadline = time.monotonic() + self.spec.health_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if proc.poll() is not None:
                return f"exited with {proc.returncode} before answering {self.spec.health_url}"
            if healthy(self.spec.health_url):
                return None
            time.sleep(min(0.2, self.spec.interval_s))
        return f"no answer from {self.spec.health_url} within {self.spec.health_timeout_s:.0f} s"

    def _launch(self) -> str | None:
        proc = self._spawn()
        with self._lock:
            self.proc = proc
        why = self._wait_healthy(proc)
        if why is None:
            self.emit(
                "sidecar_started",
                name=self.spec.name,
                pid=proc.pid,
                restarts=self.restarts,
                argv=self.spec.argv,
            )
        return why

    def start(self) -> None:
        """Start and wait until healthy; raises RuntimeError if it never is. Then watch it."""
        left = kill_leftovers(self.run_dir)
        if left:
            self.emit("orphans_killed", pids=left)
        why = self._launch()
        if why is not None:
            self._kill()
            kill_leftovers(self.run_dir)  # its workers too, before the caller hears that it failed
            self.emit(
                "sidecar_died",
                name=self.spec.name,
                exit_code=self._code(),
                reason=why,
                restarts=0,
                gave_up=True,
            )
            raise RuntimeError(f"sidecar {self.spec.name}: {why} (log: {self.log})")
        self._thread = threading.Thread(
            target=self._watch, name=f"sidecar-{self.spec.name}", daemon=True
        )
        self._thread.start()

    def _code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def _kill(self) -> None:
        """The guard and its sidecar's group: SIGTERM (the guard passes it on), then SIGKILL."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=self.spec.grace_s + 5)
        except subprocess.TimeoutExpired:
            killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    # -- watch
    def _watch(self) -> None:
        fails = 0
        while not self._stop.wait(self.spec.interval_s):
            proc = self.proc
            code = proc.poll() if proc is not None else None
            reason = None
            if code is not None:
                reason = f"exited with {code}"
            elif healthy(self.spec.health_url):
                fails = 0
            else:
                fails += 1
                if fails >= self.spec.unhealthy_after:
                    reason = f"{fails} failed health checks of {self.spec.health_url}"
            if reason is None or self._stop.is_set():
                continue
            fails = 0
            self._kill()
            give_up = self.restarts >= self.spec.max_restarts
            self.emit(
                "sidecar_died",
                name=self.spec.name,
                exit_code=self._code(),
                reason=reason,
                restarts=self.restarts,
                gave_up=give_up,
            )
            if give_up:
                self.gave_up = True
                return
            while not self._stop.is_set():
                self.restarts += 1
                why = self._launch()
                if why is None:
                    self.emit(
                        "sidecar_restarted",
                        name=self.spec.name,
                        pid=self.proc.pid,
                        restarts=self.restarts,
                    )
                    break
                self._kill()
                give_up = self.restarts >= self.spec.max_restarts
                self.emit(
                    "sidecar_died",
                    name=self.spec.name,
                    exit_code=self._code(),
                    reason=why,
                    restarts=self.restarts,
                    gave_up=give_up,
                )
                if give_up:
                    self.gave_up = True
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.spec.health_timeout_s + self.spec.grace_s + 10)
        self._kill()
        kill_leftovers(self.run_dir)


@contextlib.contextmanager
def run_sidecars(
    specs: list[dict[str, Any]], run_dir: Path, emit: Callable[..., Any]
) -> Iterator[list[Sidecar]]:
    """Start every sidecar (healthy) before the body, stop them all after it, whatever happens."""
    started: list[Sidecar] = []
    try:
        for d in specs:
            sc = Sidecar(SidecarSpec.from_dict(d), run_dir, emit)
            sc.start()
            started.append(sc)
        yield started
    finally:
        for sc in reversed(started):
            sc.stop()


# ---------------------------------------------------------------- the guard (a process of its own)


def _guard(argv: list[str]) -> int:
    """Run ``argv`` in its own process group; take the group down with us (our parent's death
    reaches us as SIGTERM through PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    child = subprocess.Popen(argv, start_new_session=True)
    done = threading.Event()

    def down(signum, _frame):
        if done.is_set():
            return
        done.set()
        killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + float(os.environ.get("PTOPS_SIDECAR_GRACE_S", "10"))
        while (
            alive(child.pid) and time.monotonic() < deadline
        ):  # not child.wait(): main may hold its lock
            time.sleep(0.05)
        killpg(child.pid, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, down)
    signal.signal(signal.SIGINT, down)
    if os.getppid() != parent:  # the owner died before the death signal was armed
        down(signal.SIGTERM, None)
    code = child.wait()
    killpg(child.pid, signal.SIGKILL)  # workers the sidecar left behind
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m ptops.ops.supervisor.sidecar -- COMMAND [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(_guard(args))
