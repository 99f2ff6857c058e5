"""Rank-side fault injectors, driven by the rank probe's hooks.

The probe holds one :class:`Injector` as ``probe.faults``; the engine adapter calls its hooks next
to the probe's beats they belong to (``ops/rank/probe.py``), and asks it what a save must do
(``sync_save_wanted``, ``waits_for_save``) instead of naming fault kinds. Hooks:

- ``before_step(step)`` (start of an optimizer step): crash, hang, slow, oom,
  preempt, kill-supervisor, hold
- ``on_startup(section)`` (after ``probe.startup(section)``): hang with ``phase=SECTION``
- ``should_poison(step)``: nan
- ``skip_sync(step)`` (the weight sync to a vLLM engine before ``step``'s rollouts): stale-sync
- ``in_sync(step)`` (inside the weight sync to a vLLM engine): sync-hang
- ``engine_crash(step)`` (server mode, before ``step``'s rollouts are asked for): engine-crash
- ``engine_hang(step)`` (before ``step``'s rollouts; the seam acts on what it returns): engine-hang
- ``grader_crash(step)`` (each try of ``step``'s reward functions): grader-crash
- ``in_reward(step)`` (inside ``step``'s reward call): grader-timeout
- ``on_checkpoint(step)`` (after ``probe.phase("checkpoint", step)``): enospc (and it
  notes the save a ``hold:until=committed`` waits for). The
  ``OSError(ENOSPC)`` is raised to the adapter, whose guarded save block records
  ``checkpoint_failed`` and carries on (an adapter without one crashes, and the
  supervisor restarts it: also survivable).
- ``in_save(step)`` (every rank has begun the save of
  ``step``, the folder is marked, this rank has not handed its part to the engine):
  crash with ``phase=save``. Earlier would be a plain crash; later races the engine's
  background writer, which may finish the save within the emission grace below and
  leave a complete (adoptable) checkpoint instead of a half-written one
- ``after_checkpoint(step)`` (after the first ``probe.phase("step", step)`` after it, i.e.
  once the save is complete and committed): corrupt-ckpt
- ``before_commit(step)`` (the save's files are written, its
  commit is next; an async save calls it on its commit thread): slow-save, which waits
  there; ``on_skip(step)`` (a save skipped because the previous
  one is still writing) ends a ``slow-save:until=skipped``
- ``flip_bits(step, tensors)`` (``probe.faults.flip_bits``: the adapter calls it before the step,
  after ``before_step``, with a function that lists its tensors): bitflip, once or (``persistent``)
  before every step from its own
- ``on_startup("import")`` also: misrendezvous (the rank's rendezvous env is rewritten
  before the engine is imported, so its process group is a world of one)

preempt, kill-supervisor and corrupt-ckpt are carried out by one rank for the
whole job (rank 0 unless the spec says ``rank=``).

``hold`` is a declared pause, not a failure: the rank waits before the step
(outside any collective; the probe keeps pinging and reports phase ``hold``)
until ``release`` arrives (``ptops inject RUN_DIR release``, handed to
:meth:`Injector.add`) or its ``seconds`` pass. Tests use it to keep a run alive
until what they wait for has been observed, instead of racing a short run.

Every fault fires at most once per process, and ``emit(fault, step)`` is called
*before* it takes effect, so ``fault_injected`` reaches the run directory even
when the rank dies of it. Faults given at launch fire exactly at their step;
faults injected into a live run (``ptops inject``) fire at their step or, when
that step has already passed, at the next opportunity.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

from ptops.ckpt import checkpoint_path, is_writing, shard_files
from ptops.faultinject.spec import (
    AT_REST,
    COMPUTE,
    GRAD,
    HOLD_DEFAULT_S,
    ONE_RANK_KINDS,
    SLOW_SAVE_DEFAULT_S,
    Fault,
)

BEFORE_STEP = ("crash", "hang", "slow", "oom", "preempt", "kill-supervisor", "hold", "leak")
FLIP_BYTES = 64
COMMIT_WAIT_S = 60.0
# bitflip: which exponent bit (counted from the exponent's lowest bit). Bit 4 scales the value by
# 2^16 or 2^-16: enough to matter, and finite for any weight (|x| < 2^111 in float32/bfloat16).
FLIP_EXPONENT_BIT = 4
# dtype -> (integer view, mantissa bits, exponent bits)
_FLOAT_LAYOUT = {
    "torch.float32": ("int32", 23, 8),
    "torch.bfloat16": ("int16", 7, 8),
    "torch.float16": ("int16", 10, 5),
    "torch.float64": ("int64", 52, 11),
}


def _lasting(f: Fault) -> bool:
    """A ``mode=persistent`` fault: due at every step from its own."""
    return f.params.get("mode") == "persistent"


class Injector:
    # what flip_bits flips where an engine calls it (the engines do not import faultinject)
    AT_REST, GRAD, COMPUTE = AT_REST, GRAD, COMPUTE

    def __init__(
        self,
        faults: list[Fault],
        rank: int,
        attempt: int,
        emit: Callable[[Fault, int], None],
        run_dir: Path | None = None,
        on_hang_stop: Callable[[], None] | None = None,
        on_hold: Callable[[int], None] | None = None,
        on_release: Callable[[int, float, str], None] | None = None,
    ):
        self.rank = rank
        self.attempt = attempt
        self.emit = emit
        self.run_dir = run_dir
        self.on_hang_stop = on_hang_stop
        self._lock = threading.Lock()
        self._pending: list[tuple[Fault, bool]] = [(f, False) for f in faults if self._mine(f)]
        # Job-level faults (ONE_RANK_KINDS) that another rank carries out: tracked here too and
        # consumed at the same hook, so that every rank answers ``pending`` / ``sync_save_wanted``
        # alike (a save that one rank makes synchronous and another asynchronous deadlocks).
        self._shadow: list[tuple[Fault, bool]] = [
            (f, False)
            for f in faults
            if f.kind in ONE_RANK_KINDS
            and not self._for_rank(f)
            and (f.attempt == 0 or f.attempt == attempt)
        ]
        self._slow_left: dict[int, tuple[float, int]] = {}
        self._leak_mb = 0.0  # leak: MB more kept at every step's start, from its step on
        self._leaked: list[bytes] = []
        self._ckpt_steps: set[int] = set()
        self.on_hold = on_hold  # (step): the rank stops before ``step``
        self.on_release = on_release  # (step, held_s, "release" | "timeout"): it goes on
        self._released = threading.Condition()
        self._release_gen = 0
        self._last_save: int | None = None  # the step of the last save this rank began
        self._skipped = threading.Condition()
        self._skips: list[int] = []  # steps whose save was skipped (another one still writing)
        self._flipping: set[int] = set()  # id() of persistent faults that fired (emitted once)

    def _for_rank(self, f: Fault) -> bool:
        if f.kind in ONE_RANK_KINDS and f.rank is None:
            return self.rank == 0
        return f.rank is None or f.rank == self.rank

    def _mine(self, f: Fault) -> bool:
        return self._for_rank(f) and (f.attempt == 0 or f.attempt == self.attempt)

    def add(self, fault: Fault) -> bool:
        """A fault injected into the live run; returns whether this rank carries it out."""
        if not self._for_rank(fault):
            if fault.kind in ONE_RANK_KINDS:
                with self._lock:
                    self._shadow.append((fault, True))
            return False
        if fault.kind == "release":
            self.release()
            return True
        with self._lock:
            self._pending.append((fault, True))
        return True

    @property
    def pending(self) -> list[Fault]:
        """Faults of this attempt not fired yet that this rank carries out or takes part in
        (a job-level fault carried out by another rank stays listed until its hook passed here)."""
        with self._lock:
            return [f for f, _ in self._pending] + [f for f, _ in self._shadow]

    def sync_save_wanted(self, step: int) -> bool:
        """True on every rank alike when a ``corrupt-ckpt`` fault wants the save of ``step``:
        it fires once the save is committed, so an adapter should save synchronously then."""
        with self._lock:
            return any(
                f.kind == "corrupt-ckpt" and (step == f.step or (live and step >= f.step))
                for f, live in self._pending + self._shadow
            )

    def waits_for_save(self, step: int) -> bool:
        """A pending fault needs the save of ``step`` (:func:`waits_for_save`): an adapter must not
        skip it because the previous save still writes."""
        return waits_for_save(self.pending, step)

    @staticmethod
    def _due(f: Fault, live: bool, kinds: tuple[str, ...], step: int, phase: str = "step") -> bool:
        where = (
            "step" if f.kind == "hold" else f.params.get("phase", "step")
        )  # hold's phase names its pause
        return f.kind in kinds and where == phase and (step == f.step or (live and step >= f.step))

    def _take_lasting(self, match: Callable[[Fault, bool], bool], step: int) -> list[Fault]:
        """The pending faults ``match(fault, live)`` names, taken; a persistent one stays pending
        (due again at later steps) and is emitted the first time only (bitflip, stale-sync)."""
        with self._lock:
            due = [(f, live) for f, live in self._pending if match(f, live)]
            keep = [(f, live) for f, live in due if _lasting(f)]
            self._pending = [p for p in self._pending if p not in due] + keep
        for f, _ in due:
            if id(f) not in self._flipping:
                self.emit(f, step)
                if _lasting(f):
                    self._flipping.add(id(f))
        return [f for f, _ in due]

    def _take(self, kinds: tuple[str, ...], step: int, phase: str = "step") -> list[Fault]:
        with self._lock:
            fired = [f for f, live in self._pending if self._due(f, live, kinds, step, phase)]
            self._pending = [
                (f, live) for f, live in self._pending if not self._due(f, live, kinds, step, phase)
            ]
            self._shadow = [
                (f, live) for f, live in self._shadow if not self._due(f, live, kinds, step, phase)
            ]
        return fired

    # ------------------------------------------------------------ hooks
    def before_step(self, step: int) -> None:
        if self._leak_mb:
            self._leak_more()
        for key in list(self._slow_left):
            seconds, left = self._slow_left[key]
            time.sleep(seconds)
            if left <= 1:
                del self._slow_left[key]
            else:
                self._slow_left[key] = (seconds, left - 1)
        gen = self._release_gen  # a release that comes once a hold is taken (and announced) ends it
        # a hold is a pause *before* the step: it goes first, whatever the order of the specs
        for f in sorted(self._take(BEFORE_STEP, step), key=lambda f: f.kind != "hold"):
            self.emit(f, step)
            if f.kind == "hold":
                self._hold(f, step, gen)
            else:
                getattr(self, "_" + f.kind.replace("-", "_"))(f, step)

    def on_startup(self, section: str) -> None:
        """``probe.startup(section)``: a ``hang:phase=SECTION`` fault stops the rank in that
        start-up section; ``misrendezvous`` acts at ``import`` (before the engine and its process
        group)."""

        def due(f: Fault) -> bool:
            return (f.kind == "hang" and f.params.get("phase") == section) or (
                f.kind == "misrendezvous" and section == "import"
            )

        with self._lock:
            fired = [f for f, _ in self._pending if due(f)]
            self._pending = [(f, live) for f, live in self._pending if f not in fired]
        for f in fired:
            self.emit(f, 0)
            getattr(self, "_" + f.kind)(f, 0)

    def before_commit(self, step: int) -> None:
        """The save of ``step`` is written, its commit comes next: ``slow-save`` waits here."""
        for f in self._take(("slow-save",), step):
            self.emit(f, step)
            self._slow_save(f, step)

    def flip_bits(
        self,
        step: int,
        tensors: Callable[[str], list[tuple[str, Any]]],
        targets: tuple[str, ...] = AT_REST,
    ) -> list[str]:
        """``bitflip`` faults of ``targets`` due at ``step``: one bit of one element of one of this
        rank's tensors (``tensors(target)`` lists them, named, in a stable order). Engines call it
        between steps with ``AT_REST`` (parameters, optimizer state) and between the backward and
        the optimizer with ``GRAD``. A persistent one stays pending and flips again at every later
        step. Returns what was flipped (for the log)."""
        due = self._take_lasting(
            lambda f, live: (
                f.kind == "bitflip"
                and f.params.get("target", "param") in targets
                and (step == f.step or (step > f.step and (live or _lasting(f))))
            ),
            step,
        )
        done = []
        for f in due:
            what = flip_one_bit(tensors(f.params.get("target", "param")), f, step)
            _warn(f"fault {f}: {what}")
            done.append(what)
        return done

    def on_skip(self, step: int) -> None:
        """A save of ``step`` was skipped because the previous one was still writing."""
        with self._skipped:
            self._skips.append(int(step))
            self._skipped.notify_all()

    def skip_sync(self, step: int) -> bool:
        """``stale-sync`` due before ``step``'s rollouts: the weight sync to the engine must change
        nothing. Persistent: every sync from ``step`` on (emitted once)."""
        return self._due_from(("stale-sync",), step)

    def in_sync(self, step: int) -> None:
        """``sync-hang`` due in the weight sync before ``step``'s rollouts: the rank hangs there
        (``mode=sleep`` keeps its liveness pings, ``stop`` SIGSTOPs it), as a sync whose transfer
        never completes does."""
        for f in self._take(("sync-hang",), step):
            self.emit(f, step)
            self._hang(f, step)

    def _due_from(self, kinds: tuple[str, ...], step: int) -> bool:
        """A fault of ``kinds`` due at ``step``, or a persistent one due at an earlier step."""
        due = self._take_lasting(
            lambda f, live: f.kind in kinds and (step == f.step or (step > f.step and _lasting(f))),
            step,
        )
        return bool(due)

    def engine_crash(self, step: int) -> bool:
        """``engine-crash`` due before ``step``'s rollouts (server mode: the engine exits)."""
        fired = self._take(("engine-crash",), step)
        for f in fired:
            self.emit(f, step)
        return bool(fired)

    def engine_hang(self, step: int) -> list[Fault]:
        """``engine-hang`` due before ``step``'s rollouts: the seam stops the engine (server) or
        calls :meth:`stall` inside the generate (colocate)."""
        fired = self._take(("engine-hang",), step)
        for f in fired:
            self.emit(f, step)
        return fired

    def stall(self, f: Fault, step: int) -> None:
        """Hang where the caller stands (``seconds`` default forever)."""
        self._hang(f, step)

    def grader_crash(self, step: int) -> bool:
        """``grader-crash`` due at this try of ``step``'s reward functions. Persistent: every try
        from ``step`` on (emitted once)."""
        return self._due_from(("grader-crash",), step)

    def in_reward(self, step: int) -> None:
        """``grader-timeout`` due in ``step``'s reward call: the rank stalls there, as a call to a
        grader that never answers does."""
        for f in self._take(("grader-timeout",), step):
            self.emit(f, step)
            self._hang(f, step)

    def should_poison(self, step: int) -> bool:
        fired = self._take(("nan",), step)
        for f in fired:
            self.emit(f, step)
        return bool(fired)

    def on_checkpoint(self, step: int) -> None:
        self._ckpt_steps.add(step)
        self._last_save = step
        for f in self._take(("enospc",), step):
            self.emit(f, step)
            raise OSError(errno.ENOSPC, f"No space left on device (injected fault {f})")

    def in_save(self, step: int) -> None:
        for f in self._take(("crash",), step, phase="save"):
            self.emit(f, step)
            self._crash(f, step)

    def after_checkpoint(self, step: int) -> None:
        if step not in self._ckpt_steps:
            return
        self._ckpt_steps.discard(step)
        for f in self._take(("corrupt-ckpt",), step):
            self.emit(f, step)
            self._corrupt(f, step)

    def release(self) -> None:
        """End the hold in effect (if any) and drop the holds not reached yet: after a release
        the run goes on to its end (a hold injected later holds again)."""
        with self._lock:
            self._pending = [(f, live) for f, live in self._pending if f.kind != "hold"]
        with self._released:
            self._release_gen += 1
            self._released.notify_all()

    # ------------------------------------------------------------ effects
    def _hold(self, f: Fault, step: int, gen: int) -> None:
        seconds = float(f.params.get("seconds", HOLD_DEFAULT_S))
        on_commit = f.params.get("until", "release") == "committed"
        t0 = time.monotonic()
        deadline = t0 + seconds
        if self.on_hold:
            phase = f.params.get("phase", "hold")
            self.on_hold(step) if phase == "hold" else self.on_hold(step, phase)
        by = "timeout"
        with self._released:
            while True:
                if self._release_gen != gen:
                    by = "release"
                    break
                if on_commit and self._last_save_committed():
                    by = "committed"
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._released.wait(
                    min(left, 0.1) if on_commit else left
                )  # a commit is seen on disk: poll it
        if self.on_release:
            self.on_release(step, time.monotonic() - t0, by)

    def _last_save_committed(self) -> bool:
        return self._last_save is None or committed(find_checkpoint(self.run_dir, self._last_save))

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

    def _slow_save(self, f: Fault, step: int) -> None:
        on_skip = f.params.get("until") == "skipped"
        seconds = float(f.params.get("seconds", HOLD_DEFAULT_S if on_skip else SLOW_SAVE_DEFAULT_S))
        deadline = time.monotonic() + seconds
        with self._skipped:
            while not (on_skip and any(s > step for s in self._skips)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._skipped.wait(left)
        why = (
            "a later save was skipped" if on_skip and any(s > step for s in self._skips) else "time"
        )
        _warn(f"fault {f}: the commit of step {step} goes on ({why})")

    def _misrendezvous(self, f: Fault, step: int) -> None:
        """A rank whose rendezvous endpoint fell back to localhost: its own store on a free port,
        world size 1. The probe keeps the launcher's world size, so the supervisor sees the mismatch
        (``misconfigured``)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            {
                "WORLD_SIZE": "1",
                "RANK": "0",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        _warn(
            f"fault {f}: rank {self.rank} forms a world of one (its own store on 127.0.0.1:{port})"
        )

    def _slow(self, f: Fault, step: int) -> None:
        seconds = float(f.params.get("seconds", 1.0))
        steps = int(f.params.get("steps", 1))
        time.sleep(seconds)
        if steps > 1:
            self._slow_left[id(f)] = (seconds, steps - 1)

    def _leak(self, f: Fault, step: int) -> None:
        self._leak_mb += float(f.params.get("mb", 64.0))
        self._leak_more(float(f.params.get("mb", 64.0)))

    def _leak_more(self, mb: float | None = None) -> None:
        """Keep ``mb`` (default: every leak's) MB more: bytes written, so the pages are resident."""
        self._leaked.append(b"\x5a" * int((self._leak_mb if mb is None else mb) * (1 << 20)))

    def _oom(self, f: Fault, step: int) -> None:
        msg = f"CUDA out of memory. Tried to allocate 20.00 GiB (injected fault {f})"
        try:
            import torch

            raise torch.OutOfMemoryError(msg)
        except (ImportError, AttributeError):
            raise MemoryError(msg) from None

    def _preempt(self, f: Fault, step: int) -> None:
        # A scheduler's SIGTERM before the time limit: the supervisor owns the job's stop path
        # (save request, teardown, exit 143). Unsupervised, torchrun (this rank's parent) gets it
        # and forwards it to every rank.
        target = int(os.environ.get("PTOPS_SUPERVISOR_PID") or 0) or os.getppid()
        try:
            os.kill(target, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _kill_supervisor(self, f: Fault, step: int) -> None:
        target = int(os.environ.get("PTOPS_SUPERVISOR_PID") or 0)
        if not target:
            _warn(f"fault {f}: no supervisor to kill (not a supervised run); ignored")
            return
        time.sleep(
            0.5
        )  # the supervisor pumps its channel every 0.2 s: let it record fault_injected first
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(30)  # the channel's EOF (probe) and PDEATHSIG (torchrun) end this rank meanwhile

    def _corrupt(self, f: Fault, step: int) -> None:
        # The damage must come after the commit (manifest written, .writing marker gone), or the
        # manifest would record the damaged bytes. A sync save is committed by now; an async
        # one finishes in the background: wait for it there, without stalling training.
        if committed(find_checkpoint(self.run_dir, step)):
            self._do_corrupt(f, step)
        else:
            threading.Thread(
                target=self._corrupt_when_committed,
                args=(f, step),
                name="ptops-corrupt",
                daemon=True,
            ).start()

    def _corrupt_when_committed(
        self, f: Fault, step: int, timeout_s: float = COMMIT_WAIT_S
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not committed(find_checkpoint(self.run_dir, step)):
            time.sleep(0.1)
        self._do_corrupt(f, step)

    def _do_corrupt(self, f: Fault, step: int) -> None:
        victim = corrupt_checkpoint(self.run_dir, step, self.rank, f.params.get("mode", "truncate"))
        if victim is None:
            _warn(f"fault {f}: no checkpoint of step {step} to corrupt under {self.run_dir}")
        else:
            _warn(f"fault {f}: corrupted {victim} ({f.params.get('mode', 'truncate')})")


def _warn(msg: str) -> None:
    # ptops.ops.runrecord.ranklog's format (its handler is on "ptops.rank"); no import of ptops here
    logging.getLogger("ptops.rank.faultinject").warning("%s", msg)


def committed(ckpt: Path | None) -> bool:
    """A checkpoint folder whose save is not in progress (ptops.ckpt's commit protocol); an
    engine without the protocol never marks, so its folder counts once the save hook returned."""
    return ckpt is not None and not is_writing(ckpt)


def find_checkpoint(run_dir: Path | None, step: int) -> Path | None:
    return None if run_dir is None else checkpoint_path(run_dir, step)


def pick_victim(ckpt: Path, rank: int = 0) -> Path | None:
    """The shard to damage: rank's own DCP shard when present, else the largest file."""
    own = [f for f in shard_files(ckpt, rank) if f.stat().st_size > 0]
    if own:
        return own[0]
    files = shard_files(ckpt)
    return files[0] if files else None


def corrupt_file(path: Path, mode: str = "truncate") -> None:
    """``truncate``: cut to half its size; ``flip``: invert FLIP_BYTES bytes in the middle (size
    unchanged)."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        if mode == "flip":
            n = min(FLIP_BYTES, size)
            at = max(0, size // 2 - n // 2)
            fh.seek(at)
            data = fh.read(n)
            fh.seek(at)
            fh.write(bytes(b ^ 0xFF for b in data))
        else:
            fh.truncate(size // 2)
        fh.flush()
        os.fsync(fh.fileno())


def corrupt_checkpoint(
    run_dir: Path | None, step: int, rank: int = 0, mode: str = "truncate"
) -> Path | None:
    """Damage one shard of the checkpoint of ``step`` in ``run_dir``; returns the file, or None if
    none."""
    ckpt = find_checkpoint(run_dir, step)
    if ckpt is None:
        return None
    victim = pick_victim(ckpt, rank)
    if victim is None:
        return None
    corrupt_file(victim, mode)
    return victim


def flip_one_bit(named: list[tuple[str, Any]], fault: Fault, step: int) -> str:
    """Flip exponent bit ``FLIP_EXPONENT_BIT`` of one element of one floating tensor of ``named``,
    in place. The tensor and element are a hash of the spec (and of ``step`` for a persistent
    fault, which so hits a new element each time): the same spec flips the same bit."""
    import torch

    floats = [(n, t) for n, t in named if str(t.dtype) in _FLOAT_LAYOUT and t.numel() > 0]
    if not floats:
        return "no floating tensor to flip"
    key = f"{fault.kind}:{fault.rank}:{fault.step}:{fault.params.get('target', 'param')}"
    if fault.params.get("mode") == "persistent":
        key += f":{step}"
    h = zlib.crc32(key.encode())
    name, tensor = floats[h % len(floats)]
    flat = tensor.detach().view(-1)
    index = zlib.crc32(key.encode()[::-1]) % flat.numel()
    int_dtype, mantissa, _ = _FLOAT_LAYOUT[str(tensor.dtype)]
    bit = mantissa + FLIP_EXPONENT_BIT
    with torch.no_grad():
        before = float(flat[index])
        ints = flat.view(getattr(torch, int_dtype))
        ints[index] ^= 1 << bit
        after = float(flat[index])
    return f"flipped bit {bit} of element {index} of {name} ({before:.6g} -> {after:.6g})"


def waits_for_save(pending: list[Fault], step: int) -> bool:
    """A fault that needs this step's save: committed (``corrupt-ckpt``,
    ``hold:until=committed``), or begun, because it fires inside it (``enospc``,
    ``crash:phase=save``, due at this step or before). Skipping that save while the previous one
    still writes would skip the fault, on a slow box only."""
    for f in pending:
        if f.kind == "corrupt-ckpt" or (f.kind == "hold" and f.params.get("until") == "committed"):
            return True
        if f.step <= step and (
            f.kind == "enospc" or (f.kind == "crash" and f.params.get("phase") == "save")
        ):
            return True
    return False
