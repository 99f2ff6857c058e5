"""Each rank of a ``[script]`` recipe: the user's command, supervised as ptops' own engines are.

A Python interpreter running a ``.py`` file (or ``-m module``, or ``-c code``) runs *in this rank
process* (``runpy``, ``sys.argv`` and ``sys.path[0]`` as ``python`` would set them, in ``cwd``), so
everything the rank entry set up applies to the script unchanged: the probe's liveness pings, stacks
on request and faulthandler's SIGUSR1 file, py-spy, the flight recorder, the per-rank log.

Without any change to the script, each optimizer step is a step, timed from the step before, and
its batches, backward passes, collectives and saves are progress (:mod:`.watch`: faults such as
``crash:step=S`` and ``hang:step=S`` fire at the step's ``step()``). Steps count from 1 in each
attempt, or from the step of a snapshot of its own the script loads back. Until the first step, the
script's own set-up is judged as the rank's ``import`` start-up section (``load`` while it loads a
file). A script that uses :mod:`ptops.rank` reports its own steps (the watch then stands aside) and
resumes exactly.

Any other program runs as a child process (in its own process group, killed with the rank):
crash detection and restarts apply, hang detection only through its exit (no stacks, no steps).
A script's exit status is the rank's; ``sys.exit(0)`` (or the end of the script) is a finished rank.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ptops.ops.runrecord import ranklog
from ptops.recipes.script.watch import ScriptWatch

_PYTHON_FLAGS_WITH_ARG = {"-W", "-X", "-Q"}


def python_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """("path" | "module" | "code", target, args) when ``argv`` is a Python interpreter running
    one."""
    prog = Path(argv[0]).name
    if not (prog.startswith("python") or argv[0] == sys.executable):
        return None
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(argv):
                return None
            return ("module" if a == "-m" else "code"), argv[i + 1], argv[i + 2 :]
        if a in _PYTHON_FLAGS_WITH_ARG:
            i += 2
            continue
        if a.startswith("-") and a != "-":
            i += 1  # -u, -O, -B...: one-word flags of the interpreter, which is already running
            continue
        return "path", a, argv[i + 1 :]
    return None


def _run_python(kind: str, target: str, args: list[str]) -> None:
    if kind == "path":
        path = str(Path(target).resolve())
        sys.argv = [target, *args]
        sys.path.insert(0, str(Path(path).parent))
        runpy.run_path(path, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        sys.path.insert(0, "")
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


def _run_child(argv: list[str]) -> None:
    """A non-Python program: its exit status is the rank's; it dies with the rank."""
    import ctypes

    def guard() -> None:
        os.setsid()
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    proc = subprocess.Popen(argv, preexec_fn=guard)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: os.killpg(proc.pid, s))
    rc = proc.wait()
    if rc != 0:
        raise SystemExit(rc if rc > 0 else 128 - rc)


def preload() -> None:
    """What a warm pool imports ahead of a script's rank (``ops/rank/warm.py``): torch with its
    distributed and checkpoint packages (``ptops.rank`` saves through DCP); the script's own
    imports still run in the rank."""
    import torch.distributed
    import torch.distributed.checkpoint  # noqa: F401


def main(recipe: Any, probe: Any) -> None:
    from ptops import rank as api

    sec = recipe.script
    os.environ.update(sec.env)
    if sec.cwd:
        os.chdir(sec.cwd)
    api._bind(probe, recipe)
    argv = list(sec.command)
    target = python_target(argv)
    ranklog.get("script").info(
        "running %s in %s (%s)",
        " ".join(argv),
        os.getcwd(),
        "in this process" if target else "as a child process",
    )
    try:
        if target is None:
            _run_child(argv)
        else:
            ScriptWatch(probe, api._reports_steps, probe.run.events).install()
            _run_python(*target)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        api._unbind()
