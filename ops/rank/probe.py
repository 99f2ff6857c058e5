"""The rank probe: what an engine adapter talks to inside a training process, in four parts, each
called by the adapter (or the rank entry) at a point you can see in its code:

- **telemetry** (the probe itself): ``startup(section)`` as start-up goes on (``import`` is sent by
  the rank entry; adapters add ``rendezvous``, ``build``, ``load``), ``world(size, rank)`` once the
  process group exists (the supervisor stops a run whose ranks formed worlds of the wrong size),
  ``before_step(step)`` at the start of every optimizer step, ``step(step, metrics)`` after it,
  ``phase("checkpoint", step)`` / ``phase("step", step)`` around saves, optionally
  ``phase("data", step)`` before fetching a batch, ``with pause("eval", step):`` around a pause the
  engine declares, and ``event(kind, ...)``. Each is a beat, a record or an event, nothing else:
  each phase has its own hang budget, learned from the run (``ptops.monitors.hang``).
- **faults** (``probe.faults``, the :class:`~ptops.faultinject.inject.Injector`): its hooks,
  called next to the beats they belong to: ``on_startup(section)``, ``before_step(step)``,
  ``should_poison(step)`` (multiply the loss by NaN when True), ``on_checkpoint(step)`` when a save
  begins, ``in_save(step)``, ``before_commit(step)``, ``on_skip(step)``,
  ``after_checkpoint(step)`` when the step resumes after a save, ``flip_bits(step, tensors)``
  right after ``before_step`` (the ``bitflip`` fault, where ``recipes/sdc.py`` checks); and its
  answers (``sync_save_wanted``, ``waits_for_save``), so that adapters name no fault kind.
- **profiling** (``probe.profile``, :class:`~ptops.ops.rank.profiler.Profiling`): ``at_step(step)``
  at each step boundary, before the fault hooks; ``with probe.profile.mark("data"):`` around data
  loading (a no-op unless a ``ptops profile`` capture runs).
- **the stop protocol** (``probe.stop``, :class:`StopProtocol`): an adapter that can checkpoint on
  demand calls ``probe.stop.accept()`` once and polls ``probe.stop.requested`` at the end of each
  step; when it is True it saves and returns. Without that, the supervisor does not wait for a save
  on Ctrl-C / SIGTERM.

At a step boundary an adapter calls, in this order, ``probe.profile.at_step(step)``,
``probe.faults.before_step(step)`` and ``probe.before_step(step)``; at a save,
``probe.phase("checkpoint", step)`` then ``probe.faults.on_checkpoint(step)``, and after it
``probe.phase("step", step)`` then ``probe.faults.after_checkpoint(step)``
(``ckpt.SaveTransaction.run`` does the middle of a save for every engine).

Where the records go is the probe's business:

- with no supervisor at all (no ``PTOPS_CHANNEL`` in the environment: a rank started by
  hand or by a test; every ``ptops launch``, plain or ``--supervise``, has one): straight
  into ``RUN_DIR/metrics.jsonl`` (and ``fault_injected`` into ``events.jsonl``);
- under the supervisor: over its TCP channel (:mod:`ptops.ops.rank.channel`;
  no shared filesystem assumed). Each step sends a ``begin`` beat and its
  metrics (which count as the ``end`` beat); a background thread sends a
  liveness ``ping`` every ``PTOPS_HEARTBEAT_S`` seconds (default 1) so the
  supervisor can tell a rank that is alive but stuck from one that is stopped
  or stuck in C code holding the GIL. Commands from the supervisor: ``stacks``
  (answer with every thread's Python stack), ``stop`` (the stop protocol), ``fault`` (a fault
  injected into the live run; ``release`` ends a ``hold``, during which the rank pings on and
  reports phase ``hold``), ``profile`` (``ptops profile``: armed in ``probe.profile``).

Channel EOF means the supervisor is gone: the rank kills itself (the
supervisor-side half of "no orphans", next to PR_SET_PDEATHSIG in
``ops/rank/entry.py``).
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ptops import envnames
from ptops.ops.rank.memory import sample as memory_sample
from ptops.ops.runrecord import ranklog
from ptops.ops.runrecord.rundir import RunDir, append_jsonl

REQUIRED_KEYS = ("loss", "grad_norm", "lr", "step_s", "tokens_per_s")

_LOG = ranklog.get("probe")


def _clean(value: Any) -> Any:
    """JSON-safe scalars; NaN/Inf stay visible as strings so monitors can see them."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    return value


def dump_stacks() -> str:
    """Every thread's Python stack, most recent call last (like faulthandler, but with names)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = [
        f"# pid {os.getpid()} host {socket.gethostname()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}"
    ]
    frames = sys._current_frames()
    # the main thread first: that is where the training loop is
    order = sorted(frames, key=lambda ident: (ident != threading.main_thread().ident, ident))
    for ident in order:
        tag = " (this dump)" if ident == me else ""
        out.append(f'\nThread {ident:#x} "{names.get(ident, "?")}"{tag} (most recent call last):')
        out.append("".join(traceback.format_stack(frames[ident])).rstrip())
    return "\n".join(out) + "\n"


# torch 2.8 renamed the flight recorder's variables (TORCH_NCCL_TRACE_BUFFER_SIZE ->
# TORCH_FR_BUFFER_SIZE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE -> TORCH_FR_DUMP_TEMP_FILE) and records gloo
# too; from then on the old names still work but print "Environment variable ... is deprecated" in
# every rank's log (torch 2.13: c10d's Utils.hpp). (new name, name before torch 2.8)
FR_BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_TEMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FR_NEW_NAMES_SINCE = (2, 8)


def _torch_version() -> tuple[int, int] | None:
    """(major, minor) of the torch installed beside ptops (the ranks' torch), read from its package
    metadata: importing torch costs ~2.5 s. None without one."""
    from importlib import metadata

    try:
        major, minor = metadata.version("torch").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def flight_recorder_env(
    dump_prefix: str, environ: dict[str, str] | None = None, torch_version: Any = "installed"
) -> dict[str, str]:
    """The flight recorder's settings for the ranks: buffer 2000 entries, dumps to
    ``dump_prefix<rank>``, dump on an NCCL timeout. Only the names the ranks' torch reads: the
    new ones from torch 2.8 (no deprecation warning in the rank logs), the old ones as well below
    it. A setting the user made (under either name) is kept."""
    environ = os.environ if environ is None else environ
    version = _torch_version() if torch_version == "installed" else torch_version
    old = version is not None and tuple(version) < FR_NEW_NAMES_SINCE
    out: dict[str, str] = {}
    for names, value in ((FR_BUFFER_SIZE, "2000"), (FR_DUMP_TEMP_FILE, dump_prefix)):
        if not any(n in environ for n in names):
            out.update({n: value for n in (names if old else names[:1])})
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:  # NCCL's own name in every torch
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    return out


def flight_recorder_dump() -> bytes | None:
    """The flight-recorder trace (pickle bytes) of this rank's collectives; None without one.

    NCCL records with a buffer (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before
    torch 2.8), gloo too from torch 2.8. The supervisor sets the names the ranks' torch reads
    (:func:`flight_recorder_env`); ``diagnostics/flightrec.py`` reads the dumps."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        c10d = torch._C._distributed_c10d
        if dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
            return c10d._dump_nccl_trace()  # type: ignore[attr-defined]
        if hasattr(c10d, "_dump_fr_trace"):
            return c10d._dump_fr_trace()  # type: ignore[attr-defined]
        return None
    except Exception:
        return None


def attempt_from_env() -> int:
    """The worker group's attempt: the supervisor's ``PTOPS_ATTEMPT`` plus torchrun's own restart
    count.

    Under ptops, torchrun runs with ``--max-restarts 0`` (the supervisor restarts), so the count is
    0; under a plain ``torchrun --max-restarts N`` a restarted group is a new attempt too, so its
    records and its faults (which fire in attempt 1 only) are told apart from the group that failed.
    """
    return int(os.environ.get(envnames.ATTEMPT, "1")) + int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0
    )


class Probe:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        attempt: int,
        world_size: int = 1,
        channel: str | None = None,
        token: str | None = None,
        faults: str | None = None,
        heartbeat_s: float = 1.0,
    ):
        from ptops.faultinject.inject import Injector
        from ptops.faultinject.spec import from_env
        from ptops.ops.rank.profiler import Profiling

        self.run = RunDir(Path(run_dir))
        self.rank = rank
        self.attempt = attempt
        self.world_size = world_size
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._last_step_end = time.monotonic()
        self._step = 0
        self._phase = "startup"
        self._closing = False
        self.stop = StopProtocol()
        self.profile = Profiling(self.run.path, rank, self.event)
        self.faults = Injector(
            from_env(faults),
            rank,
            attempt,
            self._emit_fault,
            run_dir=self.run.path,
            on_hang_stop=self._stop_pinging,
            on_hold=self._on_hold,
            on_release=self._on_release,
        )
        self.client = None
        self._pinging = threading.Event()
        if channel:
            from ptops.ops.rank.channel import ChannelClient

            self.client = ChannelClient(
                channel,
                token or "",
                {
                    "role": "rank",
                    "rank": rank,
                    "pid": self.pid,
                    "host": self.host,
                    "attempt": attempt,
                    "world_size": world_size,
                },
                on_message=self._on_command,
                on_eof=self._on_eof,
            )
            _keepalive(self.client.sock)
            self._pinging.set()
            threading.Thread(
                target=self._ping_loop, args=(heartbeat_s,), name="ptops-probe-ping", daemon=True
            ).start()

    @classmethod
    def from_env(cls) -> "Probe":
        from ptops.ops.rank.channel import ENV_ADDRESS, ENV_TOKEN

        return cls(
            run_dir=Path(os.environ[envnames.RUN_DIR]),
            rank=int(os.environ.get("RANK", "0")),
            attempt=attempt_from_env(),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            channel=os.environ.get(ENV_ADDRESS) or None,
            token=os.environ.get(ENV_TOKEN),
            faults=os.environ.get(envnames.FAULTS),
            heartbeat_s=float(os.environ.get(envnames.HEARTBEAT_S, "1.0")),
        )

    @property
    def supervised(self) -> bool:
        return self.client is not None

    # ------------------------------------------------------------ adapter API
    def startup(self, section: str = "import") -> None:
        """Start-up progress: ``import`` (the engine's imports), ``rendezvous`` (process group),
        ``build`` (model / trainer), ``load`` (checkpoint load until the first step): each is
        judged by its own budget, so a rank stuck in one is found in seconds, not at a 600 s
        start-up timeout (``probe.faults.on_startup(section)`` comes next, at the call site)."""
        self._phase, self._step = "startup", 0
        self._send({"t": "beat", "step": 0, "phase": "startup", "section": section})

    def world(self, world_size: int, rank: int) -> None:
        """What the process group really is (after its init): a rank in a world of one, or of a
        size other than the launcher asked for, is a misconfiguration the supervisor stops at
        once."""
        self._send(
            {"t": "world", "world_size": int(world_size), "rank": int(rank), "host": self.host}
        )

    @contextlib.contextmanager
    def pause(self, phase: str = "eval", step: int | None = None):
        """A pause the engine declares (``eval``): it has its own learned budget, and the peers
        that wait for this rank meanwhile are not judged. Progress resumes at the exit."""
        step = self._step if step is None else int(step)
        self.phase(phase, step)
        try:
            yield
        finally:
            self.phase("step", step)

    def phase(self, phase: str, step: int) -> None:
        """Heartbeat with a phase (step / data / checkpoint / eval), nothing else."""
        self._phase, self._step = phase, int(step)
        self._send({"t": "beat", "step": int(step), "phase": phase})

    def step(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record one finished optimizer step. Missing required keys are filled with None."""
        now = time.monotonic()
        record: dict[str, Any] = {"step": int(step), "rank": self.rank, "attempt": self.attempt}
        for key in REQUIRED_KEYS:
            record[key] = None
        if metrics.get("step_s") is None:
            record["step_s"] = now - self._last_step_end
        record.update(
            memory_sample()
        )  # RSS, its limit, CUDA where initialised (an engine's own keys win)
        for key, value in metrics.items():
            record[key] = _clean(value)
        record["ts"] = time.time()
        self._last_step_end = now
        self._phase, self._step = "step", int(step)
        if self.client is not None:
            self._send({"t": "metrics", "rec": record})  # doubles as the step's end beat
        else:
            append_jsonl(self.run.metrics, record)
        return record

    def before_step(self, step: int) -> None:
        """The step's begin beat (after ``probe.profile.at_step`` and ``probe.faults.before_step``,
        so that a capture measures the fault hooks and a hung hook is found in this step)."""
        self._phase, self._step = "step", int(step)
        self._send({"t": "beat", "step": int(step), "phase": "step", "stage": "begin"})

    def event(self, kind: str, **fields: Any) -> None:
        """A rank-side event (e.g. ``checkpoint_failed``): over the channel when supervised, else
        straight to events.jsonl."""
        fields = {"rank": self.rank, "attempt": self.attempt, **fields}
        if self.client is not None:
            self._send({"t": "event", "kind": kind, "fields": fields})
        else:
            self.run.event(kind, **fields)

    def close(self, code: int = 0, error: str | None = None, traceback: str | None = None) -> None:
        """Tell the supervisor this rank is leaving on purpose (``code`` is its exit status;
        ``traceback``: the short one of a failure, ``entry.user_traceback``)."""
        self.profile.close(self._step)
        if self.client is None:
            return
        self._closing = True
        msg = {"t": "exit", "code": int(code), "error": error, "step": self._step}
        if traceback:
            msg["traceback"] = traceback
        self._send(msg)
        self.client.close()

    # ------------------------------------------------------------ internals
    def _send(self, msg: dict[str, Any]) -> None:
        if self.client is not None:
            msg.setdefault("ts", time.time())
            self.client.send(msg)

    def _emit_fault(self, fault, step: int) -> None:
        fields = {
            "fault": str(fault),
            "rank": self.rank,
            "step": int(step),
            "attempt": self.attempt,
        }
        if self.client is not None:
            self._send({"t": "fault", **fields})
        else:
            self.run.event("fault_injected", **fields)
        _LOG.info("injecting fault %s at step %s", fault, step)

    def _on_hold(self, step: int, phase: str = "hold") -> None:
        # a declared pause: the pings go on, and the phase tells the hang monitor it is no hang
        # (``eval``: as an engine's evaluation, judged by the learned eval budget)
        self._phase, self._step = phase, int(step)
        self._send({"t": "beat", "step": int(step), "phase": phase})
        _LOG.info("holding before step %s (until `ptops inject RUN_DIR release`)", step)

    def _on_release(self, step: int, held_s: float, by: str) -> None:
        self.event("hold_released", step=int(step), held_s=round(held_s, 3), by=by)
        _LOG.info("released after %.1f s (%s); step %s begins", held_s, by, step)

    def _stop_pinging(self) -> None:
        self._pinging.clear()

    def _ping_loop(self, every: float) -> None:
        while not self._closing and self.client is not None and not self.client.broken:
            time.sleep(every)
            if self._pinging.is_set():
                self._send({"t": "ping", "step": self._step, "phase": self._phase})

    def _on_command(self, msg: dict[str, Any]) -> None:
        cmd = msg.get("cmd")
        if cmd == "stacks":
            reply: dict[str, Any] = {"t": "stacks", "id": msg.get("id"), "text": dump_stacks()}
            fr = flight_recorder_dump()
            if fr:
                reply["flight_recorder_b64"] = base64.b64encode(fr).decode()
            self._send(reply)
        elif cmd == "stop":
            accepted = self.stop.request()
            self._send({"t": "stop_ack", "supported": accepted, "step": self._step})
            if accepted or msg.get("release_holds"):
                # a held rank cannot reach the step end where the ranks agree to save: an operator's
                # stop (or a preemption) outranks a declared pause (the flag is set first, so the
                # released step sees it)
                self.faults.release()
        elif cmd == "fault":
            from ptops.faultinject.spec import Fault

            fault = Fault.from_dict(msg["fault"])
            if self.faults.add(fault):
                self._send({"t": "fault_armed", "fault": str(fault)})
        elif cmd == "profile":
            self.profile.start(
                str(msg.get("id") or ""), int(msg.get("start_step", 0)), int(msg.get("steps", 1))
            )

    def _on_eof(self) -> None:
        if self._closing:
            return
        # The supervisor is gone (killed, or its host is): do not outlive it.
        try:
            os.write(
                2, f"[ptops.probe rank {self.rank}] supervisor channel closed; exiting\n".encode()
            )
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)


class StopProtocol:
    """Save-on-request (``probe.stop``): the supervisor's ``stop`` command sets the request; an
    adapter that can save on demand has accepted requests once and polls :attr:`requested` at
    each step end."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self.accepted = False

    def accept(self) -> None:
        self.accepted = True

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self) -> bool:
        """The supervisor asks (channel thread); True when the adapter will save and return."""
        self._requested.set()
        return self.accepted


def _keepalive(sock: socket.socket) -> None:
    """Notice a vanished supervisor host within ~1 minute even without a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    except OSError:
        pass
