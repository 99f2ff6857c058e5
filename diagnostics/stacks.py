"""Hang stacks: read every rank's ``stacks/attempt-K/rank-R.txt`` (or its section of its node's
``node-NAME.txt``), group ranks by the same stack, name the odd rank out by its innermost frame
that is not the interpreter's own.

Two formats land there (``ops/supervisor/hangs.py``): the rank's own dump over the channel
(``traceback.format_stack`` per thread) and ``py-spy dump --locals`` for a rank that cannot answer
(SIGSTOPped, stuck in C). Both are reduced to the main thread's frames ``(function, file, line)``
with the function's class prefix, absolute path prefixes, locals and addresses dropped, so the same
place reads the same from either source. Ranks are grouped by their frames' (file, function)
sequence: line numbers are shown, not compared (two ranks in the same function at different lines
are waiting in the same place for this purpose).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptops.ops.runrecord.rundir import STACK_SECTION

_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_PYSPY_FRAME = re.compile(r"^\s{4}(?P<func>\S.*?) \((?P<file>[^()]+?):(?P<line>\d+)\)\s*$")
_TB_THREAD = re.compile(r'^Thread (?P<id>0x[0-9a-f]+) "(?P<name>[^"]*)"')
_PYSPY_THREAD = re.compile(r'^Thread (?P<id>\d+) \((?P<state>[^)]*)\): "(?P<name>[^"]*)"')
_SOURCE = re.compile(r"^# source: (?P<src>.*)$")

# files whose frames are plumbing, not the place a person wants named
_PLUMBING = (
    "<frozen",
    "/threading.py",
    "/runpy.py",
    "/selectors.py",
    "/socket.py",
    "/queue.py",
    "torch/_ops.py",
    "torch/_library/",
    "torch/utils/_pytree.py",
    "c10d_logger.py",
    "elastic/multiprocessing/errors",
)
# a frame in one of these means the rank is inside (waiting in) a collective
_COLLECTIVE = (
    "wait_tensor",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "_functional_collectives",
    "distributed_c10d",
    "all_to_all",
    "send",
    "recv",
)


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.func} ({self.file}:{self.line})"


@dataclass
class RankStack:
    rank: int
    source: str | None
    frames: list[Frame] = field(default_factory=list)  # main thread, outermost first
    state: str | None = None  # py-spy's thread state (idle, active)
    note: str | None = None  # why there is no stack

    @property
    def key(self) -> tuple[tuple[str, str], ...]:
        return tuple((f.file, f.func) for f in self.frames)

    @property
    def top(self) -> Frame | None:
        """The innermost frame that is not plumbing (the interpreter, torch dispatch, threading)."""
        for f in reversed(self.frames):
            if not any(p in "/" + f.file for p in _PLUMBING):
                return f
        return self.frames[-1] if self.frames else None

    @property
    def in_collective(self) -> bool:
        return any(any(c in f.func or c in f.file for c in _COLLECTIVE) for f in self.frames)


def _short(path: str) -> str:
    """Path without the machine's prefix: from the package root (site-packages/, ptops folders)
    on."""
    p = path.replace("\\", "/")
    if "site-packages/" in p:
        return p.split("site-packages/", 1)[1]
    m = re.search(r"/lib/python3\.\d+/(.*)$", p)
    if m:
        return m.group(1)
    for root in ("ops/", "recipes/", "faultinject/", "monitors/", "ckpt/", "diagnostics/"):
        i = p.find("/" + root)
        if i >= 0:
            return p[i + 1 :]
    return p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] if p.count("/") >= 2 else p


def parse(text: str, rank: int) -> RankStack:
    """One rank's stack file -> its main thread's frames (either format)."""
    src = None
    threads: list[tuple[str, str | None, list[Frame]]] = []  # (name, state, frames)
    pyspy = False
    for raw in text.splitlines():
        m = _SOURCE.match(raw)
        if m and src is None:
            src = m.group("src").strip()
            continue
        m = _TB_THREAD.match(raw)
        if m:
            threads.append((m.group("name"), None, []))
            continue
        m = _PYSPY_THREAD.match(raw)
        if m:
            pyspy = True
            threads.append((m.group("name"), m.group("state"), []))
            continue
        if not threads:
            continue
        if pyspy:
            m = _PYSPY_FRAME.match(raw)
            if m:  # py-spy: innermost first; "Class.method"
                func = m.group("func").rsplit(".", 1)[-1]
                threads[-1][2].insert(0, Frame(func, _short(m.group("file")), int(m.group("line"))))
        else:
            m = _TB_FRAME.match(raw)
            if m:
                threads[-1][2].append(
                    Frame(m.group("func"), _short(m.group("file")), int(m.group("line")))
                )
    if not threads:
        note = next(
            (ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("# no stack")),
            None,
        )
        return RankStack(rank, src, note=note or "no stack in the file")
    main = next((t for t in threads if t[0] == "MainThread"), threads[0])
    return RankStack(rank, src, main[2], state=main[1])


def node_sections(text: str) -> dict[int, str]:
    """A node file's sections (``STACK_SECTION``), rank -> its text as a rank file holds it."""
    out: dict[int, str] = {}
    rank, lines = None, []
    marker = re.compile(re.escape(STACK_SECTION).replace("%d", r"(\d+)"))
    for line in text.splitlines(keepends=True):
        m = marker.fullmatch(line.rstrip("\n"))
        if m:
            if rank is not None:
                out[rank] = "".join(lines)
            rank, lines = int(m.group(1)), []
        elif rank is not None:
            lines.append(line)
    if rank is not None:
        out[rank] = "".join(lines)
    return out


def read_attempt(stack_dir: Path) -> dict[int, RankStack]:
    out: dict[int, RankStack] = {}
    if not stack_dir.is_dir():
        return out
    for path in sorted(stack_dir.glob("node-*.txt")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for rank, part in node_sections(text).items():
            out[rank] = parse(part, rank)
    for path in sorted(stack_dir.glob("rank-*.txt")):
        m = re.fullmatch(r"rank-(\d+)\.txt", path.name)
        if not m:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            out[int(m.group(1))] = RankStack(int(m.group(1)), None, note=f"unreadable ({e})")
            continue
        out[int(m.group(1))] = parse(text, int(m.group(1)))
    return out


def analyse(stack_dir: Path, blamed: list[int] | None = None) -> dict[str, Any] | None:
    """Ranks grouped by identical main-thread stack and the odd rank(s) out; None without stack
    files.

    The odd group: the one not waiting in a collective when the others are (everyone waits for it),
    else the smallest group; a tie goes to the ranks the hang event blamed.
    """
    stacks = read_attempt(stack_dir)
    if not stacks:
        return None
    blamed = list(blamed or [])
    groups: dict[Any, list[int]] = {}
    for r, s in sorted(stacks.items()):
        groups.setdefault(s.key if s.frames else ("none", s.note), []).append(r)
    rows = []
    for key, ranks in groups.items():
        s = stacks[ranks[0]]
        rows.append(
            {
                "ranks": ranks,
                "frame": str(s.top) if s.top else None,
                "in_collective": s.in_collective if s.frames else False,
                "sources": sorted({stacks[r].source or "?" for r in ranks}),
                "state": s.state,
                "note": s.note,
                "depth": len(s.frames),
            }
        )
    odd = None
    if len(rows) > 1:
        not_coll = [g for g in rows if not g["in_collective"] and g["frame"]]
        cands = not_coll if 0 < len(not_coll) < len(rows) else rows
        smallest = min(len(g["ranks"]) for g in cands)
        cands = [g for g in cands if len(g["ranks"]) == smallest]
        odd = next((g for g in cands if set(g["ranks"]) & set(blamed)), cands[0])
    elif blamed and rows[0]["frame"]:
        odd = None  # every rank in the same place: nobody is odd
    return {
        "dir": stack_dir.name,
        "groups": rows,
        "odd": odd,
        "frames": {str(r): [str(f) for f in s.frames[-6:]] for r, s in stacks.items()},
    }
