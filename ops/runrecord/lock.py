"""One supervisor per run directory: ``flock`` on ``RUN_DIR/supervisor.lock``.

The lock dies with its holder (the kernel drops it when the process exits, even
on SIGKILL), so a dead supervisor never blocks the next one.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class LockedError(Exception):
    """Another live supervisor holds this run directory."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / "supervisor.lock"


def acquire(run_dir: Path, wait_s: float = 1.0) -> int:
    """Take the lock; returns the fd to keep open. Raises :class:`LockedError` with one clear
    line."""
    path = lock_path(run_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                try:
                    holder = os.pread(fd, 64, 0).decode().strip() or "?"
                except OSError:
                    holder = "?"
                os.close(fd)
                raise LockedError(
                    f"{run_dir}: already supervised by pid {holder} ({path} is locked); "
                    f"watch it with `ptops status {run_dir}` or stop that supervisor first"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    os.set_inheritable(fd, False)
    return fd


def holder(run_dir: Path) -> int | None:
    """Pid of the live supervisor holding the lock, None when no one holds it."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(os.pread(fd, 64, 0).decode().strip() or 0) or -1
            except (OSError, ValueError):
                return -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
