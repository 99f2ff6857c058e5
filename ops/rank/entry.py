"""Entry point of every rank: ``python -m ptops.ops.rank.entry`` under torchrun.

The launcher writes the resolved recipe to ``RUN_DIR/recipe.json`` and sets
``PTOPS_RUN_DIR`` and ``PTOPS_ATTEMPT``; each rank sends its own output to
``logs/attempt-K/rank-R.log`` so that two ranks never interleave in one file.

No orphans: each rank asks the kernel for SIGKILL when its parent (the torchrun
agent) dies (``PR_SET_PDEATHSIG``), checks that the parent did not die before
that, and keeps a watchdog thread that exits when the parent changes. Under a
supervisor the probe also dies when the supervisor's channel closes. SIGUSR1
makes faulthandler write every thread's stack to ``logs/attempt-K/rank-R.stacks``
(the supervisor's fallback when a rank cannot answer over the channel), and the
supervisor (pid in ``PTOPS_SUPERVISOR_PID``) may ptrace this rank for py-spy.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ptops import envnames
from ptops.ops.runrecord import ranklog

PR_SET_PDEATHSIG = 1
PR_SET_PTRACER = 0x59616D61


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies (Linux), plus a polling watchdog for other
    kernels."""
    parent = os.getppid() if expected_parent is None else expected_parent
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.write(2, b"[ptops.entry] parent process gone; exiting\n")
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ptops-parent-watchdog", daemon=True).start()


def _redirect_output(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _stack_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    f = os.fdopen(fd, "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    _stack_file.keep = f  # type: ignore[attr-defined]  # keep the file open for the process' life


def main() -> None:
    die_with_parent()
    from ptops.ops.rank import warm

    # a warm pool (engine already imported) runs this rank and we mirror it; else cold
    warm.handoff()
    run_rank()


def run_rank() -> None:
    """This rank's life, in this process (cold) or in a warm pool's child (``ops/rank/warm.py``)."""
    # Yama: let the supervisor (py-spy) read our stacks; on a node of a multi-node run, the node
    # agent
    tracer = int(
        os.environ.get(envnames.PTRACER_PID) or os.environ.get(envnames.SUPERVISOR_PID) or 0
    )
    if tracer:
        _prctl(PR_SET_PTRACER, tracer)

    from ptops.ops.rank.probe import Probe, attempt_from_env
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.recipes.schema import from_json

    run = RunDir(Path(os.environ[envnames.RUN_DIR]))
    rank = int(os.environ.get("RANK", "0"))
    attempt = attempt_from_env()
    if os.environ.get(envnames.RANK_LOGS, "1") == "1":
        _redirect_output(run.rank_log(attempt, rank))
    _stack_file(run.logs(attempt) / f"rank-{rank}.stacks")
    from ptops.ops.rank.warm import WARM_LINE

    if os.environ.get(envnames.WARM_POOL):
        ranklog.get("entry").info(WARM_LINE.format(pool=os.environ[envnames.WARM_POOL]))
    recipe = from_json(run.recipe_json.read_text())
    probe = Probe.from_env()
    try:
        # what follows is the engine's import (torch, torchtitan, transformers); misrendezvous acts
        # here
        probe.startup("import")
        probe.faults.on_startup("import")  # misrendezvous rewrites the env before the import
        from ptops.recipes.engines import entry_point

        entry_point(recipe.engine)(recipe, probe)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        probe.close(code, None if code == 0 else f"SystemExit({e.code!r})")
        raise
    except BaseException as e:
        probe.close(1, f"{type(e).__name__}: {e}"[:2000], user_traceback(e))
        raise
    probe.close(0)
    _exit_done()


# the frames of ptops' own harness around the user's code: the rank's entry, the engine adapters,
# runpy and the import machinery
_HARNESS = tuple(str(Path(__file__).resolve().parents[i]) + os.sep for i in (0, 1))  # ops/rank, ops
_ADAPTERS = str(Path(__file__).resolve().parents[2] / "recipes") + os.sep


def _harness(filename: str) -> bool:
    if filename.startswith("<frozen") or Path(filename).name == "runpy.py":
        return True
    path = os.path.abspath(filename)
    return path.startswith((*_HARNESS, _ADAPTERS))


def user_traceback(exc: BaseException, max_lines: int = 20, max_chars: int = 2000) -> str:
    """The short traceback the supervisor prints when it gives up: the innermost frames from where
    the user's code starts (ptops' entry, the engine adapter, runpy left out), each with its file,
    line and source line, then the exception (a SyntaxError's file, line and caret). Outer frames go
    first to stay within ``max_lines`` / ``max_chars``. The rank log keeps the whole traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    start = next((i for i, f in enumerate(frames) if not _harness(f.filename)), len(frames))
    frames = traceback.StackSummary.from_list(frames[start:])
    tail = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n").splitlines()
    body = [ln for chunk in frames.format() for ln in chunk.rstrip("\n").splitlines()]
    head = ["Traceback (most recent call last):"] if body else []
    while body and (
        len(head) + len(body) + len(tail) > max_lines
        or sum(len(x) + 1 for x in (*head, *body, *tail)) > max_chars
    ):
        body = body[2:] if len(body) > 1 and body[1].startswith("    ") else body[1:]
        head = ["Traceback (most recent call last, outer frames left out):"]
    out = "\n".join([*head, *body, *tail])
    return out if len(out) <= max_chars else out[-max_chars:]


def _exit_done() -> None:
    """A finished rank leaves without the interpreter's teardown. Its work is committed and reported
    by now; what teardown adds is C++ destructors of torch's process-group threads, which once
    aborted a finished rank (SIGABRT, "terminate called without an active exception", fresh clone
    2026-11-30): torchrun then SIGTERMs its peers and a completed attempt turns into a crash and a
    restart."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
