"""Asynchronous DCP save with ptops' commit protocol.

`AsyncCheckpointer.save(state_dict, step)` blocks only while DCP stages the state
(copies tensors to CPU memory and plans the save); the write, then, on the coordinator
rank, `write_manifest` -> `commit` (LATEST) -> `prune`, run in the background. At most one
save is in flight: the next `save` (or `wait`) first waits for the previous one.

Every rank calls `save` with its (possibly sharded) state dict; rank 0 additionally
writes the `.writing` marker, the manifest and LATEST, so the run directory must be on
a filesystem all ranks share. With gloo, pass a dedicated `process_group` (e.g.
`dist.new_group(backend="gloo")`) so the background collectives do not interleave with
the training ones.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .manifest import commit, mark_writing, write_manifest
from .retention import prune


@dataclass
class SaveRecord:
    step: int
    path: str
    blocking_s: float
    total_s: float = 0.0
    ok: bool = False
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class AsyncCheckpointer:
    def __init__(
        self,
        checkpoints_root: str | os.PathLike,
        *,
        versions: dict[str, str] | None = None,
        keep_last: int | None = None,
        keep_every: int = 0,
        process_group: Any = None,
        on_commit: Callable[[SaveRecord], None] | None = None,
        async_mode: bool = True,
    ):
        self.root = Path(checkpoints_root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.versions = dict(versions or {})
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.pg = process_group
        self.on_commit = on_commit
        self.async_mode = async_mode
        self._pending: Any = None
        self._done = threading.Event()
        self._done.set()
        self.records: list[SaveRecord] = []
        self._raised: set[int] = set()

    # -- helpers ------------------------------------------------------------
    def _rank_ws(self) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.pg), dist.get_world_size(self.pg)
        return 0, 1

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{int(step)}"

    def _finish(self, rec: SaveRecord, t0: float, exc: BaseException | None) -> None:
        rank, ws = self._rank_ws()
        try:
            if exc is not None:
                raise exc
            if rank == 0:
                write_manifest(rec.path, rec.step, ws, self.versions)
                commit(self.root, rec.path)
                if self.keep_last:
                    prune(self.root, keep_last=self.keep_last, keep_every=self.keep_every, min_age_s=0)
            rec.ok = True
        except BaseException as e:  # noqa: BLE001 - reported in the record, raised by wait()
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            rec.total_s = time.perf_counter() - t0
            self._done.set()
            if self.on_commit is not None and rank == 0:
                try:
                    self.on_commit(rec)
                except Exception:  # noqa: BLE001 - a failing callback must not kill the saver
                    pass

    # -- API ----------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], step: int) -> SaveRecord:
        """Start saving `state_dict` as `step-N/`. Returns once the state is staged
        (`blocking_s`); `wait()` or the next `save()` reports how it ended."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        rank, _ = self._rank_ws()
        path = self.path_for(step)
        t0 = time.perf_counter()
        if rank == 0:
            mark_writing(path)
        import torch.distributed as dist

        no_dist = not (dist.is_available() and dist.is_initialized())
        if not no_dist:
            dist.barrier(group=self.pg)  # the marker exists before any rank writes
        rec = SaveRecord(step=int(step), path=str(path), blocking_s=0.0)
        self.records.append(rec)
        self._done.clear()
        if not self.async_mode:
            try:
                dcp.save(state_dict, checkpoint_id=str(path), process_group=self.pg, no_dist=no_dist)
                rec.blocking_s = time.perf_counter() - t0
                self._finish(rec, t0, None)
            except BaseException as e:  # noqa: BLE001
                rec.blocking_s = time.perf_counter() - t0
                self._finish(rec, t0, e)
            return rec
        fut = dcp.async_save(state_dict, checkpoint_id=str(path), process_group=self.pg, no_dist=no_dist)
        if hasattr(fut, "upload_completion"):
            fut = fut.upload_completion
        rec.blocking_s = time.perf_counter() - t0

        def _cb(f):
            exc = f.exception()
            # manifest hashing must not run on DCP's writer thread if it is shared; a thread is cheap
            threading.Thread(target=self._finish, args=(rec, t0, exc), daemon=True).start()

        self._pending = fut
        fut.add_done_callback(_cb)
        return rec

    def wait(self, timeout: float | None = None) -> SaveRecord | None:
        """Wait for the in-flight save (write + manifest + commit + prune). Raises
        RuntimeError if it failed; returns its record (None if nothing was saved)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save still running after {timeout}s")
        self._pending = None
        if not self.records:
            return None
        rec = self.records[-1]
        if rec.error and rec.step not in self._raised:
            self._raised.add(rec.step)
            raise RuntimeError(f"checkpoint step {rec.step} failed: {rec.error}")
        return rec

    def close(self) -> None:
        self.wait()
