"""Flight-recorder dumps of a hung attempt, analysed with torch's own tooling
(``torch.distributed.flight_recorder``: the ``torchfrtrace`` loader and ``build_db``), not a copy of it.

Where dumps come from (``stacks/attempt-K/``):
- ``rank-R.flight_recorder``: the rank's answer to the supervisor's stack request (``ops/rank/probe.py``),
  ``torch._C._distributed_c10d._dump_fr_trace()`` (gloo, recorded when ``TORCH_FR_BUFFER_SIZE`` is set; the
  supervisor sets it) or ``_dump_nccl_trace()`` (NCCL, ``TORCH_NCCL_TRACE_BUFFER_SIZE``);
- ``flight_recorder_rank_R``: NCCL's own dump on a watchdog timeout (``TORCH_FR_DUMP_TEMP_FILE``).

torch 2.13's gloo dumps name the default group ``''`` in ``pg_config`` while their entries say ``'0'``;
``build_db`` then fails with a KeyError. :func:`_fix_pg_config` maps the entries' group names onto the
config's members (same ranks) before handing the dumps to torch. Tested with real gloo dumps (CPU); NCCL
dumps share the format but were not tested here (no GPU in CI).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

_NAMES = (re.compile(r"rank-(\d+)\.flight_recorder$"), re.compile(r"flight_recorder_rank_(\d+)$"))


def dumps(stack_dir: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    if not stack_dir.is_dir():
        return out
    for p in sorted(stack_dir.iterdir()):
        for rx in _NAMES:
            m = rx.search(p.name)
            if m and p.is_file() and p.stat().st_size > 0:
                out.setdefault(int(m.group(1)), p)
    return out


def _fix_pg_config(details: dict[str, dict[str, Any]]) -> None:
    for d in details.values():
        pgc = d.get("pg_config") or {}
        used = {tuple(e["process_group"]) for e in d.get("entries", []) if e.get("process_group")}
        if "" in pgc and not any(name in pgc for name, _ in used):
            base = pgc.pop("")
            for name, desc in used:
                pgc.setdefault(name, {"name": name, "desc": desc, "ranks": base.get("ranks", "[]")})


def analyse(stack_dir: Path) -> dict[str, Any] | None:
    """None without dumps; else what torch's analyser says (mismatches, missing ranks), per-rank last op."""
    found = dumps(stack_dir)
    if not found:
        return None
    out: dict[str, Any] = {"ranks": sorted(found), "files": [p.name for p in found.values()],
                           "tool": "torch.distributed.flight_recorder (read_dir + build_db)",
                           "mismatches": [], "last": {}, "summary": [], "log": []}
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its logger says at import that tabulate is missing
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
            from torch.distributed.flight_recorder.components.loader import read_dir
    except Exception as e:  # noqa: BLE001 - torch missing or its tooling moved: say so, diagnose goes on
        out["error"] = f"torch flight-recorder tooling not importable: {e}"
        out["summary"].append(out["error"])
        return out
    with tempfile.TemporaryDirectory(prefix="ptops-fr-") as tmp:
        for r, p in found.items():
            shutil.copyfile(p, Path(tmp) / f"fr_rank_{r}")
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        frlog = logging.getLogger("Flight Recorder")
        saved = frlog.handlers[:]
        frlog.handlers = [handler]
        frlog.propagate = False
        try:
            with contextlib.redirect_stdout(buf):
                args = JobConfig().parse_args([tmp, "--prefix", "fr_rank_", "--allow-incomplete-ranks"])
                details, version = read_dir(args)
                for d in details.values():
                    ents = d.get("entries") or []
                    if ents:
                        last = ents[-1]
                        out["last"][str(d["rank"])] = {"seq": last.get("collective_seq_id"),
                                                       "op": last.get("profiling_name"), "state": last.get("state")}
                _fix_pg_config(details)
                db = build_db(details, args, version)
        except Exception as e:  # noqa: BLE001 - a dump torch cannot read is reported, not fatal
            out["error"] = f"{type(e).__name__}: {e}"
            out["summary"].append(f"torch could not analyse the dumps: {out['error']}"[:300])
            return out
        finally:
            frlog.handlers = saved
    for c in db.collectives:
        if c.missing_ranks or c.mismatch_collectives or c.type_of_mismatch:
            out["mismatches"].append({"seq": c.collective_seq_id, "op": c.collective_name,
                                      "missing_ranks": sorted(c.missing_ranks or []),
                                      "state": c.collective_state, "type": str(c.type_of_mismatch or "") or None})
    out["collectives"] = len(db.collectives)
    out["log"] = [ln for ln in buf.getvalue().splitlines() if ln.strip()][:40]
    for m in out["mismatches"][:3]:
        miss = f"rank(s) {','.join(map(str, m['missing_ranks']))} never joined" if m["missing_ranks"] else m["type"]
        out["summary"].append(f"collective #{m['seq']} {m['op']}: {miss}")
    if not out["mismatches"]:
        out["summary"].append(f"{out['collectives']} collective(s) matched on every rank; no mismatch")
    return out
