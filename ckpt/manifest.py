"""Manifest and commit protocol.

Protocol for a checkpoint written under ptops' control::

    mark_writing(ckpt_dir)              # optional: `.writing` marker, retention skips it
    ... engine saves step-N/ or checkpoint-N/ ...
    write_manifest(ckpt_dir, step, world_size, versions)   # structure check, then hashes
    commit(checkpoints_root, ckpt_dir)  # verify vs manifest, drop marker, move LATEST

`ptops-manifest.json` lists every file (relative path, size, sha256) and is written
atomically (tmp + fsync + rename + fsync of the folder). `checkpoints/LATEST` holds the
folder name of the last committed checkpoint and is written the same way, only after the
manifest exists and the folder verifies against it, so a reader never sees LATEST name a
half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ._util import (
    HASH_ALGO,
    LATEST_NAME,
    MANIFEST_NAME,
    WRITING_MARKER,
    atomic_write_bytes,
    atomic_write_json,
    detect_kind,
    fsync_dir,
    hash_files,
    walk_files,
)

MANIFEST_VERSION = 1


def versions(*names: str) -> dict[str, str]:
    """The versions a manifest records: of each named package already imported (an engine's
    torch, torchtitan, transformers, ...), read from the loaded module, so nothing is imported
    for it."""
    import sys

    out = {}
    for name in names:
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


class ManifestError(RuntimeError):
    """Raised when a manifest cannot be written or a commit is refused.
    `.problems` holds the verifier's [{file, reason}]."""

    def __init__(self, msg: str, problems: list[dict[str, str]] | None = None):
        super().__init__(msg)
        self.problems = problems or []


def mark_writing(ckpt_dir: str | os.PathLike) -> Path:
    """Create `ckpt_dir/.writing` (creating the folder); retention never touches it."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    m = d / WRITING_MARKER
    m.write_text(f"{os.getpid()} {time.time():.3f}\n")
    return m


def clear_writing(ckpt_dir: str | os.PathLike) -> None:
    m = Path(ckpt_dir) / WRITING_MARKER
    try:
        m.unlink()
        fsync_dir(m.parent)
    except FileNotFoundError:
        pass


def write_manifest(
    ckpt_dir: str | os.PathLike,
    step: int,
    world_size: int,
    versions: dict[str, str] | None = None,
    *,
    check: bool = True,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Hash every file of `ckpt_dir` into `ckpt_dir/ptops-manifest.json` (atomic).

    With ``check=True`` (default) the folder must first pass the structural verify
    (DCP `.metadata` coverage / TRL file set); a broken save raises ManifestError
    instead of being blessed with a manifest.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ManifestError(f"checkpoint folder not found: {d}")
    kind = detect_kind(d)
    if check:
        from .verify import verify

        # structure only (an old manifest, if any, is about to be replaced)
        res = verify(d, deep=False, ignore_writing_marker=True, use_manifest=False)
        if not res.ok:
            raise ManifestError(f"refusing to write manifest for {d}: {res.reason}", res.problems)
    files = walk_files(d)
    paths = [d / f for f in files]
    sizes = [p.stat().st_size for p in paths]
    t0 = time.perf_counter()
    hashes = hash_files(paths, HASH_ALGO)
    hash_s = time.perf_counter() - t0
    # a file that changed while hashing means the save was not finished
    for p, s in zip(paths, sizes):
        if p.stat().st_size != s:
            raise ManifestError(f"{p} changed size while hashing: save not finished")
    manifest = {
        "version": MANIFEST_VERSION,
        "kind": kind,
        "step": int(step),
        "world_size": int(world_size),
        "versions": dict(versions or {}),
        "created": time.time(),
        "hash": HASH_ALGO,
        "total_bytes": sum(sizes),
        "hash_s": round(hash_s, 4),
        "files": [{"path": f, "size": s, HASH_ALGO: h} for f, s, h in zip(files, sizes, hashes)],
    }
    if extra:
        manifest["extra"] = extra
    out = d / MANIFEST_NAME
    atomic_write_json(out, manifest)
    return out


def read_manifest(ckpt_dir: str | os.PathLike) -> dict | None:
    f = Path(ckpt_dir) / MANIFEST_NAME
    if not f.exists():
        return None
    return json.loads(f.read_text())


def commit(checkpoints_root: str | os.PathLike, ckpt_dir: str | os.PathLike, *, deep: bool = True):
    """Move `checkpoints_root/LATEST` to `ckpt_dir`, only if it has a manifest and
    verifies against it (hashes with ``deep=True``) and structurally. Clears the
    `.writing` marker. Returns the verify Result; raises ManifestError otherwise."""
    from .verify import verify

    root = Path(checkpoints_root)
    d = Path(ckpt_dir)
    if not (d / MANIFEST_NAME).exists():
        raise ManifestError(f"refusing to commit {d}: no {MANIFEST_NAME}")
    if d.resolve().parent != root.resolve():
        raise ManifestError(f"refusing to commit {d}: not directly inside {root}")
    res = verify(d, deep=deep, ignore_writing_marker=True)
    if not res.ok:
        raise ManifestError(f"refusing to commit {d}: {res.reason}", res.problems)
    clear_writing(d)
    fsync_dir(d)
    atomic_write_bytes(root / LATEST_NAME, (d.name + "\n").encode())
    return res


def read_latest(checkpoints_root: str | os.PathLike) -> Path | None:
    """The folder `checkpoints/LATEST` names, if the file and the folder exist."""
    root = Path(checkpoints_root)
    try:
        name = (root / LATEST_NAME).read_text().strip()
    except OSError:
        return None
    if not name or "/" in name or name in {".", ".."}:
        return None
    p = root / name
    return p if p.is_dir() else None
