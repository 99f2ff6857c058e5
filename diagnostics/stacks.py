"""Hang stacks: read every rank's ``stacks/attempt-K/rank-R.txt`` (or its section of its node's
``node-NAME.txt``), group ranks by the same stack, say where each rank is (its place), name the
odd rank out.

Formats that land there (``ops/supervisor/hangs.py``): the rank's own dump over the channel
(``traceback.format_stack`` per thread) and ``py-spy dump --locals`` for a rank that cannot answer
(SIGSTOPped, stuck in C); read too: faulthandler's dump (``most recent call first``), ``py-spy dump
--json`` and py-spy's ``--native`` frames (``c10d::... (libtorch_cpu.so)``). All are reduced to the
main thread's frames ``(function, file, line)`` with the function's class prefix, absolute path
prefixes, locals and addresses dropped, so the same place reads the same from either source. Ranks
are grouped by their frames' (file, function) sequence: line numbers are shown, not compared (two
ranks in the same function at different lines are waiting in the same place for this purpose).

A rank's **place** (:func:`classify`), from its frames innermost first:
- ``collective``: c10d and functional collectives, a DDP communication hook, FSDP's collectives,
  barrier, rendezvous, a ``c10d::``/``gloo::``/NCCL native frame;
- ``backward``: ``Tensor.backward``, ``torch.autograd.backward``, ``_engine_run_backward``;
- ``forward``: inside an ``nn.Module`` call, not under backward;
- ``eval``: a forward under a ``@torch.no_grad()`` / ``@torch.inference_mode()`` function (only a
  decorator leaves a frame: under ``with torch.no_grad():`` an evaluation reads as ``forward``);
- ``data``: ``torch.utils.data``'s DataLoader and fetchers (a Dataset's ``__getitem__`` under them);
- ``optimizer``: ``torch.optim`` (an optimizer's or scheduler's step), gradient clipping;
- ``checkpoint``: ``torch.save``/``torch.load``, ``torch.distributed.checkpoint``, safetensors,
  ptops' ``ckpt``;
- else ``sleep`` (the innermost line calls ``sleep``, or a native sleep frame) or ``python``
  (plain code: a loop, a lock, anything else).
A collective inside one of the others says which (``within``: ``collective in backward``). With it
the **user frame**: the innermost frame of the user's own files (not the standard library, torch,
or ptops' wrappers), else of another library (torchtitan, transformers), so the on-call reads
``rank 1: forward (train.py:42 in train_step)``.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptops.ops.runrecord.rundir import STACK_SECTION

_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
# faulthandler: no comma before "in", innermost first
_FH_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+?)\s*$')
# py-spy: "Class.method (file:line)"; a --native frame may have no line ("c10d::X::wait (lib.so)")
_PYSPY_FRAME = re.compile(r"^\s{4}(?P<func>\S.*?) \((?P<file>[^()]+?)(?::(?P<line>\d+))?\)\s*$")
_TB_THREAD = re.compile(r'^Thread (?P<id>0x[0-9a-f]+) "(?P<name>[^"]*)"')
_FH_THREAD = re.compile(
    r"^(?P<cur>Current thread|Thread) (?P<id>0x[0-9a-f]+) \(most recent call first\)"
)
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

PLACES = (
    "collective",
    "backward",
    "forward",
    "eval",
    "data",
    "optimizer",
    "checkpoint",
    "sleep",
    "python",
)

# (place, file prefix or fragment of the shortened path, function names or None for any)
_FILE_RULES: tuple[tuple[str, str, frozenset[str] | None], ...] = (
    ("collective", "torch/distributed/distributed_c10d.py", None),
    ("collective", "torch/distributed/_functional_collectives", None),
    ("collective", "torch/distributed/algorithms/ddp_comm_hooks/", None),
    ("collective", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None),
    (
        "collective",
        "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py",
        frozenset(
            {
                "unshard",
                "wait_for_unshard",
                "_wait_all_gather_streams_on_event",
                "finalize_backward",
            }
        ),
    ),
    ("collective", "torch/distributed/fsdp/_flat_param.py", None),
    ("collective", "torch/distributed/rendezvous.py", None),
    (
        "collective",
        "torch/distributed/utils.py",
        frozenset(
            {
                "_verify_param_shape_across_processes",
                "_sync_module_states",
                "_sync_params_and_buffers",
            }
        ),
    ),
    (
        "collective",
        "torch/nn/parallel/distributed.py",
        frozenset({"_sync_buffers", "_sync_module_buffers", "_match_all_reduce_for_bwd_pass"}),
    ),
    ("backward", "torch/autograd/graph.py", frozenset({"_engine_run_backward"})),
    ("backward", "torch/autograd/__init__.py", frozenset({"backward", "grad"})),
    ("backward", "torch/_tensor.py", frozenset({"backward"})),
    ("forward", "torch/nn/modules/module.py", frozenset({"_call_impl", "_wrapped_call_impl"})),
    ("data", "torch/utils/data/", None),
    ("data", "accelerate/data_loader.py", None),
    ("optimizer", "torch/optim/", None),
    ("optimizer", "torch/nn/utils/clip_grad.py", None),
    (
        "checkpoint",
        "torch/serialization.py",
        frozenset({"save", "_save", "_legacy_save", "load", "_load", "_legacy_load"}),
    ),
    ("checkpoint", "torch/distributed/checkpoint/", None),
    ("checkpoint", "safetensors/", None),
    ("checkpoint", "ckpt/", None),
    ("checkpoint", "ptops/ckpt/", None),
    ("checkpoint", "ptops/rank.py", frozenset({"checkpoint", "save", "resume"})),
)
# native frames (py-spy --native): a fragment of the function's name
_NATIVE_RULES: tuple[tuple[str, str], ...] = (
    ("collective", "c10d::"),
    ("collective", "gloo::"),
    ("collective", "nccl"),
    ("collective", "ProcessGroup"),
    ("backward", "torch::autograd::Engine"),
    ("backward", "torch::autograd::python::PythonEngine"),
)
_NATIVE_SLEEP = ("time_sleep", "pysleep", "nanosleep", "clock_nanosleep", "usleep")
_SLEEP_CALL = re.compile(r"(?:^|[.\s(=])sleep\(")
# a function wrapped by @torch.no_grad() / @torch.inference_mode() runs under this frame
_NO_GRAD = ("torch/utils/_contextlib.py", frozenset({"decorate_context"}))
_PTOPS_ROOTS = ("ops", "recipes", "faultinject", "monitors", "ckpt", "diagnostics", "ptops")
_TORCH_ROOTS = ("torch", "torchgen", "functorch", "triton")


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int
    # where the file comes from: "own" (the user's), "lib" (another installed package), "torch",
    # "ptops", "stdlib", "native"; and the source line where the dump shows it
    origin: str = field(default="own", compare=False)
    code: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        if self.origin == "native":  # py-spy --native: a library, no line
            return f"{self.func} ({self.file})"
        return f"{self.func} ({self.file}:{self.line})"

    @property
    def where(self) -> str:
        """``file:line in func`` (how the on-call reads it)."""
        return f"{self.file}:{self.line} in {self.func}"


@dataclass(frozen=True)
class Place:
    place: str  # one of PLACES
    within: str | None = None  # a collective's enclosing place (backward, forward, ...)
    user: Frame | None = None  # the nearest frame of the user's code (else another library's)
    top: Frame | None = None  # the innermost frame that is not plumbing

    def __str__(self) -> str:
        what = self.place + (f" in {self.within}" if self.within else "")
        at = [self.user.where] if self.user is not None else []
        top = self.top
        if top is not None and top.origin in ("own", "lib", "ptops") and top != self.user:
            at.insert(0, top.where)  # an injected fault, a library's loop: where it is exactly
        if not at and top is not None:
            at = [top.where]
        return what + (f" ({', from '.join(at)})" if at else "")


def _rule_place(f: Frame) -> str | None:
    if f.origin == "native":
        return next((p for p, frag in _NATIVE_RULES if frag in f.func), None)
    for place, frag, funcs in _FILE_RULES:
        hit = f.file.startswith(frag) or ("/" + frag) in ("/" + f.file)
        if hit and (funcs is None or f.func in funcs):
            return place
    return None


def _user_frame(frames: list[Frame]) -> Frame | None:
    for origin in ("own", "lib"):
        for f in reversed(frames):
            if f.origin == origin:
                return f
    return None


def _top(frames: list[Frame]) -> Frame | None:
    """The innermost frame that is not plumbing (the interpreter, torch dispatch, threading) nor
    native."""
    py = [f for f in frames if f.origin != "native"]
    for f in reversed(py):
        if not any(p in "/" + f.file for p in _PLUMBING):
            return f
    return py[-1] if py else None


def classify(frames: list[Frame]) -> Place | None:
    """Where a rank is, from its main thread's frames (outermost first): see the module docstring.
    None without frames."""
    if not frames:
        return None
    tags = [_rule_place(f) for f in frames]

    def settle(i: int) -> str:
        """The place of frame ``i``'s tag, given the frames outside it: a forward under backward is
        the backward's recomputation; under a no-grad decorator, an evaluation; an optimizer's
        state under a checkpoint is the checkpoint; a load under the DataLoader is data."""
        p, outer = tags[i], tags[:i]
        if p == "forward":
            if "backward" in outer:
                return "backward"
            if any(f.file.endswith(_NO_GRAD[0]) and f.func in _NO_GRAD[1] for f in frames[:i]):
                return "eval"
        if p == "optimizer" and "checkpoint" in outer:
            return "checkpoint"  # an optimizer's state_dict being saved or loaded
        if p == "checkpoint" and "data" in outer:
            return "data"  # a Dataset that torch.loads its shards
        return p  # type: ignore[return-value]

    user, top = _user_frame(frames), _top(frames)
    for i in range(len(frames) - 1, -1, -1):
        if tags[i] is None:
            continue
        place = settle(i)
        within = None
        if place == "collective":
            within = next(
                (settle(j) for j in range(i - 1, -1, -1) if tags[j] not in (None, "collective")),
                None,
            )
        return Place(place, within, user, top)
    py = [f for f in frames if f.origin != "native"]
    inner = py[-1] if py else frames[-1]
    sleeping = bool(inner.code and _SLEEP_CALL.search(inner.code)) or any(
        f.origin == "native" and any(s in f.func for s in _NATIVE_SLEEP) for f in frames
    )
    return Place("sleep" if sleeping else "python", None, user, top)


@dataclass
class RankStack:
    rank: int
    source: str | None
    frames: list[Frame] = field(default_factory=list)  # main thread, outermost first
    state: str | None = None  # py-spy's thread state (idle, active)
    note: str | None = None  # why there is no stack

    @property
    def key(self) -> tuple[tuple[str, str], ...]:
        return tuple((f.file, f.func) for f in self.frames if f.origin != "native")

    @property
    def top(self) -> Frame | None:
        """The innermost frame that is not plumbing (the interpreter, torch dispatch, threading)."""
        return _top(self.frames)

    @property
    def place(self) -> Place | None:
        return classify(self.frames)

    @property
    def in_collective(self) -> bool:
        p = self.place
        return p is not None and p.place == "collective"


def _short(path: str) -> str:
    """Path without the machine's prefix: from the package root (site-packages/, ptops folders)
    on."""
    p = path.replace("\\", "/")
    if "site-packages/" in p:
        return p.split("site-packages/", 1)[1]
    if "dist-packages/" in p:
        return p.split("dist-packages/", 1)[1]
    m = re.search(r"/lib/python3\.\d+/(.*)$", p)
    if m:
        return m.group(1)
    if not p.startswith("/"):
        return p  # py-spy's paths are already relative to sys.path (torch/nn/modules/module.py)
    for root in ("ops/", "recipes/", "faultinject/", "monitors/", "ckpt/", "diagnostics/"):
        i = p.find("/" + root)
        if i >= 0:
            return p[i + 1 :]
    return p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] if p.count("/") >= 2 else p


_NATIVE_FILE = re.compile(r"\.(so(\.\d+)*|c|cc|cpp|cxx|h|hpp|cu)$")


def _origin(raw: str, short: str, func: str, native_ok: bool = False) -> str:
    """Where a frame's file comes from (see :class:`Frame`). ``raw`` is the path as the dump
    wrote it: absolute in a traceback, relative to ``sys.path`` in py-spy's text."""
    p = raw.replace("\\", "/")
    if native_ok and (_NATIVE_FILE.search(p) or ("::" in func and not p.endswith(".py"))):
        return "native"
    if p.startswith("<frozen") or short.startswith("<frozen"):
        return "stdlib"
    first = short.split("/", 1)[0]
    if first in _TORCH_ROOTS:
        return "torch"
    packaged = "site-packages/" in p or "dist-packages/" in p
    if first in _PTOPS_ROOTS and (not packaged or first == "ptops"):
        return "ptops"
    if packaged:
        return "lib"
    if re.search(r"/lib/python3\.\d+/", p):
        return "stdlib"
    if not p.startswith("/") and first.removesuffix(".py") in sys.stdlib_module_names:
        return "stdlib"  # py-spy's relative paths: "threading.py", "concurrent/futures/thread.py"
    return "own"


@functools.lru_cache(maxsize=65536)
def _file_info(file: str, func: str, native: bool) -> tuple[str, str]:
    """(short path, origin): the same files come back in every rank's stack (thousands of ranks)."""
    short = _short(file)
    return short, _origin(file, short, func, native)


def _frame(func: str, file: str, line: Any, code: str | None = None, native: bool = False) -> Frame:
    short, origin = _file_info(file, func if native else "", native)
    try:
        n = int(line) if line is not None else 0
    except (TypeError, ValueError):
        n = 0
    return Frame(func, short, n, origin, code)


def _parse_json(text: str) -> list[tuple[str, str | None, list[Frame]]] | None:
    """``py-spy dump --json``: a list of threads, each with its frames innermost first."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return None
    threads = []
    for t in data:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        state = "active" if t.get("active") else "idle"
        frames = []
        for f in t["frames"]:
            if not isinstance(f, dict):
                continue
            name = str(f.get("name") or "?")
            file = str(f.get("filename") or f.get("short_filename") or "?")
            native = "::" in name or bool(_NATIVE_FILE.search(file))
            frames.insert(
                0,
                _frame(
                    name if native else name.rsplit(".", 1)[-1], file, f.get("line"), None, native
                ),
            )
        threads.append((str(t.get("thread_name") or "?"), state, frames))
    return threads


def parse(text: str, rank: int) -> RankStack:
    """One rank's stack file -> its main thread's frames (any format)."""
    src = None
    threads: list[tuple[str, str | None, list[Frame]]] = []  # (name, state, frames)
    fmt = None  # "tb" (the rank's own dump), "pyspy", "fh" (faulthandler)
    body: list[str] = []
    last_tb: int | None = None  # the traceback frame the next source line belongs to
    for raw in text.splitlines():
        m = _SOURCE.match(raw)
        if m and src is None:
            src = m.group("src").strip()
            continue
        if not threads and not raw.startswith("#"):
            body.append(raw)
        m = _TB_THREAD.match(raw)
        if m:
            fmt = "tb"
            threads.append((m.group("name"), None, []))
            continue
        m = _PYSPY_THREAD.match(raw)
        if m:
            fmt = "pyspy"
            threads.append((m.group("name"), m.group("state"), []))
            continue
        m = _FH_THREAD.match(raw)
        if m:
            fmt = "fh"
            # faulthandler names no thread: the main one is told by its outermost frame below
            threads.append(("current" if m.group("cur") != "Thread" else "?", None, []))
            continue
        if not threads:
            continue
        frames = threads[-1][2]
        if fmt == "pyspy":
            m = _PYSPY_FRAME.match(raw)
            if m:  # py-spy: innermost first; "Class.method"; --native: "ns::Class::fn (lib.so)"
                func, file = m.group("func"), m.group("file")
                native = m.group("line") is None or "::" in func or bool(_NATIVE_FILE.search(file))
                if not native:
                    func = func.rsplit(".", 1)[-1]
                frames.insert(0, _frame(func, file, m.group("line"), None, native))
        elif fmt == "fh":
            m = _FH_FRAME.match(raw)
            if m:
                frames.insert(0, _frame(m.group("func"), m.group("file"), m.group("line")))
        else:
            m = _TB_FRAME.match(raw)
            if m:
                frames.append(_frame(m.group("func"), m.group("file"), m.group("line")))
                last_tb = len(frames) - 1
            elif last_tb is not None and raw.strip() and last_tb == len(frames) - 1:
                f = frames[last_tb]  # the source line traceback prints under its frame
                frames[last_tb] = Frame(f.func, f.file, f.line, f.origin, raw.strip())
                last_tb = None
    if not threads:
        joined = "\n".join(body).strip()
        got = _parse_json(joined) if joined[:1] in ("[", "{") else None
        if got:
            threads = got
    if not threads:
        note = next(
            (ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("# no stack")),
            None,
        )
        return RankStack(rank, src, note=note or "no stack in the file")
    main = next((t for t in threads if t[0] == "MainThread"), None)
    if main is None:  # faulthandler: the thread that runs the script's module
        main = next(
            (t for t in threads if t[2] and t[2][0].func in ("<module>", "_run_module_as_main")),
            threads[0],
        )
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
    """Ranks grouped by identical main-thread stack, each group's place (``place``, ``within``,
    ``user_frame``, and ``where``: the three in words, ``forward (train.py:11 in forward)``), and
    the odd rank(s) out; None without stack files.

    The odd group: the one not in a collective when the others are (everyone waits for it), else
    the smallest group; a tie goes to the ranks the hang event blamed, then to a rank that is not
    in backward or its optimizer step (DDP and FSDP reduce gradients in backward: a rank there
    most likely waits for one still in its forward or its data).
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
        pl = s.place
        rows.append(
            {
                "ranks": ranks,
                "frame": str(s.top) if s.top else None,
                "place": pl.place if pl else None,
                "within": pl.within if pl else None,
                "user_frame": pl.user.where if pl and pl.user else None,
                "where": str(pl) if pl else None,
                "in_collective": bool(pl and pl.place == "collective"),
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
        cands = [g for g in cands if set(g["ranks"]) & set(blamed)] or cands
        later = {"backward": 1, "optimizer": 2}  # past the step's forward
        odd = min(cands, key=lambda g: later.get(g["place"], 0))
    elif blamed and rows[0]["frame"]:
        odd = None  # every rank in the same place: nobody is odd
    return {
        "dir": stack_dir.name,
        "groups": rows,
        "odd": odd,
        "frames": {str(r): [str(f) for f in s.frames[-6:]] for r, s in stacks.items()},
    }
