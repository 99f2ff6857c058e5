"""Verify one checkpoint folder: TorchTitan DCP `step-N/` or TRL/HF `checkpoint-N/`.

Two layers of checks:

* **Manifest** (`ptops-manifest.json`, written by ptops' commit protocol): every listed
  file must exist with its recorded size and, with ``deep=True`` (default), its recorded
  sha256. This is the only layer that catches bytes flipped without a size change in
  data that carries no checksum of its own.
* **Structure** (always, with or without a manifest, so checkpoints written by the
  engines themselves can be judged):

  - DCP: `.metadata` exists and loads (through a restricted unpickler into inert
    stubs, see `_dcpmeta`, so verify never imports torch; torch's own
    `FileSystemReader.read_metadata` is plain `pickle.load`);
    every `(relative_path, offset, length)` it names lies inside an existing file; the
    chunks of every tensor cover its full shape; no `.writing` marker.
    Shards without `.metadata` = a save that was killed part-way.
  - TRL/HF: `trainer_state.json` (written last) parses and says `global_step == N`;
    model weights exist (`model.safetensors`, sharded index + shards, `pytorch_model.bin`
    or adapter weights) and each safetensors file is exactly as long as its header says;
    `optimizer.pt`, `scheduler.pt` and `rng_state*.pth` exist and their zip directories
    read.

  Without a manifest only these structural checks are possible, plus, with
  ``deep=True``, a CRC check: every DCP record and the TRL `.pt`/`.pth`/`.bin` files
  are `torch.save` zips whose per-member CRC32 we recompute with `zipfile` (torch's
  own loader does not check it). That catches flipped bytes in those files;
  safetensors carry no checksum, so a flip in `model.safetensors` goes unnoticed
  without a manifest.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._util import (
    MANIFEST_NAME,
    WRITING_MARKER,
    SafetensorsError,
    detect_kind,
    hash_files,
    read_safetensors_header,
    step_from_name,
    walk_files,
)


@dataclass
class Result:
    ok: bool
    kind: str  # "dcp" | "trl" | "unknown"
    step: int | None
    problems: list[dict[str, str]] = field(default_factory=list)  # [{file, reason}]
    path: str = ""
    has_manifest: bool = False
    checks: list[str] = field(default_factory=list)  # which layers ran
    warnings: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def reason(self) -> str:
        """One line: the first problem as `file: reason` ('' when ok)."""
        if not self.problems:
            return ""
        p = self.problems[0]
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{p['file']}: {p['reason']}{more}"


def verify(
    path: str | os.PathLike,
    deep: bool = True,
    *,
    ignore_writing_marker: bool = False,
    use_manifest: bool = True,
) -> Result:
    """Check one checkpoint folder. Never raises for a bad checkpoint (that is a
    `Result` with ``ok=False``); raises FileNotFoundError / NotADirectoryError when
    `path` is not a folder.

    ``deep=True``: hash every file against the manifest (or, without a manifest, read
    every tensor record back; see the module doc). ``deep=False``: sizes and structure.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if not p.is_dir():
        raise NotADirectoryError(f"not a checkpoint folder: {p}")
    kind = detect_kind(p)
    res = Result(ok=True, kind=kind, step=step_from_name(p.name), path=str(p))

    def bad(file: str, reason: str) -> None:
        res.problems.append({"file": file, "reason": reason})

    if (p / WRITING_MARKER).exists() and not ignore_writing_marker:
        bad(WRITING_MARKER, "save in progress (.writing marker present)")

    manifest = None
    mpath = p / MANIFEST_NAME
    if use_manifest and mpath.exists():
        res.has_manifest = True
        try:
            manifest = json.loads(mpath.read_text())
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
                raise ValueError("no 'files' list")
        except (OSError, ValueError) as e:
            bad(MANIFEST_NAME, f"unreadable manifest ({e})")
            manifest = None
    if manifest is not None:
        res.checks.append("manifest-hash" if deep else "manifest-size")
        _check_manifest(p, manifest, deep, bad, res)

    if kind == "dcp":
        res.checks.append("dcp-structure")
        _check_dcp(p, bad, load_check=deep and manifest is None, res=res)
    elif kind == "trl":
        res.checks.append("trl-structure")
        _check_trl(p, res.step, manifest, bad, load_check=deep and manifest is None)
    else:
        bad(
            ".", "not a recognised checkpoint (no .metadata/.distcp nor trainer_state.json/weights)"
        )

    res.ok = not res.problems
    return res


# ---------------------------------------------------------------- manifest ----


def _check_manifest(p: Path, manifest: dict, deep: bool, bad, res: Result) -> None:
    mstep = manifest.get("step")
    if res.step is not None and mstep is not None and int(mstep) != res.step:
        bad(MANIFEST_NAME, f"manifest says step {mstep}, folder name says {res.step}")
    if res.step is None and mstep is not None:
        res.step = int(mstep)
    mkind = manifest.get("kind")
    if mkind and res.kind == "unknown":
        res.kind = mkind
    to_hash: list[tuple[str, Path, str]] = []
    listed = set()
    for ent in manifest["files"]:
        try:
            rel, size = ent["path"], int(ent["size"])
        except (KeyError, TypeError, ValueError):
            bad(MANIFEST_NAME, f"malformed file entry {ent!r}")
            continue
        listed.add(rel)
        if rel.startswith("/") or ".." in Path(rel).parts:
            bad(MANIFEST_NAME, f"entry escapes the folder: {rel!r}")
            continue
        f = p / rel
        if not f.is_file():
            bad(rel, "missing (listed in manifest)")
            continue
        actual = f.stat().st_size
        if actual != size:
            bad(
                rel,
                f"size {actual} bytes, manifest says {size}"
                + (" (truncated)" if actual < size else ""),
            )
            continue
        want = ent.get(manifest.get("hash", "sha256")) or ent.get("sha256")
        if deep and want:
            to_hash.append((rel, f, want))
    if to_hash:
        algo = manifest.get("hash", "sha256")
        got = hash_files([f for _, f, _ in to_hash], algo=algo)
        for (rel, _, want), h in zip(to_hash, got):
            if h != want:
                bad(rel, f"content hash mismatch ({algo} {h[:12]}…, manifest {want[:12]}…)")
    for rel in walk_files(p):
        if rel not in listed:
            res.warnings.append({"file": rel, "reason": "not listed in manifest"})


# --------------------------------------------------------------------- DCP ----


def _check_dcp(p: Path, bad, load_check: bool, res: Result) -> None:
    names = os.listdir(p)
    shards = sorted(n for n in names if n.endswith(".distcp"))
    if ".metadata" not in names:
        if shards:
            bad(
                ".metadata",
                f"missing: save incomplete ({len(shards)} shard file(s) without .metadata)",
            )
        else:
            bad(".metadata", "missing, and no .distcp shards")
        return
    from ._dcpmeta import read_metadata_lite

    try:
        md = read_metadata_lite(p)  # restricted unpickler into inert stubs: no torch import
    except Exception as e:  # any unpickling failure is a bad file
        bad(".metadata", f"does not load ({type(e).__name__}: {e})")
        return
    try:
        _check_dcp_md(p, md, shards, bad, load_check, res)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        bad(".metadata", f"malformed ({type(e).__name__}: {e})")


def _check_dcp_md(p: Path, md, shards: list[str], bad, load_check: bool, res: Result) -> None:
    storage = md.storage_data or {}
    sizes: dict[str, int | None] = {}
    need: dict[str, int] = {}
    stored_keys: set[tuple[str, tuple | None]] = set()
    for idx, info in storage.items():
        stored_keys.add((idx.fqn, tuple(idx.offset) if idx.offset is not None else None))
        rel = str(info.relative_path)
        if rel.startswith("/") or ".." in Path(rel).parts:
            bad(".metadata", f"entry {idx.fqn} points outside the folder: {rel!r}")
            continue
        if rel not in sizes:
            f = p / rel
            sizes[rel] = f.stat().st_size if f.is_file() else None
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel in sorted(need):
        if sizes[rel] is None:
            bad(rel, "missing (named by .metadata)")
        elif sizes[rel] < need[rel]:
            bad(rel, f"truncated: .metadata needs {need[rel]} bytes, file has {sizes[rel]}")
    # coverage: every tensor's chunks fill its full shape, every chunk is stored
    n_missing = 0
    for fqn, tmd in md.state_dict_metadata.items():
        tname = type(tmd).__name__
        if tname == "TensorStorageMetadata":
            numel = 1
            for s in tmd.size:
                numel *= int(s)
            covered = 0
            for ch in tmd.chunks:
                v = 1
                for s in ch.sizes:
                    v *= int(s)
                covered += v
                if (fqn, tuple(ch.offsets)) not in stored_keys:
                    n_missing += 1
                    if n_missing <= 5:
                        bad(".metadata", f"chunk {fqn}@{tuple(ch.offsets)} has no storage entry")
            if covered != numel:
                bad(".metadata", f"tensor {fqn} chunks cover {covered} of {numel} elements")
        elif tname == "BytesStorageMetadata":
            if (fqn, None) not in stored_keys and not any(k[0] == fqn for k in stored_keys):
                bad(".metadata", f"entry {fqn} has no storage entry")
    referenced = set(need)
    for s in shards:
        if s not in referenced:
            res.warnings.append({"file": s, "reason": "shard not named by .metadata"})
    if load_check and not res.problems:
        _dcp_load_check(p, md, bad)


def _dcp_load_check(p: Path, md, bad) -> None:
    """Check the CRC32 of every record: DCP stores each item as a `torch.save` zip
    (torch's own reader does not verify CRCs on load; Python's zipfile does)."""
    import io

    bad_files: dict[str, str] = {}
    handles: dict[str, Any] = {}
    try:
        items = sorted(
            md.storage_data.items(), key=lambda kv: (str(kv[1].relative_path), kv[1].offset)
        )
        for idx, info in items:
            rel = str(info.relative_path)
            if rel in bad_files or getattr(info, "transform_descriptors", None):
                continue  # transformed (compressed/extension) records: left to the loader
            fh = handles.get(rel)
            if fh is None:
                fh = handles[rel] = open(p / rel, "rb")
            fh.seek(info.offset)
            blob = fh.read(info.length)
            try:
                with zipfile.ZipFile(io.BytesIO(blob)) as z:
                    first_bad = z.testzip()
                if first_bad:
                    bad_files[rel] = (
                        f"record {idx.fqn} at offset {info.offset}: CRC mismatch in {first_bad}"
                    )
            except (zipfile.BadZipFile, ValueError, OSError) as e:
                bad_files[rel] = (
                    f"record {idx.fqn} at offset {info.offset} is not a readable torch record ({e})"
                )
    finally:
        for fh in handles.values():
            fh.close()
    for rel, why in sorted(bad_files.items()):
        bad(rel, why)


# --------------------------------------------------------------------- TRL ----

_WEIGHT_SINGLE = [
    "model.safetensors",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "adapter_model.bin",
]
_WEIGHT_INDEX = ["model.safetensors.index.json", "pytorch_model.bin.index.json"]


def _zip_ok(f: Path, deep: bool) -> str | None:
    try:
        with zipfile.ZipFile(f) as z:
            if deep:
                badname = z.testzip()
                if badname:
                    return f"record {badname} fails its CRC check"
    except zipfile.BadZipFile as e:
        return f"not a readable torch zip file ({e})"
    except OSError as e:
        return f"unreadable ({e})"
    return None


def _check_trl(p: Path, step: int | None, manifest: dict | None, bad, load_check: bool) -> None:
    ts = p / "trainer_state.json"
    if not ts.is_file():
        bad("trainer_state.json", "missing (written last: save incomplete)")
    else:
        try:
            state = json.loads(ts.read_text())
            gs = state.get("global_step")
            if step is not None and gs != step:
                bad("trainer_state.json", f"global_step is {gs}, folder name says {step}")
        except (OSError, ValueError) as e:
            bad("trainer_state.json", f"does not parse ({e})")

    weights: list[str] = []
    for idx_name in _WEIGHT_INDEX:
        if (p / idx_name).is_file():
            try:
                wm = json.loads((p / idx_name).read_text())["weight_map"]
                weights.extend(sorted(set(wm.values())))
            except (OSError, ValueError, KeyError, TypeError) as e:
                bad(idx_name, f"does not parse ({e})")
                weights.append(idx_name)
    weights.extend(n for n in _WEIGHT_SINGLE if (p / n).is_file())
    if not weights:
        bad(
            "model.safetensors",
            "missing: no model weights (model.safetensors, index + shards, pytorch_model.bin, "
            "adapter)",
        )
    for w in weights:
        f = p / w
        if not f.is_file():
            bad(w, "missing (named by the weight index)")
        elif w.endswith(".safetensors"):
            try:
                read_safetensors_header(f)
            except SafetensorsError as e:
                bad(w, str(e))
        elif w.endswith(".bin"):
            why = _zip_ok(f, load_check)
            if why:
                bad(w, why)

    for req in ("optimizer.pt", "scheduler.pt"):
        f = p / req
        if not f.is_file():
            bad(req, "missing")
        else:
            why = _zip_ok(f, load_check)
            if why:
                bad(req, why)

    rng = sorted(n for n in os.listdir(p) if n.startswith("rng_state") and n.endswith(".pth"))
    ws = int(manifest.get("world_size") or 1) if manifest else 1
    if not rng:
        bad("rng_state.pth", "missing (no rng_state*.pth)")
    elif ws > 1:
        for r in range(ws):
            if f"rng_state_{r}.pth" not in rng:
                bad(f"rng_state_{r}.pth", f"missing (world_size {ws})")
    for n in rng:
        why = _zip_ok(p / n, load_check)
        if why:
            bad(n, why)
