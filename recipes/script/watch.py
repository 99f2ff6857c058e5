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
import hashlib
import io
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ptops.monitors.hang import SAVE
from ptops.ops.runrecord.events import EventKind
from ptops.ops.runrecord.jsonl import read_jsonl

BEAT_S = 0.5  # at most one progress beat this often (a 10 ms step loop sends no more)
# a saved state's fingerprint: all of it up to WHOLE bytes, else its head, tail and BLOCKS blocks
WHOLE, SAMPLE, BLOCK, BLOCKS = 64 << 20, 64 << 10, 4096, 64
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip


def _sampled(read: Callable[[int, int], bytes], size: int) -> str:
    """A digest of a saved state's size and samples of its bytes (its head and tail, and blocks
    spread through it, where the tensors are). Its bytes, not its name: a script that saves to
    ``x.tmp`` and renames it, writes a buffer to a file (Lightning), or loads through a link or a
    copy loads the same state. All of a state up to ``WHOLE`` bytes (~60 ms at 64 MB), ~200 KB of
    a larger one."""
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    if size <= WHOLE:
        h.update(read(0, size))
        return h.hexdigest()
    spots = [0, max(0, size - SAMPLE)]
    spots += [size * i // (BLOCKS + 1) for i in range(1, BLOCKS + 1)]
    for i, at in enumerate(spots):
        h.update(read(at, SAMPLE if i < 2 else BLOCK))
    return h.hexdigest()


def _file_print(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:

            def read(at: int, n: int) -> bytes:
                f.seek(at)
                return f.read(n)

            return _sampled(read, size)
    except OSError:
        return None


def fingerprint(f: Any) -> str | None:
    """What a save wrote or a load reads: a path (a file, or a DCP folder: each of its files), an
    in-memory buffer, or a seekable file object (read where it stands, then put back); None for
    anything else."""
    if isinstance(f, (str, os.PathLike)):
        p = Path(f)
        if p.is_dir():
            files = sorted(x for x in p.iterdir() if x.is_file())
            prints = [f"{x.name}:{_file_print(x)}" for x in files]
            return hashlib.blake2b("|".join(prints).encode(), digest_size=16).hexdigest()
        return _file_print(p)
    if isinstance(f, io.BytesIO):
        buf = f.getbuffer()
        return _sampled(lambda at, n: bytes(buf[at : at + n]), len(buf))
    try:
        here = f.tell()
        size = f.seek(0, os.SEEK_END)

        def read(at: int, n: int) -> bytes:
            f.seek(at)
            return f.read(n)

        try:
            return _sampled(read, size)
        finally:
            f.seek(here)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def _name_of(f: Any) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fspath(f))
    name = getattr(f, "name", None) or getattr(f, "path", None)
    return os.path.abspath(name) if isinstance(name, str) else ""  # a buffer: no name


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
        self.inside = False  # in a save or load of the script's (``_inside``)
        self._saves: dict[str, int] | None = None  # a saved state's fingerprint -> its step

    @property
    def step(self) -> int:
        return self.offset + self.n

    def watching(self) -> bool:
        return not self.reports_steps()

    # ------------------------------------------------------------ steps
    def before_step(self, opt: Any) -> None:
        if self.inside or not self.watching() or self.owner not in (None, id(opt)):
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
        if self.inside or not self.watching() or self.owner != id(opt):
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
        if self.inside or not self.watching():
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
    def _inside(self) -> Iterator[None]:
        """A save or load: its optimizer steps are torch's own (DCP's ``get_state_dict`` steps a
        fresh optimizer once, with zero gradients, to create its state) and its collectives no
        progress of the script's."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    @contextlib.contextmanager
    def saving_to(self, f: Any) -> Iterator[None]:
        if self.inside or not self.watching():
            yield
            return
        if self.n == 0:  # before the first step: the start-up sections judge it
            with self._inside():
                yield
            return
        self.probe.phase(SAVE, self.step)
        try:
            with self._inside():
                yield
        finally:
            self.t_beat = self.clock()
            self.probe.phase("step", self.step)
        saved = fingerprint(f)
        if saved is not None:
            self._known()[saved] = self.step
            self.probe.event(
                EventKind.SCRIPT_SAVE, step=self.step, path=_name_of(f), fingerprint=saved
            )

    @contextlib.contextmanager
    def loading_from(self, f: Any) -> Iterator[None]:
        if self.inside or self.n > 0 or not self.watching():
            yield
            return
        self.probe.startup("load")
        loaded = fingerprint(f)  # before the load reads a file object to its end
        with self._inside():
            yield
        step = self._known().get(loaded) if loaded is not None else None
        if step is not None and step > self.offset:
            self.offset = step
            self.probe.event(EventKind.SCRIPT_RESUME, step=step, path=_name_of(f))

    def _known(self) -> dict[str, int]:
        """Earlier attempts' saves (``script_save`` events), read once, then this attempt's."""
        if self._saves is None:
            self._saves = {}
            try:
                for e in read_jsonl(self.events):
                    if e.get("kind") == EventKind.SCRIPT_SAVE:
                        try:
                            self._saves[str(e["fingerprint"])] = int(e["step"])
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
