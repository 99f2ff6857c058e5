"""Read back what W&B wrote offline: the records of a run's ``.wandb`` transaction log.

wandb 0.31 ships no Python reader (the Go core writes the file). The format is LevelDB's log format
behind a 7-byte header (``:W&B``, magic 0xBEE1, version): 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a chunk's payload is
(part of) one ``wandb_internal_pb2.Record``. Checksums are not verified: a damaged chunk fails to
parse instead.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a .wandb file ({data[:7]!r})"
    out, buf, i = [], b"", HEADER
    while i + HEADER <= len(data):
        left = BLOCK - i % BLOCK
        if left < HEADER:  # the block's tail is padding
            i += left
            continue
        _crc, length, typ = struct.unpack("<IHB", data[i : i + HEADER])
        if length == 0 and typ == 0:  # zero padding to the block's end
            i += left
            continue
        chunk = data[i + HEADER : i + HEADER + length]
        i += HEADER + length
        if typ == FULL:
            buf = chunk
        elif typ == FIRST:
            buf = chunk
            continue
        elif typ == MIDDLE:
            buf += chunk
            continue
        elif typ == LAST:
            buf += chunk
        else:
            raise AssertionError(f"{path}: unknown chunk type {typ} at {i}")
        rec = pb.Record()
        rec.ParseFromString(buf)
        out.append(rec)
        buf = b""
    return out


def of_type(recs: list, kind: str) -> list:
    return [getattr(r, kind) for r in recs if r.WhichOneof("record_type") == kind]


def items(history) -> dict:
    """A history or summary record's items as {key: value} (nested keys joined with '/')."""
    entries = history.item if hasattr(history, "item") else history.update
    out = {}
    for it in entries:
        key = it.key or "/".join(it.nested_key)
        out[key] = json.loads(it.value_json)
    return out
