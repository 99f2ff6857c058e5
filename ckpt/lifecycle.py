"""The checkpoint lifecycle, written once for every engine: where to resume, how a save
becomes a checkpoint, and what a failed save leaves behind.

Engine adapters (TorchTitan's DCP, TRL's HF Trainer) write the shards; everything
around the shards is here, so both adapters and the supervisor decide the same way:

* :func:`resume_point` -- the newest checkpoint that verifies; each newer invalid one is
  quarantined (moved to ``checkpoints/invalid/``, never deleted) and reported through
  ``on_invalid``. A complete save that was killed before its commit is *adopted*
  (manifest written, LATEST moved). When the supervisor already chose (``PTOPS_RESUME_FROM``
  in the rank's environment, see :data:`RESUME_ENV`), its choice is used without verifying
  again: a restart verifies a checkpoint once.
* :class:`SaveTransaction` -- ``begin`` (leader: leftover moved aside, ``.writing`` marker;
  all ranks agree nobody failed) -> the engine writes its shards -> ``commit`` (all ranks
  agree, leader writes the manifest, moves LATEST, prunes) or ``abort``.

The agreement between ranks is the adapter's (an all-reduce of a failure flag): this
module never imports torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from ._util import (
    DCP_RE,
    MANIFEST_NAME,
    TRL_RE,
    WRITING_MARKER,
    detect_kind,
    fsync_dir,
    step_from_name,
    walk_files,
)
from .catalog import Entry, _candidates, _mtime, _newest_first, checkpoints_dir, quarantine
from .manifest import ManifestError, commit, mark_writing, read_latest, write_manifest
from .retention import prune, sdc_rollback_steps
from .verify import verify

RESUME_ENV = "PTOPS_RESUME_FROM"
"""Set by the supervisor in every rank's environment: the checkpoint it verified for this
attempt (a path), or empty for a fresh start. Ranks trust it instead of verifying again."""

ABORTED = "aborted:"  # first word of a `.writing` marker left by SaveTransaction.abort

Agree = Callable[[bool], bool]
"""``agree(failed_here) -> failed_anywhere``: the same answer on every rank (e.g. an all-reduce
MAX)."""


# ---------------------------------------------------------------- layout


def is_writing(path: str | os.PathLike) -> bool:
    """A save of this folder started and has not been committed (``.writing`` marker)."""
    return (Path(path) / WRITING_MARKER).exists()


def checkpoint_path(ckpt_dir: str | os.PathLike, step: int) -> Path | None:
    """The folder of ``step``'s checkpoint (``step-N`` or ``checkpoint-N``) in a checkpoints
    folder or run directory, or None."""
    root = checkpoints_dir(ckpt_dir)
    for name in (f"step-{int(step)}", f"checkpoint-{int(step)}"):
        if (root / name).is_dir():
            return root / name
    return None


def shard_files(path: str | os.PathLike, rank: int | None = None) -> list[Path]:
    """Data files of a checkpoint, largest first (ptops' own files left out). With ``rank``,
    only that rank's own DCP shards (``__R_*.distcp``); empty for a layout without per-rank
    shards."""
    p = Path(path)
    files = [p / f for f in walk_files(p)]
    if rank is not None:
        files = [
            f for f in files if f.name.startswith(f"__{int(rank)}_") and f.name.endswith(".distcp")
        ]
    return sorted(files, key=lambda f: (f.stat().st_size, str(f)), reverse=True)


def _aborted(path: Path) -> str | None:
    try:
        text = (path / WRITING_MARKER).read_text()
    except OSError:
        return None
    return text[len(ABORTED) :].strip() or "save aborted" if text.startswith(ABORTED) else None


def _rng_missing(path: Path, world_size: int) -> list[str]:
    """TRL/HF: each rank writes its own ``rng_state_R.pth``; without a manifest nobody agreed
    that every rank finished, so the files say it."""
    names = (
        ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{r}.pth" for r in range(world_size)]
    )
    return [n for n in names if not (path / n).is_file()]


def _entry(path: Path, *, has_manifest: bool, reason: str = "") -> Entry:
    return Entry(
        step=step_from_name(path.name) or 0,
        path=str(path),
        kind=detect_kind(path),
        ok=True,
        reason=reason,
        has_manifest=has_manifest,
        mtime=_mtime(path),
    )


# ---------------------------------------------------------------- resume


def resume_point(
    ckpt_dir: str | os.PathLike,
    *,
    deep: bool = True,
    on_invalid: Callable[..., Any] | None = None,
    world_size: int | None = None,
    adopt: bool = True,
    versions: dict[str, str] | None = None,
    trust_env: bool = True,
) -> Entry | None:
    """The checkpoint to resume from: the newest that verifies (hashes with ``deep``).

    Call it when nobody writes (start of an attempt): a ``.writing`` marker then means a
    save was killed, and a killed save that is nevertheless complete (DCP ``.metadata``
    written, which happens after every rank's shards; TRL: every rank's RNG state) is
    adopted with ``adopt``: its manifest is written and LATEST moved to it. A save that
    failed (:meth:`SaveTransaction.abort`) is never adopted.

    Each newer checkpoint that does not verify is quarantined and reported as
    ``on_invalid(path=, reason=, moved_to=, step=)`` (``moved_to`` None when it could not
    be moved). TRL checkpoints without a manifest missing some rank's RNG state are used
    only when no other checkpoint is good (the world size changed).

    With ``trust_env`` and :data:`RESUME_ENV` set (by the supervisor, which verified it),
    that choice is returned without verifying; empty means a fresh start.
    """
    root = checkpoints_dir(ckpt_dir)
    if trust_env and RESUME_ENV in os.environ:
        chosen = os.environ[RESUME_ENV].strip()
        if not chosen:
            return None
        p = Path(chosen)
        if p.is_dir() and p.parent.resolve() == root.resolve():
            return _entry(
                p, has_manifest=(p / MANIFEST_NAME).exists(), reason="chosen by the supervisor"
            )
        # gone since (or another folder): decide here
    if not root.is_dir():
        return None

    fallback: Entry | None = None
    for p in _newest_first(_candidates(root)):
        aborted = _aborted(p)
        if aborted is not None:
            reason = f"{WRITING_MARKER}: save failed and was not committed ({aborted})"
        else:
            try:
                res = verify(p, deep=deep, ignore_writing_marker=True)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone since it was listed
            reason = res.reason
            if res.ok:
                missing = (
                    []
                    if res.has_manifest or res.kind != "trl" or not world_size
                    else _rng_missing(p, world_size)
                )
                if missing:
                    fallback = fallback or _entry(
                        p,
                        has_manifest=False,
                        reason=f"misses {', '.join(missing)}: RNG state of some ranks",
                    )
                    continue
                entry = _entry(p, has_manifest=res.has_manifest)
                if adopt:
                    _adopt(root, p, entry, world_size or 1, versions)
                return entry
        _quarantine_and_report(p, reason, on_invalid)
    return fallback


def _adopt(
    root: Path, p: Path, entry: Entry, world_size: int, versions: dict[str, str] | None
) -> None:
    """Commit a complete save killed before its commit; LATEST is advisory for the resume itself."""
    try:
        if not entry.has_manifest:
            write_manifest(p, entry.step, world_size, versions, extra={"adopted": True})
            entry.has_manifest = True
            commit(root, p, deep=False)
            entry.reason = "adopted: complete save killed before its commit"
        elif read_latest(root) != p or is_writing(p):
            commit(root, p, deep=False)  # clears the marker, moves LATEST
    except (OSError, ManifestError) as e:
        entry.reason = f"could not commit on resume: {e}"


def _quarantine_and_report(p: Path, reason: str, on_invalid: Callable[..., Any] | None) -> None:
    try:
        dest: Path | None = quarantine(p, reason)
    except OSError:
        dest = None
    if on_invalid is not None:
        on_invalid(
            path=str(p),
            reason=reason,
            moved_to=str(dest) if dest else None,
            step=step_from_name(p.name),
        )


# ---------------------------------------------------------------- save


def _err_text(err: Any) -> str:
    text = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else str(err)
    return text[:1000]


class SaveTransaction:
    """One save, the same steps for every engine::

        txn = SaveTransaction(root, step, name=f"step-{step}", leader=rank == 0,
                              agree=all_reduce_max, world_size=ws, versions=..., keep=3)
        if txn.begin(error_from_the_probe_hook):   # leader: leftover aside, `.writing`; all agree
            ... the engine writes txn.path ...
            txn.commit(error_while_writing)        # all agree, leader: manifest, LATEST, prune

    ``begin`` / ``commit`` return False on every rank alike when any rank failed (with
    ``agree``); ``txn.error`` then says why. A failed save (:meth:`abort`) leaves its
    folder as it is, with a ``.writing`` marker that says it was aborted and no manifest:
    LATEST never names it, retention never deletes it, and :func:`resume_point`
    quarantines it instead of resuming from it.

    ``commit(collective=False)``: the ranks no longer meet (a background save whose
    engine already gathered every rank's result before finishing on the leader); each
    rank commits (leader) or returns alone.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        step: int,
        *,
        name: str | None = None,
        leader: bool = True,
        agree: Agree | None = None,
        world_size: int = 1,
        versions: dict[str, str] | None = None,
        keep: int = 3,
        sdc_every: int = 0,
        replace_leftover: bool = True,
    ):
        self.root = Path(root)
        self.step = int(step)
        self.path = self.root / (name or f"step-{self.step}")
        if not (DCP_RE.match(self.path.name) or TRL_RE.match(self.path.name)):
            raise ValueError(f"{self.path.name!r}: a checkpoint folder is step-N or checkpoint-N")
        self.leader = leader
        self._agree = agree or (lambda failed: failed)
        self.world_size = int(world_size)
        self.versions = dict(versions or {})
        self.keep = max(1, int(keep))
        self.sdc_every = max(0, int(sdc_every))  # [monitors.sdc] every: what retention also keeps
        self.replace_leftover = replace_leftover
        self.t0 = time.monotonic()
        self.ok = False
        self.error: str | None = None
        self.moved_leftover: Path | None = None
        self.pruned: list[str] = []
        self.prune_error: str | None = None

    def begin(self, error: Any = None) -> bool:
        """Before any rank writes. ``error``: this rank already failed (e.g. ENOSPC from a hook)."""
        if error is None and self.leader:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if self.replace_leftover and self.path.exists():
                    self.moved_leftover = quarantine(
                        self.path, "leftover folder replaced by a new save of the same step"
                    )
                mark_writing(self.path)
            except OSError as e:
                error = e
        if self._agree(error is not None):
            self.abort(error or "failed on another rank before writing")
            return False
        return True

    def commit(self, error: Any = None, *, collective: bool = True) -> bool:
        """Every rank's shards are written (``error``: not on this rank). The leader writes the
        manifest (hashing every file), then moves LATEST, then prunes to ``keep``."""
        if collective and self._agree(error is not None):
            return self._fail(error or "save failed on another rank")
        if not collective and error is not None:
            return self._fail(error)
        cerr: Any = None
        if self.leader:
            try:
                write_manifest(self.path, self.step, self.world_size, self.versions)
                commit(self.root, self.path, deep=False)  # write_manifest just hashed every file
            except Exception as e:  # ManifestError, OSError (ENOSPC writing the manifest), ...
                cerr = e
        if collective and self._agree(cerr is not None):
            return self._fail(cerr or "commit failed on the leader rank")
        if cerr is not None:
            return self._fail(cerr)
        self.ok = True
        if self.leader:
            try:
                before = sdc_rollback_steps(self.step, self.sdc_every)
                self.pruned = prune(
                    self.root, keep_last=self.keep, keep_before=before, min_age_s=0
                ).deleted
            except Exception as e:  # retention failing is not a failed save
                self.prune_error = _err_text(e)
        return True

    def start(self, probe: Any = None) -> bool:
        """Every engine's opening of a save (one save path for all): ``probe.phase("checkpoint")``
        and ``probe.faults.on_checkpoint`` (an ``enospc`` fault raises OSError there), then
        :meth:`begin`, then ``probe.faults.in_save`` (``crash:phase=save``). False when the save
        cannot begin (every rank alike; :attr:`error` says why)."""
        err: Any = None
        try:
            if probe is not None:
                probe.phase("checkpoint", self.step)
                probe.faults.on_checkpoint(self.step)
        except OSError as e:
            err = e
        if not self.begin(err):
            return False
        if probe is not None:
            probe.faults.in_save(self.step)
        return True

    def finish(self, err: Any = None, probe: Any = None) -> bool:
        """Every synchronous save's close: ``probe.faults.before_commit`` (``slow-save`` waits
        there) when this rank wrote its part, then :meth:`commit`. (An async save commits on its
        own thread: ``recipes/titan/checkpointing.py``.)"""
        if err is None and probe is not None:
            probe.faults.before_commit(self.step)
        return self.commit(err)

    def run(self, write: Callable[[Path], Any], probe: Any = None) -> bool:
        """The whole synchronous save around an engine's ``write(self.path)``: :meth:`start`, the
        write (an exception is a failed save, not a crash), :meth:`finish`. The caller reports the
        outcome and moves the probe back to ``phase("step")`` (then
        ``probe.faults.after_checkpoint``). Returns :attr:`ok`."""
        if not self.start(probe):
            return False
        err: Any = None
        try:
            write(self.path)
        except Exception as e:  # OSError, the engine's own errors: a failed save, not a crash
            err = e
        return self.finish(err, probe)

    def _fail(self, error: Any) -> bool:
        self.abort(error)
        return False

    def abort(self, error: Any) -> str:
        """The save failed: nothing is committed. The leader drops a manifest it may have
        written and marks the folder aborted; LATEST keeps naming the previous checkpoint."""
        self.ok = False
        self.error = _err_text(error)
        if self.leader and self.path.is_dir() and read_latest(self.root) != self.path:
            try:
                (self.path / MANIFEST_NAME).unlink(missing_ok=True)
                (self.path / WRITING_MARKER).write_text(f"{ABORTED} {self.error}\n")
                fsync_dir(self.path)
            except OSError:
                # disk full: without a manifest it is at worst a killed save, adopted only if
                # complete
                pass
        return self.error


__all__ = [
    "RESUME_ENV",
    "Agree",
    "SaveTransaction",
    "checkpoint_path",
    "is_writing",
    "resume_point",
    "shard_files",
]
