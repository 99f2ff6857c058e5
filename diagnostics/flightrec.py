"""Flight-recorder dumps of a hung attempt, analysed with torch's own tooling
(``torch.distributed.flight_recorder.components.builder.build_db``, what ``torchfrtrace`` runs), not
a copy.

Where dumps come from (``stacks/attempt-K/``):
- ``rank-R.flight_recorder``: the rank's answer to the supervisor's stack request
  (``ops/rank/probe.py``): ``_dump_fr_trace()`` (gloo: torch >= 2.8 records gloo collectives when
  ``TORCH_FR_BUFFER_SIZE`` is set; the supervisor sets it and the TorchTitan adapter passes it on as
  ``comm.trace_buf_size``) or ``_dump_nccl_trace()`` (NCCL). A rank that cannot answer (SIGSTOPped,
  stuck in C) leaves none;
- ``flight_recorder_rank_R``: NCCL's own dump on a watchdog timeout (``TORCH_FR_DUMP_TEMP_FILE``);
  under TorchTitan, which sets that variable itself, ``titan/comm_traces/rank_R`` (read when newer
  than the launch).

Dumps are pickles of plain data; they are read with an unpickler that refuses every class, then
handed to torch's ``build_db`` the way its loader would. torch 2.13's gloo dumps carry no group
names or members (``pg_config = {'': {ranks: '[]'}}``): :func:`_fix_pg_config` rebuilds them from
the entries first. torch's analyser also flags gloo ``all_gather`` records as size mismatches
although every rank completed them (``pg_status``); those are kept under ``ignored``, not reported.

Tested for real: gloo on CPU (2-process unit test; the faulted ``hang`` run: rank 1 waits in
collective #N+1 of the default group that rank 0, hanging in Python, never issued). Not tested here:
NCCL dumps (no GPU in CI); they have the same format and a real ``pg_config``, so no fix-up is
applied to them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

from ptops.ops.runrecord.ranks import rank_list

_NAMES = (re.compile(r"rank-(\d+)\.flight_recorder$"), re.compile(r"flight_recorder_rank_(\d+)$"))


def dumps(
    stack_dir: Path, extra_dir: Path | None = None, after_ts: float | None = None
) -> dict[int, Path]:
    """rank -> dump file: the stack folder's, else TorchTitan's dump-on-timeout folder
    (``titan/comm_traces/ rank_R``, shared by every attempt: only files written after ``after_ts``,
    the attempt's launch)."""
    out: dict[int, Path] = {}
    if stack_dir.is_dir():
        for p in sorted(stack_dir.iterdir()):
            for rx in _NAMES:
                m = rx.search(p.name)
                if m and p.is_file() and p.stat().st_size > 0:
                    out.setdefault(int(m.group(1)), p)
    if not out and extra_dir is not None and extra_dir.is_dir():
        for p in sorted(extra_dir.iterdir()):
            m = re.fullmatch(r"rank_(\d+)", p.name)
            if (
                m
                and p.is_file()
                and p.stat().st_size > 0
                and (after_ts is None or p.stat().st_mtime >= after_ts)
            ):
                out[int(m.group(1))] = p
    return out


def _fix_pg_config(details: dict[str, dict[str, Any]], world: list[int]) -> None:
    """gloo dumps (torch 2.13) carry ``pg_config = {'': {ranks: '[]'}}``: no group names, no
    members. Rebuild it from the entries: the default group (``'0'``) holds every rank of the
    attempt; another group holds the ranks whose dumps recorded an operation in it (an assumption: a
    member stuck before its first operation there is not seen). NCCL dumps carry a real config and
    are left alone."""
    members: dict[str, set[int]] = {}
    for d in details.values():
        for e in d.get("entries", []):
            if e.get("process_group"):
                members.setdefault(str(e["process_group"][0]), set()).add(int(d["rank"]))
    for d in details.values():
        pgc = d.get("pg_config") or {}
        used = {tuple(e["process_group"]) for e in d.get("entries", []) if e.get("process_group")}
        if set(pgc) - {""} or not used:
            continue
        pgc.pop("", None)
        for name, desc in sorted(used):
            ranks = sorted(world) if name == "0" else sorted(members.get(name, set()))
            pgc[name] = {"name": name, "desc": desc, "ranks": str(ranks)}
        d["pg_config"] = pgc


class _PlainUnpickler(pickle.Unpickler):
    """Flight-recorder dumps are pickles of plain dicts, lists, strings and numbers: refuse anything
    that names a class or function (a run directory from elsewhere is not trusted to run code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}: refused")


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = _PlainUnpickler(f).load()
    if not isinstance(data, dict) or "entries" not in data:
        raise ValueError(f"{path.name}: not a flight-recorder dump")
    return data


def analyse(
    stack_dir: Path,
    world: int | None = None,
    extra_dir: Path | None = None,
    after_ts: float | None = None,
) -> dict[str, Any] | None:
    """None without dumps; else what torch's analyser says (mismatches, missing ranks), per-rank
    last op."""
    found = dumps(stack_dir, extra_dir, after_ts)
    if not found:
        return None
    out: dict[str, Any] = {
        "ranks": sorted(found),
        "files": [p.name for p in found.values()],
        "tool": "torch.distributed.flight_recorder.components.builder.build_db",
        "mismatches": [],
        "last": {},
        "summary": [],
        "log": [],
    }
    try:
        with contextlib.redirect_stderr(
            io.StringIO()
        ):  # its logger says at import that tabulate is missing
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
    except Exception as e:  # torch missing or its tooling moved: say so, diagnose goes on
        out["error"] = f"torch flight-recorder tooling not importable: {e}"
        out["summary"].append(out["error"])
        return out
    buf = io.StringIO()
    frlog = logging.getLogger("Flight Recorder")
    saved, saved_prop = frlog.handlers[:], frlog.propagate
    frlog.handlers, frlog.propagate = [logging.StreamHandler(buf)], False
    try:
        raw = {r: _load(p) for r, p in found.items()}
        # what torch's loader (read_dump) makes of a file, read without pickle's class loading
        details = {
            p.name: {
                "host_name": f"host_rank{r}",
                "rank": r,
                "entries": raw[r]["entries"],
                "version": raw[r].get("version", ""),
                "pg_config": raw[r].get("pg_config") or {},
            }
            for r, p in found.items()
        }
        version = str(next(iter(raw.values())).get("version", "2.10"))
        for r, d in raw.items():
            ents = [
                e
                for e in d.get("entries") or []
                if tuple(e.get("process_group") or ("0",))[0] == "0"
            ]
            if ents:  # the default group's last operation: the one a stuck rank never reached
                last = ents[-1]
                out["last"][str(r)] = {
                    "seq": last.get("collective_seq_id"),
                    "op": last.get("profiling_name"),
                    "state": last.get("state"),
                }
        # per group name: the last collective every dumped rank saw complete (pg_status is by pg_id)
        done: dict[str, int] = {}
        for d in raw.values():
            names = {
                int(e.get("pg_id", -1)): str(e["process_group"][0])
                for e in d.get("entries", [])
                if e.get("process_group")
            }
            status = d.get("pg_status") if isinstance(d.get("pg_status"), dict) else {}
            for pg_id, st in status.items():
                name = names.get(int(pg_id)) if str(pg_id).lstrip("-").isdigit() else None
                if name is not None and isinstance(st, dict):
                    v = int(st.get("last_completed_collective", -1))
                    done[name] = min(done.get(name, v), v)
        _fix_pg_config(details, list(range(world)) if world else sorted(found))
        with contextlib.redirect_stdout(buf):
            args = JobConfig().parse_args(["--allow-incomplete-ranks"])
            db = build_db(details, args, version)
    except Exception as e:  # a dump torch cannot read is reported, not fatal
        out["error"] = f"{type(e).__name__}: {e}"
        out["summary"].append(f"torch could not analyse the dumps: {out['error']}"[:300])
        return out
    finally:
        frlog.handlers, frlog.propagate = saved, saved_prop
    out["ignored"] = []
    for c in db.collectives:
        if c.missing_ranks or c.mismatch_collectives or c.type_of_mismatch:
            row = {
                "seq": c.collective_seq_id,
                "op": c.collective_name,
                "group": str(c.pg_desc),
                "missing_ranks": sorted(c.missing_ranks or []),
                "state": c.collective_state,
                "type": str(c.type_of_mismatch or "") or None,
            }
            if not row["missing_ranks"] and c.collective_seq_id <= done.get(
                str(c.pg_desc).split(":")[0], -1
            ):
                # completed on every rank: torch's complaint is about how it was recorded (gloo's
                # all_gather sizes), not about the hang
                out["ignored"].append(row)
            else:
                out["mismatches"].append(row)
    out["mismatches"].sort(key=lambda m: (not m["missing_ranks"], m["seq"]))
    out["collectives"] = len(db.collectives)
    seen: list[str] = []
    for ln in buf.getvalue().splitlines():
        if ln.strip() and ln not in seen:
            seen.append(ln)
    out["log"] = seen[:40]
    if out["last"]:
        top = max(v["seq"] or 0 for v in out["last"].values())
        behind = sorted(int(r) for r, v in out["last"].items() if (v["seq"] or 0) < top)
        if behind:
            out["summary"].append(
                f"default group: rank(s) {rank_list(behind, bare=True)} last issued collective "
                f"#{min(out['last'][str(r)]['seq'] or 0 for r in behind)}, others reached #{top}"
            )
    for m in out["mismatches"][:3]:
        miss = (
            f"rank(s) {rank_list(m['missing_ranks'], bare=True)} never joined"
            if m["missing_ranks"]
            else m["type"]
        )
        out["summary"].append(f"collective #{m['seq']} {m['op']}: {miss}")
    if world:
        silent = sorted(set(range(world)) - set(found))
        if silent:
            out["summary"].append(
                f"no dump from rank(s) {rank_list(silent, bare=True)} (it could not answer: "
                "stopped, or stuck outside Python)"
            )
    if not out["mismatches"]:
        out["summary"].append(
            f"{out['collectives']} collective(s) matched; no mismatch among the ranks dumped "
            f"({rank_list(out['ranks'], bare=True)})"
        )
    return out
