"""What an unchanged script shows ptops without one line of ptops in it.

A script that never imports ``ptops.rank`` still has to be judged fairly: a healthy script killed as
hung is worse than no hang detection. torch's global optimizer hooks and a few wrapped entry points
turn the script's own work into what the hang monitor (``monitors/hang.py``) and the restart policy
judge:

- each ``step()`` of the first optimizer is a step, and its ``step_s`` is the time since the step
  before ended: forward, backward, data, an evaluation, every micro-batch of an accumulation. The
  step budget is learned from what a step takes, not from the milliseconds inside ``step()``;
- a batch from a ``DataLoader``, a backward pass and a ``torch.distributed`` collective are
  progress inside a step (at most one beat every ``BEAT_S``), so a long evaluation loop moves;
- ``torch.save`` and DCP's ``save`` are a declared pause (``save``): judged by the checkpoint
  budget, and the peers that wait for a rank-0 snapshot in a barrier are not judged meanwhile;
- a file saved is remembered with its step (a ``script_save`` event). When a later attempt loads it
  back before its first step (``torch.load``, DCP's ``load``), its steps continue from there (a
  ``script_resume`` event): the step numbers, goodput's recomputed steps and the no-progress guard
  then follow what the script really reached.

Before an attempt's first step the rank is in its start-up sections (``import``, ``load`` on a
load), judged by their own budgets. Everything stands aside once the script uses the ``ptops.rank``
API, which reports its own steps.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ptops.monitors.hang import SAVE
from ptops.ops.runrecord.events import EventKind
from ptops.ops.runrecord.jsonl import read_jsonl

BEAT_S = 0.5  # at most one progress beat this often (a 10 ms step loop sends no more)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip


def _path_of(f: Any) -> str | None:
    """A local file's absolute path, if ``f`` names one (a path, or an open file's name)."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fspath(f))
    name = getattr(f, "name", None)
    return os.path.abspath(name) if isinstance(name, str) and os.path.isfile(name) else None


def _stamp(path: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of a saved file; of a DCP folder, its ``.metadata`` (written last).
    No path in it: a script that saves to ``x.tmp`` and renames it (the atomic idiom) loads the
    same file under another name."""
    p = Path(path)
    try:
        st = (p / ".metadata").stat() if p.is_dir() else p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class ScriptWatch:
    """One rank's view of an unchanged script (``install`` once, before the script runs)."""

    def __init__(
        self,
        probe: Any,
        reports_steps: Callable[[], bool],
        events: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.reports_steps = reports_steps  # the script uses the API: stand aside
        self.events = events
        self.clock = clock
        self.offset = 0  # the step of the snapshot this attempt resumed from
        self.n = 0  # optimizer steps of this attempt
        self.owner: int | None = None  # the optimizer whose steps count
        self.t_prev: float | None = None  # the step before ended (step 1: its first sign of work)
        self.t_beat = 0.0
        self.saving = False
        self._saves: dict[tuple[int, int, int], int] | None = None  # a saved file's stamp -> step

    @property
    def step(self) -> int:
        return self.offset + self.n

    def watching(self) -> bool:
        return not self.reports_steps()

    # ------------------------------------------------------------ steps
    def before_step(self, opt: Any) -> None:
        if not self.watching() or (self.owner is not None and self.owner != id(opt)):
            return
        self.owner = id(opt)
        self.n += 1
        if self.t_prev is None:
            self.t_prev = self.clock()
        step = self.step
        self.probe.profile.at_step(step)
        self.probe.faults.before_step(step)
        self.probe.before_step(step)

    def after_step(self, opt: Any) -> None:
        if not self.watching() or self.owner != id(opt):
            return
        now = self.clock()
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        step_s = now - (self.t_prev if self.t_prev is not None else now)
        self.t_prev = self.t_beat = now
        self.probe.step(
            self.step,
            {"lr": float(lr) if isinstance(lr, (int, float)) else None, "step_s": step_s},
        )

    def progress(self) -> None:
        """Work inside a step (a batch, a backward pass, a collective): a beat, at most every
        ``BEAT_S``. Before the first step, only the first step's start is noted (start-up sections
        judge the rest)."""
        if self.saving or not self.watching():
            return
        now = self.clock()
        if self.n == 0:
            if self.t_prev is None:
                self.t_prev = now
            return
        if now - self.t_beat >= BEAT_S:
            self.t_beat = now
            self.probe.phase("step", self.step)

    # ------------------------------------------------------------ the script's own files
    @contextlib.contextmanager
    def saving_to(self, f: Any) -> Iterator[None]:
        if self.saving or self.n == 0 or not self.watching():
            yield
            return
        self.saving = True
        self.probe.phase(SAVE, self.step)
        try:
            yield
        finally:
            self.saving = False
            self.t_beat = self.clock()
            self.probe.phase("step", self.step)
        path = _path_of(f) if isinstance(f, (str, os.PathLike)) else None
        stamp = _stamp(path) if path else None
        if path and stamp:
            self._known()[stamp] = self.step
            self.probe.event(
                EventKind.SCRIPT_SAVE,
                step=self.step,
                path=path,
                inode=stamp[0],
                size=stamp[1],
                mtime_ns=stamp[2],
            )

    @contextlib.contextmanager
    def loading_from(self, f: Any) -> Iterator[None]:
        if self.n > 0 or not self.watching():
            yield
            return
        self.probe.startup("load")
        yield
        path = _path_of(f)
        stamp = _stamp(path) if path else None
        step = self._known().get(stamp) if stamp else None
        if step is not None and step > self.offset:
            self.offset = step
            self.probe.event(EventKind.SCRIPT_RESUME, step=step, path=path)

    def _known(self) -> dict[tuple[int, int, int], int]:
        """Earlier attempts' saves (``script_save`` events), read once, then this attempt's."""
        if self._saves is None:
            self._saves = {}
            try:
                for e in read_jsonl(self.events):
                    if e.get("kind") == EventKind.SCRIPT_SAVE:
                        try:
                            stamp = (int(e["inode"]), int(e["size"]), int(e["mtime_ns"]))
                            self._saves[stamp] = int(e["step"])
                        except (KeyError, TypeError, ValueError):
                            continue  # a hand-edited or foreign line: not a save of this run
            except OSError:
                pass
        return self._saves

    # ------------------------------------------------------------ hooks
    def install(self) -> None:
        """torch's global optimizer hooks, and wrappers of the entry points a script calls."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        from torch.utils.data import dataloader

        register_optimizer_step_pre_hook(lambda opt, args, kwargs: self.before_step(opt))
        register_optimizer_step_post_hook(lambda opt, args, kwargs: self.after_step(opt))
        it = dataloader._BaseDataLoaderIter
        it.__next__ = self._after(it.__next__)
        torch.autograd.backward = self._around(torch.autograd.backward)
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._around(fn))
        torch.save = self._file(torch.save, self.saving_to, arg=1, key="f")
        torch.load = self._file(torch.load, self.loading_from, arg=0, key="f")
        dcp.save = self._file(dcp.save, self.saving_to, arg=None, key="checkpoint_id")
        dcp.load = self._file(dcp.load, self.loading_from, arg=None, key="checkpoint_id")

    def _after(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.progress()
            return out

        return wrapper

    def _around(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.progress()
            out = fn(*args, **kwargs)
            self.progress()
            return out

        return wrapper

    @staticmethod
    def _file(fn: Callable, context: Callable, arg: int | None, key: str) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            target = kwargs.get(key)
            if target is None and arg is not None and len(args) > arg:
                target = args[arg]
            if target is None:  # DCP through a storage writer or reader of a folder
                store = kwargs.get("storage_writer") or kwargs.get("storage_reader")
                target = getattr(store, "path", None)
            with context(target):
                return fn(*args, **kwargs)

        return wrapper
