"""Run one of ptops's own engine-side modules (a dry run) as a child of a standing warm pool.

Why: ``ptops launch RECIPE --dry-run`` builds the model in a subprocess so torch and the engine stay
out of the CLI; that subprocess spends ~13 CPU-s importing them before a second of real work. A
standing pool (``ptops warm``) has them imported already: when the environment names one and it
fits (:func:`ptops.ops.rank.warm.fits`), the dry run is forked from it instead, with the same
argv, environment and working directory, its stdout and stderr on pipes read here. Only the
modules in :data:`ptops.ops.rank.warm.MODULES` are run this way; anything else is a rank.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

from ptops import envnames
from ptops.ops.rank.warm import fits, request, standing_name


def standing_pool(engine: str, env: dict[str, str]) -> str:
    """The name of the standing pool for ``engine`` a process with ``env`` may be forked from, or
    "" (none named, none answers, or it imported under another interpreter, ptops or env)."""
    name = env.get(envnames.STANDING_POOL, "")
    if not name:
        return ""
    pool = standing_name(name, engine)
    why, _ = fits(pool, engine, env)
    return "" if why else pool


def run_module(
    pool: str, module: str, args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``python -m module *args`` forked from ``pool``; its output captured like
    ``subprocess.run(capture_output=True, text=True)``. Raises ``OSError`` / ``ValueError`` /
    ``KeyError`` when the pool starts no child, ``subprocess.TimeoutExpired`` after ``timeout``
    seconds (the child is gone then: the pool kills a child whose requester hung up)."""
    argv = [module, *args]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        conn, reader, _child = request(pool, env, argv, (null, out_w, err_w), module)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    deadline = time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    live, status = {out_r, err_r}, None
    try:
        while live or status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout)
            watch = [*live, *([conn] if status is None else [])]
            for fd in select.select(watch, [], [], left)[0]:
                if fd is conn:
                    line = reader.readline()
                    status = int(json.loads(line)["status"]) if line else -1
                elif data := os.read(fd, 65536):
                    chunks[fd].append(data)
                else:
                    live.discard(fd)
    finally:
        conn.close()
        os.close(out_r)
        os.close(err_r)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return subprocess.CompletedProcess(argv, _code(status), out, err)


def _code(status: int | None) -> int:
    if status is None or status < 0:
        return 1  # the pool died before it reported
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
