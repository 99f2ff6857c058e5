"""The lines ptops writes into a rank's log (``logs/attempt-N/rank-R.log``): one format.

Why here: the rank's log is part of the run record, and every rank-side part (the probe, the
engine adapters, the asset cache, the warm pool) may import ``ops/runrecord``. A line reads
``[ptops.COMPONENT rank R] message`` (``rank R`` from torchrun's ``RANK``; absent outside a rank),
so ``grep '\\[ptops\\.'`` finds what ptops said among the engine's own output. Lines go to stderr,
looked up at each write: the rank entry point redirects the descriptors after loggers exist.
The handler sits on the ``ptops.rank`` logger, so a part that may not import ptops
(``faultinject``'s injectors) logs through ``logging.getLogger("ptops.rank.faultinject")`` and
gets the same format.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "[ptops.%(component)s%(rank)s] %(message)s"
PARENT = "ptops.rank"  # not "ptops": the supervisor's own loggers (exporters) keep their set-up


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is now (tests capture it; ranks redirect it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Rank(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        record.rank = f" rank {rank}" if rank is not None else ""
        record.component = record.name.removeprefix(PARENT + ".")
        return True


def get(component: str) -> logging.Logger:
    """The logger of COMPONENT; the first call sets up their parent: INFO, the one format."""
    root = logging.getLogger(PARENT)
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(_Rank())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # the engine's root handlers would print it a second time
    return logging.getLogger(f"{PARENT}.{component}")
