"""One rank's part of ``ptops profile``: a torch profiler trace of N whole steps of a live run.

Why here and not in the adapters: every engine's adapter marks each step boundary
(``probe.profile.at_step``), so one capture works for TorchTitan and TRL alike and the supervisor
can ask every rank for the *same* steps (it picks the first one; :class:`Capture` starts at the
first step boundary at or after it, and says in its report which step that was).

A step here runs from one ``at_step`` to the next, so everything a rank does for a step
is inside it: the fault hooks (a ``slow`` fault's sleep), data loading, forward/backward, the
collectives, checkpoint saves and the metrics. The capture starts before the hooks of its
first step and stops before the hooks of the step after its last, so a ``hold`` placed after
the window never lands in the trace. Each step is a ``ptops/step#S`` range in the trace and
data loading a ``ptops/data`` range (adapters mark it with ``probe.profile.mark("data")``), which is
what :mod:`ptops.diagnostics.profile` reads.

The trace goes to ``RUN_DIR/profiles/<id>/rank-R.json`` (Chrome trace format; folders 0700,
file 0600, written under a temporary name and renamed, so a reader never sees half a file).
Profiling never changes what is computed: it only records. Any profiler error is reported as
``profile_failed`` and training goes on.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
STEP_RANGE = "ptops/step#"  # + the step number
DATA_RANGE = "ptops/data"
NULL = contextlib.nullcontext()  # reusable: a mark costs nothing while no capture runs


def trace_path(run_dir: Path, profile_id: str, rank: int) -> Path:
    return Path(run_dir) / "profiles" / profile_id / f"rank-{rank}.json"


def _private_dirs(path: Path, top: Path) -> None:
    """mkdir -p ``path`` with every folder below ``top`` private (two ranks may race: fine)."""
    missing = []
    p = path
    while p != top and not p.exists():
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        try:
            os.chmod(d, PRIVATE_DIR)
        except OSError:
            pass


class Capture:
    """One profile request on one rank: armed, then running, then done (reported once)."""

    def __init__(
        self,
        profile_id: str,
        start_step: int,
        steps: int,
        run_dir: Path,
        rank: int,
        report: Callable[..., None],
    ):
        self.id = profile_id
        self.start_step = int(start_step)
        self.steps = max(1, int(steps))
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.report = report  # (kind, **fields): probe.event
        self.first_step: int | None = None
        self.done = False
        self._prof = None
        self._step_range = None
        self._t0 = 0.0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def at_step(self, step: int) -> None:
        """A step boundary (before ``step``'s fault hooks): start, mark the step, or stop."""
        if self.done:
            return
        try:
            if self._prof is None:
                if step >= self.start_step:
                    self._start(step)
                return
            self._end_step_range()
            if step >= self.first_step + self.steps:
                self.finish(step - self.first_step)
            else:
                self._begin_step_range(step)
        except Exception as e:  # profiling must never stop training
            self._fail(f"{type(e).__name__}: {e}")

    def mark(self, what: str):
        """A named range inside the current step (``data``); a no-op context when not running."""
        if self._prof is None:
            return contextlib.nullcontext()
        from torch.autograd.profiler import record_function

        return record_function(f"ptops/{what}")

    def finish(self, steps_done: int, partial: bool = False) -> None:
        """Stop, write the trace, report ``profile_captured`` (``partial``: the rank is leaving
        early)."""
        if self.done or self._prof is None:
            return
        self._end_step_range()
        prof, self._prof = self._prof, None
        self.done = True
        try:
            t_end = time.monotonic()
            prof.stop()
            wall_s = t_end - self._t0
            path = trace_path(self.run_dir, self.id, self.rank)
            _private_dirs(path.parent, self.run_dir)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            t0 = time.monotonic()
            prof.export_chrome_trace(str(tmp))
            os.chmod(tmp, PRIVATE_FILE)
            os.replace(tmp, path)
            self.report(
                "profile_captured",
                id=self.id,
                first_step=self.first_step,
                steps=int(steps_done),
                path=str(path.relative_to(self.run_dir)),
                bytes=path.stat().st_size,
                wall_s=round(wall_s, 4),
                export_s=round(time.monotonic() - t0, 4),
                pause_s=round(time.monotonic() - t_end, 4),
                partial=partial,
            )
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")

    def close(self, step: int) -> None:
        """The rank is leaving: a running capture keeps the steps it has (partial), an armed one
        fails."""
        if self.done:
            return
        if self._prof is not None:
            self.finish(max(0, step - self.first_step + 1), partial=True)
        else:
            self._fail(
                f"the rank left at step {step}, before the profile's first step {self.start_step}"
            )

    # ------------------------------------------------------------ internals
    def _start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(
            activities=activities, record_shapes=False, profile_memory=False, with_stack=False
        )
        prof.start()
        self._prof, self.first_step, self._t0 = prof, int(step), time.monotonic()
        self._begin_step_range(step)

    def _begin_step_range(self, step: int) -> None:
        from torch.autograd.profiler import record_function

        rf = record_function(f"{STEP_RANGE}{int(step)}")
        rf.__enter__()
        self._step_range = rf

    def _end_step_range(self) -> None:
        rf, self._step_range = self._step_range, None
        if rf is not None:
            rf.__exit__(None, None, None)

    def _fail(self, error: str) -> None:
        prof, self._prof, self._step_range = self._prof, None, None
        self.done = True
        if prof is not None:
            with contextlib.suppress(Exception):
                prof.stop()
        self.report("profile_failed", id=self.id, error=error[:500], first_step=self.first_step)


class Profiling:
    """The probe's profiling part (``probe.profile``): the capture a ``profile`` command armed,
    advanced by the adapter at each step boundary, before the step's fault hooks."""

    def __init__(self, run_dir: Path, rank: int, report: Callable[..., None]) -> None:
        self.run_dir, self.rank, self.report = Path(run_dir), rank, report
        self.capture: Capture | None = None  # set by the channel thread

    def at_step(self, step: int) -> None:
        capture = self.capture
        if capture is not None:
            capture.at_step(int(step))
            if capture.done and self.capture is capture:
                self.capture = None

    @property
    def running(self) -> bool:
        """A capture is recording on this rank now."""
        capture = self.capture
        return capture is not None and capture.running

    def mark(self, what: str):
        """``with probe.profile.mark("data"):`` around fetching a batch: a ``ptops/data`` range in
        a trace; a no-op context when no capture runs (the usual case)."""
        capture = self.capture
        return NULL if capture is None else capture.mark(what)

    def start(self, profile_id: str, start_step: int, steps: int) -> None:
        """A ``profile`` command: arm a capture, or report why this rank cannot."""
        current = self.capture
        if current is not None and not current.done:
            self.report(
                "profile_failed",
                id=profile_id,
                error=f"this rank is busy with profile {current.id}",
            )
            return
        self.capture = Capture(profile_id, start_step, steps, self.run_dir, self.rank, self.report)

    def close(self, step: int) -> None:
        capture, self.capture = self.capture, None
        if capture is not None:
            capture.close(step)
