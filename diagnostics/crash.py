"""A crashed rank in words: the signal or exit code, who sent a SIGKILL when that can be known,
the Python exception and NCCL/CUDA errors in its log, and the log's last lines.

SIGKILL by the kernel's OOM killer and SIGKILL by a person or another process look the same in
an exit code (-9). What can really tell them apart, checked in this order:

1. a ``fault_injected`` event of the same rank and attempt (ptops' own ``crash`` fault sent it);
2. the rank's log: an ``OutOfMemoryError``/``MemoryError`` (Python-level, not a SIGKILL at all);
3. the kernel log (``/var/log/kern.log``, ``/dev/kmsg``) naming the rank's pid as killed by the
   OOM killer, when it is readable, the pid is known and the run ran on this host (not naming it:
   probably a person or another process);
4. the cgroup's ``memory.events`` ``oom_kill`` counter (this host, this cgroup; cumulative, so it is
   evidence, not proof).

Otherwise the cause is reported as unknown, with what was checked.
"""

from __future__ import annotations

import re
import signal as _signal
from pathlib import Path
from typing import Any

_EXC = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?P<type>(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Warning)):?\s?(?P<msg>.*)$"
)
_PATTERNS = (
    ("CUDA out of memory", "GPU memory exhausted (CUDA OOM)"),
    ("OutOfMemoryError", "out of memory (torch.OutOfMemoryError)"),
    ("NCCL error", "NCCL error"),
    ("ncclInternalError", "NCCL internal error"),
    ("ncclUnhandledCudaError", "NCCL saw a CUDA error"),
    ("ncclSystemError", "NCCL system error (network / shared memory)"),
    ("Watchdog caught collective operation timeout", "NCCL watchdog: a collective timed out"),
    ("illegal memory access", "CUDA illegal memory access"),
    ("CUDA error", "CUDA error"),
    ("uncorrectable ECC error", "GPU ECC error (hardware)"),
    ("Connection closed by peer", "a peer rank went away (gloo connection closed)"),
    ("Connection reset by peer", "a peer rank went away (connection reset)"),
    ("No space left on device", "disk full (ENOSPC)"),
)
LOG_TAIL = 10


def signal_words(code: int | None) -> tuple[str, int | None]:
    """('exit code 1' | 'killed by SIGKILL (signal 9)', signal number or None). torchrun writes a
    signal as a negative code; shells as 128+N."""
    if code is None:
        return "exit code unknown", None
    sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
    if sig is not None:
        try:
            name = _signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name} (signal {sig}, exit code {code})", sig
    if code == 0:
        return "exited 0 (cleanly, but before the end)", None
    return f"exited with code {code}", None


def _tail(path: Path, n: int = 400) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64_000))
            data = f.read().decode(errors="replace")
    except OSError:
        return []
    return data.splitlines()[-n:]


def log_evidence(log: Path) -> dict[str, Any]:
    """Exception, error patterns and the last lines of one rank log."""
    lines = _tail(log)
    exc = None
    for ln in reversed(lines):
        m = _EXC.match(ln.strip())
        if m and not m.group("type").endswith("Warning"):
            exc = {"type": m.group("type"), "message": m.group("msg").strip()[:300]}
            break
    patterns = []
    text = "\n".join(lines)
    for needle, words in _PATTERNS:
        if needle in text and words not in patterns:
            patterns.append(words)
    return {
        "log": str(log),
        "exists": log.is_file(),
        "exception": exc,
        "patterns": patterns,
        "last_lines": [ln[:240] for ln in lines[-LOG_TAIL:]],
    }


def _kernel_oom(pids: set[int]) -> tuple[bool | None, str]:
    """(pid named by the OOM killer?, what was read). None when no kernel log could be read or no
    pid is known."""
    if not pids:
        return None, "kernel log not searched: the rank's pid is not recorded for that attempt"
    for src in (Path("/var/log/kern.log"), Path("/dev/kmsg")):
        try:
            if src.name == "kmsg":
                import os

                fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK)
                chunks = []
                try:
                    while True:
                        try:
                            chunks.append(os.read(fd, 8192).decode(errors="replace"))
                        except BlockingIOError:
                            break
                        except BrokenPipeError:  # records overwritten while reading: go on
                            continue
                finally:
                    os.close(fd)
                text = "".join(chunks)
            else:
                text = "\n".join(_tail(src, 5000))
        except OSError:
            continue
        for ln in text.splitlines():
            if "Killed process" in ln or "oom-kill" in ln:
                for pid in pids:
                    if re.search(rf"\b(pid=|process ){pid}\b", ln):
                        return True, f"{src}: {ln.strip()[:200]}"
        return False, f"{src} read: no OOM kill of pid {', '.join(map(str, sorted(pids))) or '?'}"
    return None, "kernel log not readable (no /var/log/kern.log, /dev/kmsg denied)"


def _cgroup_oom_kills() -> tuple[int | None, str]:
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]
        path = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events"
        for ln in path.read_text().splitlines():
            k, _, v = ln.partition(" ")
            if k == "oom_kill":
                return int(v), f"{path}: oom_kill {v}"
    except (OSError, IndexError, ValueError):
        pass
    return None, "cgroup memory.events not readable"


def explain(
    run_dir: Path,
    crash: dict[str, Any],
    events: list[dict[str, Any]],
    *,
    same_host: bool,
    pids: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Everything known about one ``crash`` event: words, cause of a SIGKILL, log evidence."""
    attempt, rank = crash.get("attempt"), crash.get("rank")
    code = crash.get("exit_code") if isinstance(crash.get("exit_code"), int) else None
    words, sig = signal_words(code)
    log = run_dir / "logs" / f"attempt-{attempt}" / f"rank-{rank}.log"
    ev = log_evidence(log)
    injected = [
        e
        for e in events
        if e.get("kind") == "fault_injected"
        and e.get("rank") == rank
        and e.get("attempt") in (attempt, None)
        and str(e.get("fault", "")).split(":")[0] in ("crash", "oom", "hang", "enospc")
    ]
    checked: list[str] = []
    cause = None
    if injected:
        cause = f"an injected fault: {injected[-1].get('fault')} (ptops sent it, not the kernel)"
    elif ev["exception"] and ev["exception"]["type"].split(".")[-1] in (
        "OutOfMemoryError",
        "MemoryError",
    ):
        cause = f"out of memory in Python ({ev['exception']['type']})"
    elif sig == _signal.SIGKILL:
        if same_host:
            hit, note = _kernel_oom({p for p in (pids or {}).values() if p} or set())
            checked.append(note)
            n, note2 = _cgroup_oom_kills()
            checked.append(note2)
            if hit:
                cause = "the kernel OOM killer (kernel log names the rank's pid)"
            elif n:
                cause = (
                    f"probably the OOM killer: this cgroup counts {n} OOM kill(s) (not tied "
                    "to the pid)"
                )
            elif hit is False:
                cause = (
                    "probably not the OOM killer (the kernel log does not name the pid): a "
                    "person, the "
                    "scheduler or another process sent SIGKILL"
                )
        else:
            checked.append(
                "run directory from another host: kernel log and cgroup counters not applicable"
            )
        if cause is None:
            cause = (
                "cause unknown: SIGKILL from the OOM killer or from a person/another process "
                "cannot be told apart with "
                "what is readable here"
            )
    elif sig is not None:
        cause = {
            int(
                _signal.SIGTERM
            ): "SIGTERM: asked to stop (scheduler preemption, a person, or the supervisor)",
            int(
                _signal.SIGSEGV
            ): "SIGSEGV: a crash in native code (driver, extension, memory corruption)",
            int(_signal.SIGABRT): "SIGABRT: native code aborted (a failed check in C++/CUDA/NCCL)",
            int(_signal.SIGBUS): "SIGBUS: bad memory mapping (often /dev/shm full)",
        }.get(sig)
    elif ev["exception"]:
        cause = f"Python exception {ev['exception']['type']}"
    return {
        "words": words,
        "signal": sig,
        "cause": cause,
        "checked": checked,
        "injected": [e.get("fault") for e in injected],
        **ev,
    }
