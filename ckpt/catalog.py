"""Catalog of a run's checkpoints: list, pick the newest good one, quarantine bad ones."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ._util import (
    INVALID_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    QUARANTINE_NOTE,
    atomic_write_bytes,
    atomic_write_json,
    dir_size,
    fsync_dir,
    step_from_name,
)
from .verify import verify


@dataclass
class Entry:
    step: int
    path: str
    kind: str
    ok: bool
    reason: str  # '' when ok, else "file: why"
    size_bytes: int = 0
    has_manifest: bool = False
    mtime: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def ref(self) -> dict:
        """``{step, path}``: how run records and status name a checkpoint."""
        return {"step": int(self.step), "path": str(self.path)}


def checkpoints_dir(path: str | os.PathLike) -> Path:
    """Accept a run directory (uses `<run>/checkpoints`) or a checkpoints folder."""
    p = Path(path)
    if (p / "checkpoints").is_dir() and not any(step_from_name(n) is not None for n in _ls(p)):
        return p / "checkpoints"
    return p


def _ls(p: Path) -> list[str]:
    try:
        return os.listdir(p)
    except OSError:
        return []


def _candidates(root: Path) -> list[Path]:
    out = []
    for n in _ls(root):
        if n == INVALID_DIR or n.startswith("."):
            continue
        if step_from_name(n) is not None and (root / n).is_dir():
            out.append(root / n)
    return out


def list_checkpoints(run_checkpoints_dir: str | os.PathLike, deep: bool = False) -> list[Entry]:
    """Every `step-N/` and `checkpoint-N/` in the folder, newest (highest step) first,
    each verified (``deep=False``: structure + manifest sizes; ``deep=True``: hashes).
    `checkpoints/invalid/` (quarantine) is not listed."""
    root = checkpoints_dir(run_checkpoints_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoints folder not found: {root}")
    entries = []
    for p in _candidates(root):
        r = verify(p, deep=deep)
        try:
            mtime = p.stat().st_mtime
        except OSError:
            mtime = 0.0
        entries.append(
            Entry(
                step=step_from_name(p.name) or 0,
                path=str(p),
                kind=r.kind,
                ok=r.ok,
                reason=r.reason,
                size_bytes=dir_size(p),
                has_manifest=r.has_manifest,
                mtime=mtime,
            )
        )
    entries.sort(key=lambda e: (e.step, e.mtime), reverse=True)
    return entries


def latest_good(run_checkpoints_dir: str | os.PathLike, deep: bool = True) -> Entry | None:
    """The newest checkpoint that verifies (hash-checked against its manifest when
    ``deep``); checks newest first and stops at the first good one."""
    root = checkpoints_dir(run_checkpoints_dir)
    if not root.is_dir():
        return None
    for p in _newest_first(_candidates(root)):
        try:  # a checkpoint may be pruned or quarantined while a reader (status) looks
            r = verify(p, deep=deep)
            if r.ok:
                return Entry(
                    step=step_from_name(p.name) or 0,
                    path=str(p),
                    kind=r.kind,
                    ok=True,
                    reason="",
                    size_bytes=dir_size(p),
                    has_manifest=r.has_manifest,
                    mtime=_mtime(p),
                )
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _newest_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: (step_from_name(p.name) or 0, _mtime(p)), reverse=True)


def quarantine(path: str | os.PathLike, reason: str) -> Path:
    """Move a bad checkpoint to `<checkpoints>/invalid/<name>-<UTC ts>` (never deletes)
    and leave `ptops-quarantine.json` (reason, origin, time) inside. If LATEST named it,
    LATEST is moved to the newest good checkpoint (or removed when none is left).
    Returns the new path."""
    src = Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {src}")
    root = src.parent
    if root.name == INVALID_DIR:
        return src  # already quarantined
    dest_root = root / INVALID_DIR
    dest_root.mkdir(mode=0o700, exist_ok=True)
    ts = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = dest_root / f"{src.name}-{ts}"
    i = 1
    while dest.exists():
        dest = dest_root / f"{src.name}-{ts}.{i}"
        i += 1
    os.rename(src, dest)  # same filesystem: atomic, nothing copied or lost
    fsync_dir(root)
    fsync_dir(dest_root)
    atomic_write_json(
        dest / QUARANTINE_NOTE, {"reason": reason, "from": str(src), "ts": time.time()}
    )
    latest = root / LATEST_NAME
    try:
        named = latest.read_text().strip()
    except OSError:
        named = None
    if named == src.name:
        good = latest_good(root, deep=False)
        if good is not None and (Path(good.path) / MANIFEST_NAME).exists():
            atomic_write_bytes(latest, (Path(good.path).name + "\n").encode())
        else:
            latest.unlink()
            fsync_dir(root)
    return dest


def _rmtree_safely(p: Path) -> None:
    """Rename away first so a half-deleted folder never looks like a checkpoint."""
    tmp = p.with_name(f".deleting-{p.name}-{os.getpid()}")
    os.rename(p, tmp)
    fsync_dir(p.parent)
    shutil.rmtree(tmp)
