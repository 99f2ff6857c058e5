"""Rank-side fault injectors, driven by the rank probe's hooks.

The probe owns one :class:`Injector`; the engine adapter never sees it. Hooks:

- ``before_step(step)`` (start of an optimizer step): crash, hang, slow, oom, preempt
- ``should_poison(step)``: nan
- ``on_checkpoint(step)`` (``probe.phase("checkpoint", step)``): enospc
- ``after_checkpoint(step)`` (first ``probe.phase("step", step)`` after it): corrupt-ckpt

Every fault fires at most once per process, and ``emit(fault, step)`` is called
*before* it takes effect, so ``fault_injected`` reaches the run directory even
when the rank dies of it. Faults given at launch fire exactly at their step;
faults injected into a live run (``ptops inject``) fire at their step or, when
that step has already passed, at the next opportunity.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from ptops.faultinject.spec import Fault

BEFORE_STEP = ("crash", "hang", "slow", "oom", "preempt")


class Injector:
    def __init__(
        self,
        faults: list[Fault],
        rank: int,
        attempt: int,
        emit: Callable[[Fault, int], None],
        run_dir: Path | None = None,
        on_hang_stop: Callable[[], None] | None = None,
    ):
        self.rank = rank
        self.attempt = attempt
        self.emit = emit
        self.run_dir = run_dir
        self.on_hang_stop = on_hang_stop
        self._lock = threading.Lock()
        self._pending: list[tuple[Fault, bool]] = [(f, False) for f in faults if self._mine(f)]
        self._slow_left: dict[int, tuple[float, int]] = {}
        self._ckpt_steps: set[int] = set()

    def _mine(self, f: Fault) -> bool:
        if f.kind in ("corrupt-ckpt", "preempt") and f.rank is None:
            return self.rank == 0 and (f.attempt == 0 or f.attempt == self.attempt)
        return f.applies(self.rank, self.attempt)

    def add(self, fault: Fault) -> bool:
        """A fault injected into the live run; returns whether it applies to this rank."""
        if not (fault.rank is None or fault.rank == self.rank):
            return False
        if fault.kind in ("corrupt-ckpt", "preempt") and fault.rank is None and self.rank != 0:
            return False
        with self._lock:
            self._pending.append((fault, True))
        return True

    @property
    def pending(self) -> list[Fault]:
        return [f for f, _ in self._pending]

    def _take(self, kinds: tuple[str, ...], step: int) -> list[Fault]:
        fired = []
        with self._lock:
            keep = []
            for f, live in self._pending:
                if f.kind in kinds and (step == f.step or (live and step >= f.step)):
                    fired.append(f)
                else:
                    keep.append((f, live))
            self._pending = keep
        return fired

    # ------------------------------------------------------------ hooks
    def before_step(self, step: int) -> None:
        for key in list(self._slow_left):
            seconds, left = self._slow_left[key]
            time.sleep(seconds)
            if left <= 1:
                del self._slow_left[key]
            else:
                self._slow_left[key] = (seconds, left - 1)
        for f in self._take(BEFORE_STEP, step):
            self.emit(f, step)
            getattr(self, "_" + f.kind)(f, step)

    def should_poison(self, step: int) -> bool:
        fired = self._take(("nan",), step)
        for f in fired:
            self.emit(f, step)
        return bool(fired)

    def on_checkpoint(self, step: int) -> None:
        self._ckpt_steps.add(step)
        for f in self._take(("enospc",), step):
            self.emit(f, step)
            raise OSError(errno.ENOSPC, f"No space left on device (injected fault {f})")

    def after_checkpoint(self, step: int) -> None:
        if step not in self._ckpt_steps:
            return
        self._ckpt_steps.discard(step)
        for f in self._take(("corrupt-ckpt",), step):
            self.emit(f, step)
            self._corrupt(f, step)

    # ------------------------------------------------------------ effects
    def _crash(self, f: Fault, step: int) -> None:
        time.sleep(0.05)  # let the fault_injected record leave the socket buffer
        if "code" in f.params:
            os._exit(int(f.params["code"]))
        sig = getattr(signal, f.params.get("signal", "SIGKILL"))
        os.kill(os.getpid(), sig)
        time.sleep(5)
        os._exit(1)

    def _hang(self, f: Fault, step: int) -> None:
        seconds = f.params.get("seconds")
        if f.params.get("mode", "sleep") == "stop":
            if self.on_hang_stop:
                self.on_hang_stop()
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        deadline = None if seconds is None else time.monotonic() + float(seconds)
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic())))

    def _slow(self, f: Fault, step: int) -> None:
        seconds = float(f.params.get("seconds", 1.0))
        steps = int(f.params.get("steps", 1))
        time.sleep(seconds)
        if steps > 1:
            self._slow_left[id(f)] = (seconds, steps - 1)

    def _oom(self, f: Fault, step: int) -> None:
        msg = f"CUDA out of memory. Tried to allocate 20.00 GiB (injected fault {f})"
        try:
            import torch

            raise torch.OutOfMemoryError(msg)
        except (ImportError, AttributeError):
            raise MemoryError(msg) from None

    def _preempt(self, f: Fault, step: int) -> None:
        target = int(os.environ.get("PTOPS_SUPERVISOR_PID") or 0) or os.getppid()
        try:
            os.kill(target, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _corrupt(self, f: Fault, step: int) -> None:
        if self.run_dir is None:
            return
        root = self.run_dir / "checkpoints"
        for name in (f"step-{step}", f"checkpoint-{step}"):
            d = root / name
            if d.is_dir():
                files = sorted((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
                if files:
                    victim = files[-1]
                    size = victim.stat().st_size
                    with open(victim, "r+b") as fh:
                        fh.truncate(size // 2)
                return
