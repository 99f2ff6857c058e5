"""Where a step's time goes, per rank, from the Chrome traces ``ptops profile`` stores.

Pure: traces (dicts) in, one report (dict) out, so a stored capture is analysed again the
same way (``ptops profile RUN_DIR --id ID``) and tests feed it small synthetic traces.

What the traces hold (``ops/rank/profiler.py``): one ``ptops/step#S`` range per step on the
training thread, spanning everything the rank does from one step boundary to the next, and
``ptops/data`` ranges around fetching batches. Every instant of a step on the training
thread is put in exactly one part, in this order:

- **data loading**: inside a ``ptops/data`` range;
- **collectives**: inside a communication op of the training thread (``c10d::*``,
  ``_c10d_functional::*`` such as ``wait_tensor``, ``nccl:*``/``gloo:*``, FSDP's ``*_wait``
  ranges), or not running an ``aten::`` operator while a collective (``gloo:*``/``nccl:*``) is
  in progress on a communication thread (a blocking ``work.wait()`` shows no op of its own);
- **compute**: the rest: operators, Python, sleeps (a ``slow`` fault's sleep is compute:
  it is time outside collectives, which is what makes the peers wait).

Collective time is then split with the peers: for each step, the least collective time any
rank spent is **communication** (what the transfers take when nobody is late), and what a
rank spent beyond it is **waiting for peers**. The same split per collective kind
(all_reduce, all_gather, ...) says where the peers wait. Parts are averaged over the steps
every rank traced, in seconds per step.

The slow rank is the one with the most time outside collectives (compute + data loading),
named when it exceeds the median of the other ranks by at least ``SLOW_MIN_FRACTION`` of the
mean step time (and ``SLOW_MIN_S``); the slow part is whichever of its compute and data
loading exceeds the peers' most. Limits: the training thread's CPU timeline only (on GPU
ranks, time the host blocks in CUDA synchronisation counts as compute).
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any, Mapping

STEP_PREFIX = "ptops/step#"
DATA_RANGE = "ptops/data"
PARTS = ("compute", "communication", "waiting", "data")
SLOW_MIN_FRACTION = 0.10
SLOW_MIN_S = 0.001

# communication ops on the training thread (the whole op counts, children included)
_COMM_OP = re.compile(
    r"^(c10d::|_c10d_functional::|c10d_functional::|nccl:|gloo:|mpi:|ucc:|record_param_comms)"
    r"|^FSDP::\S*wait|wait_tensor"
)
# a collective in progress on a communication thread (ProcessGroupGloo's worker, NCCL's watchdog)
_WORKER_COLL = re.compile(r"^(gloo|nccl|mpi|ucc):")
_KINDS = (
    ("reduce_scatter", ("reduce_scatter", "reducescatter")),
    ("all_reduce", ("all_reduce", "allreduce")),
    ("all_gather", ("all_gather", "allgather")),
    ("all_to_all", ("all_to_all", "alltoall")),
    ("broadcast", ("broadcast",)),
    ("barrier", ("barrier",)),
    ("send_recv", ("send", "recv")),
)


class TraceError(Exception):
    """A trace that cannot be analysed (one line: which file, what is wrong)."""


def collective_kind(name: str) -> str:
    n = name.lower()
    for kind, words in _KINDS:
        if any(w in n for w in words):
            return kind
    return "other"


def _x_events(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    events = trace.get("traceEvents") if isinstance(trace, Mapping) else None
    if not isinstance(events, list):
        raise TraceError("not a Chrome trace (no traceEvents list)")
    out = []
    for e in events:
        if (
            isinstance(e, dict)
            and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))
            and isinstance(e.get("name"), str)
        ):
            out.append(e)
    return out


def rank_steps(trace: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """One rank's steps: ``{step: {wall_s, compute_s, collectives_s, data_s, by_kind: {kind:
    s}}}``."""
    events = _x_events(trace)
    steps = [e for e in events if e["name"].startswith(STEP_PREFIX)]
    if not steps:
        raise TraceError(f"no {STEP_PREFIX}N ranges (not a trace taken by `ptops profile`)")
    main = steps[0].get("tid")
    # sweep points: (time, 0 = end / 1 = start, -duration for nesting order, what, event index)
    points: list[tuple[float, int, float, str, int]] = []

    def add(what: str, i: int, e: dict[str, Any]) -> None:
        t0, t1 = float(e["ts"]), float(e["ts"]) + max(0.0, float(e["dur"]))
        points.append((t0, 1, -(t1 - t0), what, i))
        points.append((t1, 0, 0.0, what, i))

    for i, e in enumerate(events):
        name = e["name"]
        if e.get("tid") == main:
            if name.startswith(STEP_PREFIX):
                add("step", i, e)
            elif name == DATA_RANGE:
                add("data", i, e)
            else:
                add("main", i, e)
        elif _WORKER_COLL.match(name):
            add("coll", i, e)
    points.sort()
    out: dict[int, dict[str, Any]] = {}
    active_step: int | None = None
    stack: list[int] = []  # main-thread events, outermost first
    comm_depth = 0  # comm ops on the stack
    data_depth = 0
    colls: list[int] = []  # collectives in progress on other threads
    prev = points[0][0] if points else 0.0
    for t, is_start, _, what, i in points:
        if active_step is not None and t > prev:
            seg = (t - prev) / 1e6
            rec = out[active_step]
            top = events[stack[-1]]["name"] if stack else None
            if data_depth:
                rec["data_s"] += seg
            elif comm_depth or (colls and not (top or "").startswith("aten::")):
                rec["collectives_s"] += seg
                inner = (
                    events[colls[-1]]["name"]
                    if colls
                    else next(
                        (
                            events[j]["name"]
                            for j in reversed(stack)
                            if _COMM_OP.search(events[j]["name"])
                        ),
                        "other",
                    )
                )
                kind = collective_kind(inner)
                rec["by_kind"][kind] = rec["by_kind"].get(kind, 0.0) + seg
            else:
                rec["compute_s"] += seg
        prev = t
        e = events[i]
        if what == "step":
            if is_start:
                active_step = int(e["name"][len(STEP_PREFIX) :].split()[0])
                rec = out.setdefault(
                    active_step,
                    {
                        "wall_s": 0.0,
                        "compute_s": 0.0,
                        "collectives_s": 0.0,
                        "data_s": 0.0,
                        "by_kind": {},
                    },
                )
                rec["wall_s"] += float(e["dur"]) / 1e6
            else:
                active_step = None
        elif what == "data":
            data_depth += 1 if is_start else -1
        elif what == "coll":
            if is_start:
                colls.append(i)
            elif i in colls:
                colls.remove(i)
        else:
            comm = bool(_COMM_OP.search(e["name"]))
            if is_start:
                stack.append(i)
                comm_depth += comm
            elif i in stack:
                stack.remove(i)
                comm_depth -= comm
    return out


def analyse(traces: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The breakdown of several ranks' traces of the same profile (see the module docstring)."""
    per: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, trace in sorted(traces.items()):
        try:
            per[int(rank)] = rank_steps(trace)
        except TraceError as e:
            raise TraceError(f"rank {rank}: {e}") from None
    if not per:
        raise TraceError("no traces to analyse")
    common = sorted(set.intersection(*(set(s) for s in per.values())))
    if not common:
        spans = ", ".join(f"rank {r}: steps {min(s)}..{max(s)}" for r, s in per.items() if s)
        raise TraceError(f"the ranks traced no step in common ({spans})")
    ranks = sorted(per)
    kinds = sorted({k for steps in per.values() for s in common for k in steps[s]["by_kind"]})
    rows: dict[int, dict[str, Any]] = {
        r: {
            "rank": r,
            "step_s": 0.0,
            "compute_s": 0.0,
            "communication_s": 0.0,
            "waiting_s": 0.0,
            "data_s": 0.0,
            "collectives": {k: {"s": 0.0, "waiting_s": 0.0} for k in kinds},
        }
        for r in ranks
    }
    n = len(common)
    for s in common:
        floor = min(per[r][s]["collectives_s"] for r in ranks)
        kind_floor = {k: min(per[r][s]["by_kind"].get(k, 0.0) for r in ranks) for k in kinds}
        for r in ranks:
            st, row = per[r][s], rows[r]
            row["step_s"] += st["wall_s"] / n
            row["compute_s"] += st["compute_s"] / n
            row["data_s"] += st["data_s"] / n
            row["communication_s"] += floor / n
            row["waiting_s"] += (st["collectives_s"] - floor) / n
            for k in kinds:
                got = st["by_kind"].get(k, 0.0)
                row["collectives"][k]["s"] += got / n
                row["collectives"][k]["waiting_s"] += max(0.0, got - kind_floor[k]) / n
    per_rank = []
    for r in ranks:
        row = rows[r]
        row["outside_collectives_s"] = row["compute_s"] + row["data_s"]
        per_rank.append(_rounded(row))
    verdict = _verdict(per_rank)
    return {
        "steps": common,
        "ranks": ranks,
        "per_rank": per_rank,
        "per_step": {str(r): {str(s): _rounded(per[r][s]) for s in sorted(per[r])} for r in ranks},
        **verdict,
        "definitions": {
            "compute": "training thread outside collectives and data loading: operators, Python, "
            "sleeps",
            "communication": "inside collectives, the least any rank spent in that step",
            "waiting": "inside collectives beyond the least any rank spent in that step (waiting "
            "for peers)",
            "data": "inside ptops/data ranges (fetching the batch)",
        },
    }


def _rounded(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (round(v, 6) if isinstance(v, float) else _rounded(v) if isinstance(v, Mapping) else v)
        for k, v in d.items()
    }


def _verdict(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    mean_step = statistics.fmean(r["step_s"] for r in per_rank)
    totals = {p: statistics.fmean(r[f"{p}_s"] for r in per_rank) for p in PARTS}
    biggest = max(PARTS, key=lambda p: totals[p])
    share = totals[biggest] / mean_step if mean_step > 0 else 0.0
    out: dict[str, Any] = {
        "slow_rank": None,
        "slow_part": None,
        "excess_s": None,
        "peers_wait_in": None,
        "peers_wait_s": None,
        "biggest_part": biggest,
        "biggest_share": round(share, 4),
    }
    if len(per_rank) > 1:
        slow = max(per_rank, key=lambda r: r["outside_collectives_s"])
        peers = [r for r in per_rank if r is not slow]
        excess = slow["outside_collectives_s"] - statistics.median(
            r["outside_collectives_s"] for r in peers
        )
        if excess >= max(SLOW_MIN_S, SLOW_MIN_FRACTION * mean_step):
            d_compute = slow["compute_s"] - statistics.median(r["compute_s"] for r in peers)
            d_data = slow["data_s"] - statistics.median(r["data_s"] for r in peers)
            part = "data loading" if d_data > d_compute else "compute"
            wait_by_kind: dict[str, float] = {}
            for r in peers:
                for k, v in r["collectives"].items():
                    wait_by_kind[k] = wait_by_kind.get(k, 0.0) + v["waiting_s"] / len(peers)
            where = max(wait_by_kind, key=lambda k: wait_by_kind[k]) if wait_by_kind else None
            peers_wait = statistics.fmean(r["waiting_s"] for r in peers)
            if where is not None and wait_by_kind[where] <= 0:
                where = None
            out.update(
                slow_rank=slow["rank"],
                slow_part=part,
                excess_s=round(excess, 4),
                peers_wait_in=where,
                peers_wait_s=round(peers_wait, 4),
            )
            tail = (
                f"its peers wait in {where}: {peers_wait:.2f} s/step"
                if where
                else f"its peers wait {peers_wait:.2f} s/step"
            )
            out["verdict"] = (
                f"rank {slow['rank']} is the slow rank: +{excess:.2f} s/step outside collectives, "
                f"in {part} ({tail})"
            )
            return out
        spread = max(r["outside_collectives_s"] for r in per_rank) - min(
            r["outside_collectives_s"] for r in per_rank
        )
        out["verdict"] = (
            f"no slow rank (outside collectives the ranks are within {spread:.3f} s/step of each "
            "other); "
            f"the step goes mostly to {_words(biggest)} ({share:.0%})"
        )
    else:
        out["verdict"] = f"one rank: the step goes mostly to {_words(biggest)} ({share:.0%})"
    return out


def _words(part: str) -> str:
    return {"data": "data loading", "waiting": "waiting for peers"}.get(part, part)


def load_trace(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            trace = json.load(f)
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror or e})") from None
    except ValueError as e:
        raise TraceError(f"{path}: not JSON ({e})") from None
    if not isinstance(trace, dict):
        raise TraceError(f"{path}: not a Chrome trace (expected a JSON object)")
    return trace


def analyse_files(paths: Mapping[int, Path]) -> dict[str, Any]:
    traces = {}
    for rank, path in sorted(paths.items()):
        trace = load_trace(Path(path))
        try:
            rank_steps(trace)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None
        traces[rank] = trace
    return analyse(traces)


def write_summary(folder: Path, report: Mapping[str, Any]) -> Path:
    """``summary.json`` beside the traces (0600, replaced atomically)."""
    path = Path(folder) / "summary.json"
    tmp = path.with_name(f".summary.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def render(report: Mapping[str, Any]) -> str:
    steps: list[int] = list(report.get("steps") or [])
    span = f"steps {steps[0]}..{steps[-1]} ({len(steps)})" if steps else "no steps"
    lines = [
        f"profile {report.get('id', '?')}: {span}, ranks "
        f"{', '.join(map(str, report.get('ranks', [])))}; "
        "seconds per step (share of the step)"
    ]
    lines.append(
        f"{'rank':>4}  {'step':>7}  {'compute':>14}  {'communication':>14}  {'waiting':>14}  "
        f"{'data':>14}"
    )
    for r in report.get("per_rank", []):
        step = r["step_s"] or 0.0

        def cell(v: float) -> str:
            return f"{v:7.3f} {v / step:5.0%}" if step > 0 else f"{v:7.3f}      "

        lines.append(
            f"{r['rank']:>4}  {step:7.3f}  {cell(r['compute_s']):>14}  "
            f"{cell(r['communication_s']):>14}  "
            f"{cell(r['waiting_s']):>14}  {cell(r['data_s']):>14}"
        )
    lines.append(str(report.get("verdict", "")))
    traces = report.get("traces") or {}
    if traces:
        lines.append(f"traces: {', '.join(traces.values())}  (open in https://ui.perfetto.dev)")
    if report.get("summary"):
        lines.append(f"summary: {report['summary']}")
    return "\n".join(lines)
