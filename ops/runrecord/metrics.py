"""``metrics.jsonl`` rotated into numbered segments with an index, and the one way to read them.

Why: at 16k GPUs the file grows by tens of GB an hour (docs/scale.md), and every reader of one
growing file pays for all of it. The supervisor's writer (:class:`MetricsWriter`) moves the file,
once it passes ``[supervisor] metrics_rotate_mb``, to the next segment and describes the segment in
the index, so a reader that shows only the latest state (``ptops status``) reads the index and the
live file, and a reader of the whole history streams the segments in order.

Layout (a run that never rotated has only ``metrics.jsonl`` and reads exactly as before)::

    metrics.jsonl              the live file: the newest records (always this name)
    metrics/000001.jsonl       the oldest segment, then 000002.jsonl, ... (whole lines, final)
    metrics/index.jsonl        one line per segment, appended after the segment is in place

An index line: ``{"file": "000001.jsonl", "lines", "bytes", "first_step", "last_step",
"max_step", "attempts": [...], "first_ts", "last_ts", "rank0": [{...}, ...]}``; ``rank0`` is rank
0's records of the segment cut to :data:`RANK0_KEYS` (what ``ptops status`` and the goodput
account read), so status never opens a described segment.

A node line (``[supervisor] metrics_lines = "node"``, for thousands of nodes): a node agent's
batch of step records as ONE line, ``["node", NAME, [ENTRY, ...]]``: an ENTRY is a record whole,
or ``[J, {keys}]``, the record equal to entry J (an earlier whole one) but for those keys (the
agent's batch certified it; the writer checks the rebuilt record equals it, key order included,
else writes it whole). Readers expand it (:func:`records_of_line`) to the records a line each
would hold, in order; a top-level array, so no rank's record can pass for one. With
``[supervisor] metrics_rank_detail_every = K`` > 1, on a step that is not a multiple of K a
routine follower (not rank 0, no key its leader lacks, every differing value a finite number) is
left out, and its leader with it when all its followers are (and it is not rank 0 and holds no
NaN or inf); what a group leaves out becomes ``["summary", {"step", "ranks": [...], "keys": {KEY:
[min, its rank, low median, max, its rank]}}]`` (:func:`node_summaries_of_line`), which
records_of_line skips (the rule: ``nodesummary.py``). Every rank's record still reaches the
monitors live: only the file is sampled; unless ``[supervisor] node_summaries``, where the node
agents apply the rule on the wire and the writer writes their summary entries as they come
(:meth:`MetricsWriter.summary`). Entries that do not rebuild are dropped, never their
neighbours, and so are diffs past ``NODE_LINE_KEYS_PER_BYTE`` keys rebuilt per byte of the line
(no quadratic expansion of a hostile copy).

The reader's contract: the segments are the files named ``NNNNNN.jsonl`` (six digits) in
``metrics/``, read in number order, then ``metrics.jsonl``; the index never adds, drops or
reorders one (a rotation cut short before its index line leaves a segment the index does not
describe: it is read in full). A copied run directory is not trusted: a ``metrics/`` that is a
link, a segment that is not a regular file (a link out of the run directory, a FIFO), an index
line that is not an object or names anything but a segment of this folder, or a described
segment that is missing, is a :class:`MetricsIndexError` naming the file (and line and key); no
read leaves the run directory.
"""

from __future__ import annotations

import json
import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .jsonl import PRIVATE_FILE, parse_line
from .nodesummary import sum_up, summary_entry

LIVE = "metrics.jsonl"
SEGMENT_DIR = "metrics"
INDEX = "index.jsonl"
SEGMENT_NAME = re.compile(r"^([0-9]{6})\.jsonl$")
# rank 0's keys that ``ptops status`` (step, loss) and the goodput account (goodput.py)
# read: the index carries these for each segment
# (and ``ptops diagnose``'s loss and grad norm around a numeric incident)
RANK0_KEYS = ("step", "rank", "attempt", "ts", "step_s", "loss", "grad_norm")
_INT_KEYS = ("lines", "bytes")
_OPT_NUM_KEYS = ("first_step", "last_step", "max_step", "first_ts", "last_ts")


class MetricsIndexError(ValueError):
    """One line for the user (the file, the line and key, what was expected); CLIs exit 2."""


@dataclass
class Segment:
    """One rotated file: its number, path, and its index line when the index describes it."""

    number: int
    path: Path
    info: dict[str, Any] | None = None


def segment_dir(run_path: Path) -> Path:
    return Path(run_path) / SEGMENT_DIR


def segment_name(number: int) -> str:
    return f"{number:06d}.jsonl"


def _seg_dir(run_path: Path) -> Path | None:
    """``metrics/`` if it is a real folder of the run directory; None when there is none."""
    d = segment_dir(run_path)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise MetricsIndexError(f"{d}: not a folder (a link or a file): metrics segments not read")
    return d


def _listing(run_path: Path) -> dict[int, tuple[str, int]]:
    """number -> (name, inode) of the segment files present."""
    d = _seg_dir(run_path)
    if d is None:
        return {}
    out: dict[int, tuple[str, int]] = {}
    with os.scandir(d) as it:
        for entry in it:
            m = SEGMENT_NAME.match(entry.name)
            if m:
                if not entry.is_file(follow_symlinks=False):
                    raise MetricsIndexError(
                        f"{d / entry.name}: not a regular file (a link or a FIFO): not read"
                    )
                out[int(m.group(1))] = (entry.name, entry.inode())
    return out


def _check_entry(index: Path, n: int, entry: Any) -> dict[str, Any]:
    where = f"{index}: line {n}"
    if not isinstance(entry, dict):
        raise MetricsIndexError(f"{where}: expected a JSON object describing a segment")
    name = entry.get("file")
    if not isinstance(name, str) or not SEGMENT_NAME.match(name):
        raise MetricsIndexError(
            f"{where}: key 'file': expected a segment name like 000001.jsonl in {index.parent}, "
            f"got {name!r}"
        )
    for k in _INT_KEYS:
        v = entry.get(k)
        if v is not None and (type(v) is not int or v < 0):
            raise MetricsIndexError(f"{where}: key '{k}': expected a count >= 0, got {v!r}")
    for k in _OPT_NUM_KEYS:
        v = entry.get(k)
        if v is not None and (type(v) not in (int, float)):
            raise MetricsIndexError(f"{where}: key '{k}': expected a number or null, got {v!r}")
    att = entry.get("attempts", [])
    if not isinstance(att, list):
        raise MetricsIndexError(f"{where}: key 'attempts': expected a list, got {att!r}")
    rows = entry.get("rank0", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise MetricsIndexError(f"{where}: key 'rank0': expected a list of objects")
    return entry


def read_index(run_path: Path) -> dict[int, dict[str, Any]]:
    """segment number -> its index line, checked (a torn last line, a writer mid-append, is left
    out: its segment reads as undescribed)."""
    d = _seg_dir(run_path)
    if d is None:
        return {}
    index = d / INDEX
    try:
        data = _read_regular(index)
    except FileNotFoundError:
        return {}
    out: dict[int, dict[str, Any]] = {}
    lines = data.split(b"\n")
    for n, raw in enumerate(lines[:-1], 1):  # the part after the last newline is torn or empty
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            raise MetricsIndexError(f"{index}: line {n}: not JSON") from None
        entry = _check_entry(index, n, entry)
        number = int(SEGMENT_NAME.match(entry["file"]).group(1))  # type: ignore[union-attr]
        if number in out:
            raise MetricsIndexError(f"{index}: line {n}: key 'file': {entry['file']} twice")
        out[number] = entry
    return out


def segments(run_path: Path, *, index: bool = True) -> list[Segment]:
    """The run's segments, oldest first (the contract in the module docstring); with ``index``
    each carries its index line, and a described segment that is missing is an error."""
    present = _listing(run_path)
    described = read_index(run_path) if index else {}
    d = segment_dir(run_path)
    for number, entry in described.items():
        if number not in present:
            raise MetricsIndexError(
                f"{d / entry['file']}: listed in {d / INDEX} but missing (a copy without it?)"
            )
    return [
        Segment(number, d / present[number][0], described.get(number)) for number in sorted(present)
    ]


def _open_regular(path: Path) -> int:
    """An fd of ``path`` if it is a regular file itself (not a link, not a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise MetricsIndexError(f"{path}: cannot be read as a segment ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MetricsIndexError(f"{path}: not a regular file")
    return fd


def _read_regular(path: Path) -> bytes:
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _lines(f: Any, offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """(end offset, line) of each whole line from ``offset``; stops at a torn last line."""
    f.seek(offset)
    for raw in f:
        if not raw.endswith(b"\n"):
            return
        offset += len(raw)
        yield offset, raw


NODE_LINE = "node"
NODE_SUMMARY = "summary"  # a node line's entry: followers left out (``metrics_rank_detail_every``)
# a real node line rebuilds ~1 key per 2-3 of its bytes (a diff of one key rebuilds a whole record)
NODE_LINE_KEYS_PER_BYTE = 16


def _node_entries(raw: bytes) -> list | None:
    """A node line's entries, or None when ``raw`` is no node line."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    if (
        isinstance(line, list)
        and len(line) == 3
        and line[0] == NODE_LINE
        and isinstance(line[2], list)
    ):
        return line[2]
    return None


def records_of_line(raw: bytes) -> list[dict[str, Any]]:
    """The records one line holds: a record line's one, a node line's each (see the module
    docstring); none for garbage."""
    if not raw.startswith(b"["):
        rec = parse_line(raw)
        return [rec] if rec is not None else []
    entries = _node_entries(raw)
    if entries is None:
        return []
    out: list[Any] = []  # entry index -> its record, None for one that did not rebuild
    # rebuilt records may hold at most this many keys in all: a copied run directory's line of
    # one huge record and many tiny diffs must not expand quadratically in memory
    budget = NODE_LINE_KEYS_PER_BYTE * len(raw)
    for e in entries:
        if type(e) is dict:
            out.append(e)
            continue
        ok = type(e) is list and len(e) == 2 and type(e[0]) is int and type(e[1]) is dict
        j = e[0] if ok else -1
        # a diff refers to an earlier entry written whole, never to another diff
        if 0 <= j < len(out) and type(entries[j]) is dict:
            budget -= len(entries[j]) + len(e[1])
            out.append({**entries[j], **e[1]} if budget >= 0 else None)
        else:
            out.append(None)
    return [r for r in out if r is not None]


def _segment_records(seg: Segment) -> Iterator[dict[str, Any]]:
    fd = _open_regular(seg.path)
    with os.fdopen(fd, "rb") as f:
        yield from _records_of(f)


def iter_metrics(run_path: str | Path) -> Iterator[dict[str, Any]]:
    """Every record of the run, oldest first: the segments, then the live file (its torn last line
    left out). Streams: memory does not grow with the run. The index is checked too: a tampered
    copy is an error here as in ``ptops status``."""
    run_path = Path(run_path)
    for seg in segments(run_path):
        yield from _segment_records(seg)
    try:
        f = open(run_path / LIVE, "rb")
    except OSError:
        return
    with f:
        yield from _records_of(f)


def _records_of(f: Any) -> Iterator[dict[str, Any]]:
    for raw in f:  # one generator a line, no more: a full replay reads millions
        if not raw.endswith(b"\n"):
            return  # torn: its writer has not finished it
        yield from records_of_line(raw)


def tail_records(run_path: str | Path, nbytes: int) -> Iterator[dict[str, Any]]:
    """The records of the run's last ``nbytes`` (the live file, and the newest segments' ends when
    it holds less), from a step boundary when the window holds one (a cut step's first ranks are
    left out), oldest first; the whole run when it is smaller. What ``ptops diagnose`` replays on
    a rotated run: seconds, whatever the run's size."""
    run_path = Path(run_path)
    parts: list[tuple[Path, bool]] = [(s.path, True) for s in segments(run_path)]
    if (run_path / LIVE).is_file():
        parts.append((run_path / LIVE, False))
    sizes = [p.stat().st_size if not seg else os.lstat(p).st_size for p, seg in parts]
    need, first, offset = nbytes, 0, 0
    for i in range(len(parts) - 1, -1, -1):
        if sizes[i] >= need:
            first, offset = i, sizes[i] - need
            break
        need -= sizes[i]
    cut = first > 0 or offset > 0
    held: list[dict[str, Any]] = []  # the first (maybe cut) step's records, until the next step
    for i in range(first, len(parts)):
        path, seg = parts[i]
        fd = _open_regular(path) if seg else os.open(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            start = offset if i == first else 0
            if start:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the rest of a cut line
                start = f.tell()
            for _, raw in _lines(f, start):
                for rec in records_of_line(raw):
                    if cut:
                        if not held or rec.get("step") == held[0].get("step"):
                            held.append(rec)
                            continue
                        cut, held = False, []  # a step boundary: the cut step is dropped
                    yield rec
    yield from held  # no boundary in the window: the part of one step it holds


def has_metrics(run_path: str | Path) -> bool:
    run_path = Path(run_path)
    return (run_path / LIVE).is_file() or bool(_listing(run_path))


def maybe_rank0(raw: bytes) -> bool:
    """False only for a line whose ``"rank"`` key has a value other than 0 (rank 0's records are a
    1/N share: the rest are not parsed). A line without a ``"rank"`` key counts (the goodput
    account takes it as rank 0's); one whose only ``"rank"`` is nested is taken as that rank's."""
    return (
        b'"rank":0' in raw
        or b'"rank": 0' in raw
        or (b'"rank":' not in raw and b'"rank": ' not in raw)
    )


def rank0_slim(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in RANK0_KEYS if k in rec}


def rank0_records(run_path: str | Path) -> Iterator[dict[str, Any]]:
    """Rank 0's records (those with ``rank`` 0 or none), oldest first, each cut to
    :data:`RANK0_KEYS`: a described segment from the index, the rest (the live file, a segment the
    index lacks) read with the other ranks' lines skipped unparsed. What ``ptops status`` reads."""
    run_path = Path(run_path)
    for seg in segments(run_path):
        if seg.info is not None:
            yield from seg.info.get("rank0", [])
            continue
        fd = _open_regular(seg.path)
        with os.fdopen(fd, "rb") as f:
            yield from _rank0_of(f)
    try:
        f = open(run_path / LIVE, "rb")
    except OSError:
        return
    with f:
        yield from _rank0_of(f)


def live_rank0(run_path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Rank 0's records of the live file (cut as :func:`rank0_records`) and how many lines it
    holds (``ptops diagnose`` on a rotated run: the segments are counted by the index)."""
    lines = [0]
    try:
        f = open(Path(run_path) / LIVE, "rb")
    except OSError:
        return [], 0
    with f:
        return list(_rank0_of(f, lines=lines)), lines[0]


def _rank0_of(
    f: Any, block: int = 8 << 20, lines: list[int] | None = None
) -> Iterator[dict[str, Any]]:
    """Rank 0's records of a file, read in blocks (a line at a time in Python was most of
    ``ptops status``'s time at 4,096 ranks); a torn last line is left out. ``lines[0]`` counts the
    whole lines."""
    rest = b""
    while True:
        chunk = f.read(block)
        if not chunk:
            return
        whole = (rest + chunk).split(b"\n")
        rest = whole.pop()  # after the last newline: the next block's start, or a torn line
        # a node line holds many records: parsed to count them only when asked (diagnose)
        count = lines is not None
        if count:
            lines[0] += sum(not x.startswith(b"[") for x in whole)  # type: ignore[index]
        for raw in [x for x in whole if maybe_rank0(x) or (count and x.startswith(b"["))]:
            recs = records_of_line(raw)
            if count and raw.startswith(b"["):
                lines[0] += len(recs)  # type: ignore[index]
            for rec in recs:
                if rec.get("rank", 0) == 0:
                    yield rank0_slim(rec)


@dataclass
class _Stats:
    """What the index says of the segment being written, kept as records are appended."""

    lines: int = 0
    bytes: int = 0
    first_step: Any = None
    last_step: Any = None
    max_step: Any = None
    attempts: list[int] = field(default_factory=list)
    first_ts: Any = None
    last_ts: Any = None
    rank0: list[dict[str, Any]] = field(default_factory=list)

    def add(self, rec: dict[str, Any], size: int) -> None:
        self.lines += 1
        self.bytes += size
        step, ts, att = rec.get("step"), rec.get("ts"), rec.get("attempt")
        if type(step) is int:
            if self.first_step is None:
                self.first_step = step
            self.last_step = step
            self.max_step = step if self.max_step is None else max(self.max_step, step)
        if type(ts) in (int, float):
            if self.first_ts is None:
                self.first_ts = ts
            self.last_ts = ts
        if type(att) is int and att not in self.attempts:
            self.attempts.append(att)
        if rec.get("rank", 0) == 0:
            self.rank0.append(rank0_slim(rec))

    def add_line(self, recs: list[dict[str, Any]], size: int) -> None:
        """A line's records (a node line holds many): ``lines`` counts records, ``bytes`` bytes."""
        for i, rec in enumerate(recs):
            self.add(rec, size if i == 0 else 0)

    def entry(self, name: str) -> dict[str, Any]:
        return {
            "file": name,
            "lines": self.lines,
            "bytes": self.bytes,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "max_step": self.max_step,
            "attempts": sorted(self.attempts),
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
            "rank0": self.rank0,
        }


def _node_line(name: str, entries: list, every: int, wire: list = ()) -> tuple[list, list]:
    """A node line and the records it holds. With ``every`` > 1, on a step not a multiple of
    ``every``, routine records are left out and summed up (``nodesummary.sum_up``: a certified
    follower is ``(J, diff, record)``). ``wire``: the summaries a node agent sent in place of
    its routine ranks (``node_summaries``), ``(entry, place of a leader left out or None)``.
    A group's summary entry goes at the line's end, in the order its first rank left out came."""
    if every <= 1 and not wire:
        return (
            [NODE_LINE, name, [e if type(e) is dict else [e[0], e[1]] for e in entries]],
            [e if type(e) is dict else e[2] for e in entries],
        )
    drop: set[int] = set()
    sums: list = []  # (the place of the first rank left out, its summary entry)
    for at, entry, lead in wire:
        if lead is not None:
            drop.add(lead)
        sums.append((at, entry))
    if every > 1:
        follows: dict[int, list] = {}  # a leader's place -> its followers' places
        for i, e in enumerate(entries):
            if type(e) is not dict:
                follows.setdefault(e[0], []).append(i)
        for j, fs in follows.items():
            lead_out, left, entry = sum_up(
                entries[j], [(entries[i][2], entries[i][1]) for i in fs], every
            )
            if entry is None:
                continue
            drop.update(fs[k] for k in left)
            if lead_out:
                drop.add(j)
            sums.append((j if lead_out else fs[left[0]], entry))
    out: list = []
    recs: list = []
    where: dict[int, int] = {}  # an entry written whole: its place -> its place in ``out``
    for i, e in enumerate(entries):
        if i in drop:
            continue
        if type(e) is not dict and e[0] in where:
            out.append([where[e[0]], e[1]])
            recs.append(e[2])
            continue
        e = e if type(e) is dict else e[2]  # (a leader a hostile summary left out: whole)
        where[i] = len(out)
        out.append(e)
        recs.append(e)
    sums.sort(key=lambda s: s[0])
    out.extend([NODE_SUMMARY, s] for _, s in sums)
    return [NODE_LINE, name, out], recs


def node_summaries_of_line(raw: bytes) -> list[dict[str, Any]]:
    """The summary entries of a node line (``metrics_rank_detail_every`` > 1): ``{"step",
    "ranks", "keys"}`` each; none for any other line, nor for an entry that is not one (a key
    whose five values are not finite numbers with int ranks is left out)."""
    out: list[dict[str, Any]] = []
    for e in (_node_entries(raw) if raw.startswith(b"[") else None) or ():
        if type(e) is list and len(e) == 2 and e[0] == NODE_SUMMARY:
            entry = summary_entry(e[1])
            if entry is not None:
                out.append(entry)
    return out


def _scan(path: Path) -> _Stats:
    st = _Stats()
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        for _, raw in _lines(f):
            st.add_line(records_of_line(raw), len(raw))
    return st


class MetricsWriter:
    """The supervisor's ``metrics.jsonl`` writer: one ``write`` of a whole line per record on a
    file held open (the open + close per record was the largest cost of a record at 1,024 ranks:
    ``bench/scale_load.py``); past ``rotate_bytes`` (0: never) the file becomes the next segment.

    A rotation: close, rename into ``metrics/`` (the segment is whole and final from then on),
    then append its index line (one ``write``). A new supervisor on the run directory continues
    the numbering, and first describes a segment a killed one left undescribed.
    """

    def __init__(self, run_path: str | Path, rotate_bytes: int = 0, detail_every: int = 1):
        self.run_path = Path(run_path)
        self.path = self.run_path / LIVE
        self.rotate_bytes = int(rotate_bytes)
        # node lines: a certified follower's keys every this many steps, else in a summary
        self.detail_every = max(1, int(detail_every))
        self._fd: int | None = None
        self._stats = _Stats()
        self._next: int | None = None
        self.rotations = 0
        self._held: list[bytes] | None = None  # lines of a node's batch, written at its end
        self._node: tuple[str, list, dict] | None = None  # a node line being built (``node``)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The records appended inside go out in ONE ``write`` at the end (a node agent's batch:
        at 2,048 ranks the ``write`` per record was a ninth of the supervisor's main thread,
        ``bench/scale_load.py --profile``). Whole lines, in order; a rotation inside writes
        what is held first."""
        if self._held is not None:  # nested: the outer one writes
            yield
            return
        self._held = []
        try:
            yield
        finally:
            self._flush()
            self._held = None

    @contextmanager
    def node(self, name: str) -> Iterator[None]:
        """The records appended inside become ONE node line (module docstring): a record its
        node's batch certified equal to an earlier one but for some keys (``like``: that rank,
        the keys) is written as those keys only. At 16k nodes a line a rank was the largest
        part of the file and of the supervisor's encoding (docs/scale.md)."""
        if self._node is not None:
            yield
            return
        self._node = (name, [], {}, [])
        try:
            yield
        finally:
            name, entries, _, wire = self._node
            self._node = None
            if entries:
                self._line(*_node_line(name, entries, self.detail_every, wire))

    def _as_entry(self, record: dict[str, Any], like: Any) -> Any:
        """``record`` as its node line's entry: whole, or (J, its keys, record) when the certified
        leader's entry J rebuilt with those keys gives it back exactly."""
        _, entries, whole, _ = self._node  # type: ignore[misc]
        step = record.get("step")
        j = whole.get((like[0], step)) if like is not None else None
        if j is not None and like[1] <= record.keys():
            diff = {k: record[k] for k in like[1]}
            back = {**entries[j], **diff}
            if back == record and list(back) == list(record):  # checked, not assumed
                return (j, diff, record)
        whole[(record.get("rank"), step)] = len(entries)
        return record

    def _flush(self) -> None:
        held = self._held
        if not held:
            return
        data = memoryview(b"".join(held))
        held.clear()
        while data:  # a regular file takes it whole; a short write must not lose the rest
            data = data[os.write(self._fd, data) :]  # type: ignore[arg-type]

    def _open(self) -> None:
        if self.rotate_bytes <= 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
            return
        present = segments(self.run_path)  # a hostile index: MetricsIndexError before any write
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
        if os.fstat(self._fd).st_size:  # a resumed run: describe what the live file holds so far
            self._stats = _scan(self.path)
        self._next = (present[-1].number + 1) if present else 1
        undescribed = [s for s in present if s.info is None]
        if undescribed:
            self._repair_index_tail()
            for seg in undescribed:
                self._append_index(_scan(seg.path).entry(seg.path.name))

    def summary(self, entry: dict[str, Any], lead: Any = None) -> None:
        """A node agent's summary of its routine ranks (``nodesummary``), at the node line's end;
        ``lead``: the rank of the leader it holds too, whose record (appended before, whole) the
        line then leaves out. Outside a node line: nothing (no line stands for a summary)."""
        if self._node is None:
            return
        _, entries, whole, wire = self._node
        j = whole.get((lead, entry.get("step"))) if lead is not None else None
        wire.append((len(entries), entry, j))

    def append(self, record: dict[str, Any], like: Any = None) -> None:
        """One record; ``like`` (``unbatch``'s certificate) lets a node line keep only its keys."""
        if self._node is not None:
            self._node[1].append(self._as_entry(record, like))
            return
        self._line(record, (record,))

    def _line(self, obj: Any, records: Any) -> None:
        line = (json.dumps(obj, separators=(",", ":"), allow_nan=True) + "\n").encode()
        if self._fd is None:
            self._open()
        if self._held is not None:
            self._held.append(line)
        else:
            os.write(self._fd, line)  # type: ignore[arg-type]
        if self.rotate_bytes > 0:
            self._stats.add_line(records, len(line))
            if self._stats.bytes >= self.rotate_bytes:
                self.rotate()

    def rotate(self) -> None:
        """The live file becomes the next segment (nothing to do when it is empty)."""
        if self._fd is None:
            self._open()
        if self._stats.lines == 0:
            return
        self._flush()
        d = segment_dir(self.run_path)
        d.mkdir(mode=0o700, exist_ok=True)
        name = segment_name(self._next or 1)
        os.close(self._fd)  # type: ignore[arg-type]
        self._fd = None
        os.rename(self.path, d / name)
        self._append_index(self._stats.entry(name))
        self._stats = _Stats()
        self._next = (self._next or 1) + 1
        self.rotations += 1
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)

    def _append_index(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, separators=(",", ":"), allow_nan=True) + "\n").encode()
        fd = os.open(
            segment_dir(self.run_path) / INDEX,
            os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            PRIVATE_FILE,
        )
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _repair_index_tail(self) -> None:
        """A writer killed mid-line left a torn index line (readers skip it): cut it off, so the
        next line stands alone; its segment is described again after it."""
        index = segment_dir(self.run_path) / INDEX
        try:
            data = _read_regular(index)
        except FileNotFoundError:
            return
        if data and not data.endswith(b"\n"):
            os.truncate(index, data.rfind(b"\n") + 1)

    def close(self) -> None:
        if self._fd is not None:
            self._flush()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class MetricsTail:
    """Follows a run's metrics across rotations: each read yields the whole records written since
    the last, none twice, none lost (the live exporters' follower).

    It holds the live file open: a rotation renames that file, so what the writer put in it after
    the last read is read through the same descriptor once the file shows up as a segment (the
    writer closed it before the rename: it is final), then the new live file from its start.
    """

    def __init__(self, run_path: str | Path, *, from_end: bool = False) -> None:
        self.run_path = Path(run_path)
        self._f: Any = None
        self._ino: int | None = None
        self.offset = 0
        self._done = 0  # segments numbered up to this one are read
        self._retired: set[int] = set()  # inodes of live files read to their end through self._f
        if from_end:
            self._done = max(_listing(self.run_path), default=0)
            if self._open_live():
                self.offset = os.fstat(self._f.fileno()).st_size

    def _open_live(self) -> bool:
        try:
            self._f = open(self.run_path / LIVE, "rb")
        except OSError:
            return False
        self._ino = os.fstat(self._f.fileno()).st_ino
        self.offset = 0
        return True

    def _drain(self) -> Iterator[dict[str, Any]]:
        size = os.fstat(self._f.fileno()).st_size
        if size < self.offset:  # truncated in place: read it again from the start
            self.offset = 0
        for end, raw in _lines(self._f, self.offset):
            self.offset = end
            yield from records_of_line(raw)

    def records(self) -> Iterator[dict[str, Any]]:
        if self._f is None:
            self._open_live()  # before listing: a segment that is this file is read through it
        for number, (name, ino) in sorted(_listing(self.run_path).items()):
            if number <= self._done:
                continue
            if self._f is not None and ino == self._ino:
                yield from self._retire()  # our live file, rotated: final now
            elif ino not in self._retired:
                yield from _segment_records(Segment(number, segment_dir(self.run_path) / name))
            self._done = number
        if self._f is not None:
            try:
                now = os.stat(self.run_path / LIVE).st_ino
            except OSError:
                now = self._ino  # between a rotation's rename and the new file: keep reading ours
            if now != self._ino:  # rotated after the listing (or replaced): ours is final
                yield from self._retire()
        if self._f is None and not self._open_live():
            return
        yield from self._drain()

    def _retire(self) -> Iterator[dict[str, Any]]:
        """Read the rest of a live file that is no longer live; its segment is then not read
        again."""
        yield from self._drain()
        self._retired.add(self._ino)  # type: ignore[arg-type]
        self._f.close()
        self._f, self._ino = None, None

    def read(self) -> list[dict[str, Any]]:
        return list(self.records())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
