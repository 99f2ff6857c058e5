"""A forked child shows its own run in ``/proc/PID/environ``.

Why: the supervisor's sweeps find a run's processes by ``PTOPS_RUN_DIR`` in ``/proc/PID/environ``
(``ops/supervisor/procs.py``), and the kernel shows there the environment block the process was
exec'd with, not what ``os.environ`` holds later. A standing pool's children (``ptops warm``) are
forked, never exec'd: they would show the pool's block, which names no run, and every sweep (no
orphans after a run, a chaos scenario's check) would miss them. So the pool is started with a blank
variable (:data:`SLOT`, :data:`SIZE` bytes) and a child overwrites that string, in its own copy of
the block, with its run's ``PTOPS_RUN_DIR=...`` (as setproctitle rewrites argv). Nothing else in
the block changes; ``os.environ`` is untouched.
"""

from __future__ import annotations

import ctypes

from ptops import envnames

SLOT = envnames.ENVIRON_SLOT
SIZE = 4096


def blank() -> dict[str, str]:
    """The variable a pool is started with."""
    return {SLOT: "." * SIZE}


def find() -> tuple[int, int] | None:
    """Address and length of this process' :data:`SLOT` string in its exec environment block, or
    None. Call it before ``os.environ`` is cleared (libc then forgets where the string is)."""
    libc = ctypes.CDLL(None)
    env = ctypes.cast(ctypes.c_void_p.in_dll(libc, "environ"), ctypes.POINTER(ctypes.c_void_p))
    prefix = SLOT.encode() + b"="
    i = 0
    while env[i]:
        s = ctypes.string_at(env[i])  # up to its NUL: never past the block
        if s.startswith(prefix):
            return env[i], len(s)
        i += 1
    return None


def write(slot: tuple[int, int] | None, var: str, value: str) -> bool:
    """Put ``var=value`` where the slot was (padded with NULs: empty entries to any reader of
    ``/proc/PID/environ``); False when there is no slot or it is too short."""
    if slot is None:
        return False
    addr, size = slot
    text = f"{var}={value}".encode()
    if len(text) >= size:
        return False
    ctypes.memmove(addr, text + b"\0" * (size - len(text)), size)
    return True
