"""``ptops warm [ENGINE...]``: standing warm pools, so launches skip the import of torch and the
engine.

Why: on a workstation (and in this project's test session) most of a small launch is each rank
importing torch and TorchTitan or TRL (~10 CPU-s per rank here). A standing pool imports once and
forks the ranks of every launch whose environment names it (``PTOPS_STANDING_POOL``), the first
attempt included (``ops/rank/warm.py``, ``ops/supervisor/warmpool.py``). A launch whose interpreter,
ptops, engine or import-time environment differ from the pool's starts cold and its ``launch``
event says why (``cold_why: standing_pool_differs``). ``launch --dry-run`` forks its model build
from the pool too (``ops/rank/warmrun.py``).

Runs in the foreground until Ctrl-C / SIGTERM (the pools die with it). Exit codes: 0 = stopped by a
signal; 1 = a pool exited (its log is named); 2 = bad input (an unknown engine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ptops import envnames
from ptops.ops.cli.errors import fail

DEFAULT_NAME = "ptops-standing"


def pool_command(name: str, engine: str) -> list[str]:
    from ptops.ops.rank.warm import standing_name

    return [sys.executable, "-P", "-m", "ptops.ops.rank.warm", standing_name(name, engine), engine]


def start_pools(
    name: str, engines: list[str], omp_num_threads: int, log_dir: Path
) -> dict[str, subprocess.Popen]:
    """One pool process per engine, importing under the environment every rank gets."""
    from ptops.ops.rank import environslot
    from ptops.ops.supervisor.launcher import rank_constants

    env = {**os.environ, **rank_constants(omp_num_threads), **environslot.blank()}
    env.pop(envnames.STANDING_POOL, None)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for engine in engines:
        with open(log_dir / f"{name}-{engine}.log", "ab") as log:
            procs[engine] = subprocess.Popen(
                pool_command(name, engine),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    return procs


def wait_ready(
    name: str, procs: dict[str, subprocess.Popen], timeout_s: float, say=None, stop=None
) -> dict[str, dict]:
    """Each pool's identity once it answers; raises ``RuntimeError`` naming the first pool that
    exited or did not answer within ``timeout_s`` (or when ``stop()`` says so)."""
    from ptops.ops.rank.warm import describe, standing_name

    ready: dict[str, dict] = {}
    t0 = time.monotonic()
    while len(ready) < len(procs):
        for engine, proc in procs.items():
            if engine in ready:
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"the {engine} pool exited with code {proc.returncode}")
            try:
                ready[engine] = describe(standing_name(name, engine), timeout_s=2.0)
            except (OSError, ValueError):
                continue
            if say is not None:
                say(f"ready: {engine} (pid {proc.pid}) after {time.monotonic() - t0:.1f} s")
        if stop is not None and stop():
            raise RuntimeError("stopped before the pools were ready")
        if time.monotonic() - t0 > timeout_s:
            late = sorted(set(procs) - set(ready))
            raise RuntimeError(f"no answer from the {', '.join(late)} pool in {timeout_s:.0f} s")
        time.sleep(0.2)
    return ready


def warm_cmd(
    engines: Annotated[
        Optional[list[str]],
        typer.Argument(help="Engines to keep warm (default: titan and trl, those installed)."),
    ] = None,
    name: Annotated[
        str,
        typer.Option("--name", help="Pool name: each engine's pool listens at NAME-ENGINE."),
    ] = DEFAULT_NAME,
    omp_num_threads: Annotated[
        int,
        typer.Option(
            "--omp-num-threads",
            min=1,
            help="OpenMP threads of the forked ranks (read once, at import): launches whose "
            "launch.omp_num_threads differs start cold.",
        ),
    ] = 1,
    log_dir: Annotated[
        Path, typer.Option("--log-dir", help="Where each pool writes NAME-ENGINE.log.")
    ] = Path("runs/warm"),
    json_out: Annotated[
        bool, typer.Option("--json", help="Once all are ready, print their identities as JSON.")
    ] = False,
) -> None:
    """Keep torch and the engines imported, and fork the ranks of every launch that names the pool.

    In one shell: `ptops warm titan trl`. In another: `export PTOPS_STANDING_POOL=ptops-standing`,
    then `ptops launch titan-tiny --supervise`: its `launch` events say `ranks_from: warm` and
    `standing_pool`. A pool serves only launches with its own python, ptops, engine and
    import-time environment; others start cold and say why. Ctrl-C stops the pools.
    """
    from ptops.recipes.engines import engines as registered

    known = registered()
    wanted = engines or [e for e in ("titan", "trl") if e in known]
    for engine in wanted:
        if engine not in known:
            fail(f"unknown engine {engine!r}: expected one of {', '.join(sorted(known))}")

    def say(msg: str) -> None:
        print(f"[ptops warm] {msg}", file=sys.stderr, flush=True)

    procs = start_pools(name, wanted, omp_num_threads, log_dir)
    stop = {"sig": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    say(f"importing {', '.join(wanted)} (logs in {log_dir}/)")
    code = 0
    try:
        ready = wait_ready(name, procs, 600, say, lambda: bool(stop["sig"]))
        if json_out:
            print(json.dumps({"name": name, "pools": ready}), flush=True)
        say(f"serving; in another shell: export PTOPS_STANDING_POOL={name}")
        while not stop["sig"]:
            gone = [e for e, p in procs.items() if p.poll() is not None]
            if gone:
                say(f"the {gone[0]} pool exited: see {log_dir}/{name}-{gone[0]}.log")
                code = 1
                break
            time.sleep(0.5)
    except RuntimeError as e:
        say(str(e))
        code = 1
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("warm")(warm_cmd)
