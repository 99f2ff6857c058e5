"""The caller's side of an exporter that writes in a background thread behind a bounded queue.

MLflow and W&B can be slow or down; training and the supervisor must never wait for them. The caller
only enqueues (``observe_metric`` / ``observe_event``): a full queue drops the record and counts it
(``dropped``). A subclass writes in ``_main``, reading ``self._q`` until it gets :data:`STOP`;
:data:`FINALIZE` follows every run-ending event so it can write its end-of-run summary.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from ptops.ops.runrecord.events import END_KINDS

STOP = object()
FINALIZE = object()


class QueuedExporter:
    close_timeout_s = 10.0
    run_dir: Path  # set by the subclass before ``__init__``

    def __init__(self, queue_size: int, thread_name: str) -> None:
        """Call last in the subclass's ``__init__``: it starts ``_main``."""
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        raise NotImplementedError

    def _recipe(self) -> dict:
        """The run's recipe as recorded (``recipe.json``), or {} when it is missing or
        unreadable."""
        try:
            return json.loads((self.run_dir / "recipe.json").read_text())
        except (OSError, ValueError):
            return {}

    def _put(self, item: Any) -> bool:
        try:
            self._q.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def observe_metric(self, record: Mapping[str, Any]) -> None:
        """Rank 0's records only: one curve per run, as a dashboard reads it."""
        if self._closed:
            return
        try:
            if int(record.get("rank", 0) or 0) != 0:
                return
        except (TypeError, ValueError):
            return
        self._put(("metric", dict(record)))

    def observe_event(self, event: Mapping[str, Any]) -> None:
        if self._closed:
            return
        self._put(("event", dict(event)))
        if event.get("kind") in END_KINDS:
            self._put(FINALIZE)

    def close(self, timeout: float | None = None) -> bool:
        """Flush and stop within ``timeout`` seconds; True when everything queued was written."""
        if not self._closed:
            self._closed = True
            deadline = time.monotonic() + (self.close_timeout_s if timeout is None else timeout)
            while True:  # the stop marker must get in even if the queue is full
                try:
                    self._q.put(STOP, timeout=0.05)
                    break
                except queue.Full:
                    if time.monotonic() > deadline:
                        break
            self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive() and self.errors == 0
