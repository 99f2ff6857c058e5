"""Background read-back verification of committed checkpoints.

Why: a checkpoint damaged after its commit (a bad disk, a bit flip, a truncated copy) would
otherwise be found only at the restart that needs it, when the run must fall back further and redo
more steps. The saving rank hands each commit to one background thread that reads it back
(``verify``: the manifest's hashes), so corruption is reported within one checkpoint interval, off
the training thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from .verify import verify

# (step, path, ok, reason, verify_s)
OnResult = Callable[[int, Path, bool, str, float], None]


class BackgroundVerifier:
    """One thread verifying the checkpoints handed to ``submit``; a newer commit replaces one still
    waiting (the newest is what a restart would use). ``on_result`` hears every verdict, from the
    thread. A checkpoint pruned by retention before or while it is read is not reported."""

    def __init__(self, on_result: OnResult, deep: bool = True) -> None:
        self._on_result = on_result
        self._deep = deep
        self._cv = threading.Condition()
        self._next: tuple[int, Path] | None = None
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self.results: list[tuple[int, bool, str]] = []

    def submit(self, step: int, path: str | Path) -> None:
        with self._cv:
            if self._closed:
                return
            self._next = (int(step), Path(path))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ptops-ckpt-verify", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._next is None and not self._closed:
                    self._cv.wait()
                if self._next is None:
                    return
                step, path = self._next
                self._next = None
                self._busy = True
            try:
                self._one(step, path)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _one(self, step: int, path: Path) -> None:
        if not path.exists():
            return
        t = time.monotonic()
        try:
            res = verify(path, deep=self._deep)
            ok, reason = bool(res.ok), ("" if res.ok else res.reason)
        except Exception as e:  # a verifier bug must not end training
            ok, reason = False, f"verify raised {type(e).__name__}: {e}"
        if not path.exists():
            return  # pruned while being read
        self.results.append((step, ok, reason))
        try:
            self._on_result(step, path, ok, reason, time.monotonic() - t)
        except Exception:  # reporting must not kill the thread
            pass

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or being verified; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._next is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.5))
        return True

    def close(self, timeout: float) -> None:
        """Let the last submitted verification finish (bounded), then stop the thread."""
        self.wait_idle(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
