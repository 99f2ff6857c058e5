"""Small stdlib-only helpers shared by the checkpoint modules.

Nothing here imports torch: listing and quick verification stay fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

MANIFEST_NAME = "ptops-manifest.json"
WRITING_MARKER = ".writing"
LATEST_NAME = "LATEST"
INVALID_DIR = "invalid"
QUARANTINE_NOTE = "ptops-quarantine.json"
HASH_ALGO = "sha256"  # SHA-NI makes sha256 ~2.7x faster than blake2b on x86 here
_CHUNK = 8 << 20

DCP_RE = re.compile(r"^step-(\d+)$")
TRL_RE = re.compile(r"^checkpoint-(\d+)$")

# Files ptops itself writes into a checkpoint folder; never part of the manifest.
PTOPS_FILES = {MANIFEST_NAME, WRITING_MARKER, QUARANTINE_NOTE}


def step_from_name(name: str) -> int | None:
    m = DCP_RE.match(name) or TRL_RE.match(name)
    return int(m.group(1)) if m else None


def detect_kind(path: Path) -> str:
    """'dcp', 'trl' or 'unknown' from the folder name, then its contents."""
    name = path.name
    if DCP_RE.match(name):
        return "dcp"
    if TRL_RE.match(name):
        return "trl"
    try:
        names = os.listdir(path)
    except OSError:
        return "unknown"
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if "trainer_state.json" in names or any(n.endswith(".safetensors") for n in names):
        return "trl"
    return "unknown"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """tmp file in the same folder + fsync + rename + fsync(dir)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def hash_file(path: Path, algo: str = HASH_ALGO) -> str:
    h = hashlib.new(algo)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def hash_files(
    paths: Iterable[Path], algo: str = HASH_ALGO, workers: int | None = None
) -> list[str]:
    """Hash several files in parallel (hashlib releases the GIL on large updates)."""
    paths = list(paths)
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1, len(paths)))
    if workers <= 1 or len(paths) <= 1:
        return [hash_file(p, algo) for p in paths]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(lambda p: hash_file(p, algo), paths))


def walk_files(root: Path) -> list[str]:
    """Relative POSIX paths of all regular files under root (sorted), without ptops' own files."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            full = Path(dirpath) / fn
            rel = full.relative_to(root).as_posix()
            if rel in PTOPS_FILES or fn.startswith(f".{MANIFEST_NAME}.tmp"):
                continue
            if full.is_symlink() or not full.is_file():
                continue
            out.append(rel)
    return sorted(out)


def dir_size(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, fn)).st_size
            except OSError:
                pass
    return total


def newest_mtime(root: Path) -> float:
    """Newest mtime of the folder and anything in it (seconds)."""
    newest = 0.0
    try:
        newest = os.stat(root).st_mtime
    except OSError:
        return 0.0
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, fn)).st_mtime)
            except OSError:
                pass
    return newest


# ---- safetensors (parsed without the safetensors package) -------------------

ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}


class SafetensorsError(ValueError):
    pass


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header without __metadata__, data start offset). Checks that the
    file is exactly as long as the header says; raises SafetensorsError."""
    size = os.path.getsize(path)
    if size < 8:
        raise SafetensorsError(f"file is {size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, 100 << 20):
            raise SafetensorsError(f"header length {n} exceeds file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise SafetensorsError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    end = 0
    for key, info in header.items():
        try:
            b, e = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"tensor {key!r} has no data_offsets") from None
        if not (0 <= b <= e):
            raise SafetensorsError(f"tensor {key!r} has bad data_offsets {b}..{e}")
        end = max(end, e)
    if start + end > size:
        raise SafetensorsError(f"truncated: data needs {start + end} bytes, file has {size}")
    if start + end < size:
        raise SafetensorsError(
            f"file has {size - start - end} trailing bytes after the tensor data"
        )
    return header, start
