"""``ptops diagnose``: what happened in a run, which rank, which runbook.

Replays the monitors over the run directory's ``metrics.jsonl`` (so it works on
a run that never had monitors on, or on a copy from another machine), with the
run's own ``[monitors]`` configuration from ``recipe.json`` when it has one and
the defaults otherwise, and merges the findings with ``events.jsonl`` (crashes,
hangs, restarts, rollbacks, invalid checkpoints, live findings) into one
incident timeline.

The JSON shape (``diagnose(...)`` returns it; ``ptops diagnose --json`` prints it)
is stable; keys are only ever added::

    {
      "run_dir": str, "recipe": str | null, "config": "recipe.json" | "defaults",
      "metrics_records": int, "ranks": [int], "last_step": int | null,
      "findings": [ {"source": "replay" | "event", "monitor": str, "family": str,
                     "step": int | null, "rank": int | null, "host": str | null,
                     "value": float | str | null, "detail": str, "severity": str,
                     "runbook": str | null, "ts": float | null, "attempt": int | null,
                     "live": bool, "episode": int | null,
                     "phase": "open" | "escalate" | "resolved" | null} ],
      "events_summary": {"state": str, "attempts": int, "counts": {kind: n},
                         "crashes": [...], "hangs": [...], "rollbacks": [...], "restarts": int,
                         "checkpoints": int, "last_checkpoint_step": int | null,
                         "checkpoint_invalid": [...], "first_ts": float | null,
                         "last_ts": float | null},
      "timeline": [ {"ts": float | null, "step": int | null, "kind": str, "what": str,
                     "runbook": str | null} ],
      "notes": [str],
      "incidents": [ {"id": int, "kind": "crash" | "hang" | "numeric" | "straggler" | "rl" |
                      "checkpoint" | "preempt" | "stop" | "failed" | "monitor" | "sdc",
                      "title": str,
                      "severity": "critical" | "warning" | "info", "ts": float | null,
                      "ts_end": float | null, "attempt": int | null, "step": int | null,
                      "rank": int | null, "ranks": [int], "host": str | null, "evidence": [str],
                      "runbook": str | null, "action": str | null,
                      "details": {...kind-specific...}} ],          (diagnostics/incidents.py)
      "filters": {"attempt": int | null, "since": float | null},
      "goodput": {"ratio": float | null, "wall_s", "productive_s", "lost_s": {cause: s}}
                 (the whole run, filters aside; ops/runrecord/goodput.py),
      "baseline": {"run_dir", "baselines", "compared", "diverged", "first_divergent_step",
                   "per_metric"}
                  (only with baselines=...; diagnostics/baseline.py)
    }

``attempt=K`` keeps only that attempt's incidents, findings and timeline; ``since=T`` (unix seconds,
see :func:`parse_since`) only what happened at or after T (entries without a time are dropped).

``value`` is a number, or the string "nan"/"inf"/"-inf", or null.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ptops.diagnostics import incidents as _incidents
from ptops.monitors import FAMILIES, Finding, MonitorsSection, build_monitors, replay
from ptops.monitors import RUNBOOKS as MONITOR_RUNBOOKS
from ptops.monitors.base import number
from ptops.ops.runrecord.events import (
    INCIDENT_KINDS,
    MONITOR_FINDING_KINDS,
    SPECS,
    EventKind,
    reduce,
    spec,
)
from ptops.ops.runrecord.goodput import Goodput, rounded
from ptops.ops.runrecord.metrics import MetricsIndexError, live_rank0, segments, tail_records
from ptops.ops.runrecord.ranks import compact
from ptops.ops.runrecord.rundir import RunDir, read_jsonl

# monitor or event kind -> runbook (runbooks/<Name>.md): the monitor registry's, then the event
# vocabulary's
RUNBOOKS: dict[str, str] = {
    **MONITOR_RUNBOOKS,
    **{str(k): sp.runbook for k, sp in SPECS.items() if sp.runbook},
}


# a rotated run (metrics/) replays its last this many MB of records (~57,000 titan records: a few
# seconds), not all of them; --full replays all (docs/scale.md)
WINDOW_BYTES = 32 << 20


class DiagnoseError(Exception):
    """One line for the user; the CLI exits 2 with it."""


def load_section(run: RunDir) -> tuple[MonitorsSection, str]:
    """The run's ``[monitors]`` section from recipe.json, else the defaults."""
    path = run.recipe_json
    if not path.is_file():
        return MonitorsSection(), "defaults"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DiagnoseError(f"{path}: not readable JSON ({e})") from None
    raw = data.get("monitors") if isinstance(data, dict) else None
    if raw is None:
        return MonitorsSection(), "defaults"
    from pydantic import ValidationError

    try:
        return MonitorsSection.model_validate(raw), "recipe.json"
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in ("monitors", *err["loc"]))
        raise DiagnoseError(f"{path}: key '{key}': {err['msg'].lower()}") from None


def _rank_detail_every(run: RunDir) -> tuple[int, bool]:
    """``supervisor.metrics_rank_detail_every`` of the run's recipe.json (1 when absent or not a
    positive int: a copied run directory is not trusted), and whether its node agents summed up
    on the wire (``node_summaries`` true)."""
    try:
        sup = json.loads(run.recipe_json.read_text()).get("supervisor")
        every = sup.get("metrics_rank_detail_every") if isinstance(sup, dict) else None
        wire = sup.get("node_summaries") is True if isinstance(sup, dict) else False
    except (OSError, ValueError, AttributeError):
        return 1, False
    return (every, wire) if type(every) is int and every > 1 else (1, False)


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _hosts(events: list[dict[str, Any]]) -> dict[int, str]:
    """rank -> host from any event that lists ``ranks`` as ``[{rank, host, ...}]`` (the newest
    wins)."""
    out: dict[int, str] = {}
    for e in events:
        ranks = e.get("ranks")
        if isinstance(ranks, list):
            for r in ranks:
                if isinstance(r, dict) and "rank" in r and r.get("host"):
                    try:
                        out[int(r["rank"])] = str(r["host"])
                    except (TypeError, ValueError):
                        pass
    return out


class _Pass:
    """What diagnose needs of every record, gathered in one streaming pass (a run directory at
    scale does not fit in memory as a list): counts, ranks, attempts, the last step, the goodput
    account, and the records the incidents read (``kept``): rank 0's (the context around a numeric
    incident), those of each rank an event names (a crash's last step and memory curve), and each
    attempt's furthest record (its last step). With baselines, every record cut to the curves'
    keys."""

    def __init__(self, events: list[dict[str, Any]], want_curves: bool = False) -> None:
        self.count = 0
        self.ranks: set[int] = set()
        self.attempts: set[int] = set()
        self.last_step: int | None = None
        self._goodput = Goodput()
        for e in events:
            self._goodput.event(e)
        self._named = {e["rank"] for e in events if type(e.get("rank")) is int}
        self._kept: list[dict[str, Any]] = []
        self._top: dict[Any, dict[str, Any]] = {}  # attempt -> its record of the highest step
        self.curves: list[dict[str, Any]] = []
        self._want_curves = want_curves

    def rotated(self, run: RunDir, segs: list[Any]) -> None:
        """A rotated run's whole-run account without reading its segments: their index lines
        (counts, last step, attempts, rank 0's records), then rank 0's records of the live file
        (other ranks' lines counted, not parsed). The monitors then see only the window
        (``feed(..., account=False)``)."""
        for info in (s.info for s in segs):
            self.count += info.get("lines") or 0
            self.attempts.update(a for a in info.get("attempts", []) if isinstance(a, int))
            for _ in self.feed(info.get("rank0", []), window=False):
                pass
            top = info.get("max_step")
            if isinstance(top, int) and (self.last_step is None or top > self.last_step):
                self.last_step = top
        recs, lines = live_rank0(run.path)
        self.count += lines
        for _ in self.feed(recs, window=False):
            pass

    def feed(self, records: Any, account: bool = True, window: bool = True) -> Any:
        """Every record, or (a rotated run) rank 0's for the whole-run ``account`` and the
        ``window``'s records for the rest."""
        from ptops.diagnostics.baseline import slim

        named, kept, top, ranks = self._named, self._kept, self._top, self.ranks
        counted = account and window
        for r in records:  # the per-record cost here adds to the replay's: kept lean
            get = r.get
            step, rank = get("step"), get("rank", 0)
            if counted:
                self.count += 1
            if isinstance(rank, int) and "rank" in r:
                ranks.add(rank)
            att = get("attempt", 1)
            if isinstance(att, int) and "attempt" in r:
                self.attempts.add(att)
            if rank == 0:
                if account:
                    self._goodput.record(r)
                    kept.append(r)
            elif window and isinstance(rank, (int, float)) and rank in named:
                kept.append(r)
            if isinstance(step, int):
                if self.last_step is None or step > self.last_step:
                    self.last_step = step
                key = att if isinstance(att, int) else None  # None: the furthest of any attempt
                t = top.get(key)
                if t is None or step > t["step"]:
                    top[key] = r
                if key is not None:
                    t = top.get(None)
                    if t is None or step > t["step"]:
                        top[None] = r
            if self._want_curves:
                self.curves.append(slim(r))
            yield r

    def kept(self) -> list[dict[str, Any]]:
        """The kept records in file order, then the furthest records not kept already (only
        ``_last_step`` reads those, and it takes a maximum)."""
        ids = {id(r) for r in self._kept}
        extra = {id(r): r for r in self._top.values() if id(r) not in ids}
        return self._kept + list(extra.values())

    def goodput(self, now: float | None) -> dict[str, Any]:
        return rounded(self._goodput.summary(now))


def _event_what(e: dict[str, Any]) -> str:
    kind = e.get("kind", "?")
    skip = {"ts", "kind"}
    fields = ", ".join(
        f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"
        for k, v in ((k, compact(k, v)) for k, v in e.items())  # a rank list as ranges
        if k not in skip and not (k == "ranks_text" and "ranks" in e)
    )
    return f"{kind} {fields}".strip()


def _behind_note(events: list[dict[str, Any]]) -> str | None:
    """A note when the supervisor fell behind its inbox: its hang findings in those windows came
    late by up to the lag (never false), which matters when reading a hang's timing."""
    starts = [e for e in events if e.get("kind") == EventKind.INBOX_BEHIND]
    if not starts:
        return None
    ends = [e for e in events if e.get("kind") == EventKind.INBOX_CAUGHT_UP]

    def seconds(key: str, of: list) -> list[float]:  # a copied run directory: any type
        vals = [number(e.get(key)) for e in of]  # read as the exporter reads them
        return [x for x in vals if x is not None and math.isfinite(x)]

    lags = seconds("lag_s", starts) + seconds("max_lag_s", ends)
    spans = seconds("behind_s", ends)
    worst = f", worst lag {max(lags):.1f} s" if lags else ""
    longest = f", longest {max(spans):.1f} s" if spans else ""
    still = len(starts) - len(ends)
    open_ = f"; {still} not closed by an inbox_caught_up" if still > 0 else ""
    return (
        f"the supervisor fell behind its inbox {len(starts)} time(s){worst}{longest}{open_}: "
        "hang detection in those windows was late by up to the lag, never false (runbook "
        "SupervisorBehind)"
    )


def _event_step(e: dict[str, Any]) -> int | None:
    for k in ("step", "from_step"):
        v = e.get(k)
        if isinstance(v, int):
            return v
    return None


def _summarize_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    view = reduce(events)
    if view.end is not None:
        state = str(view.end["kind"])
    elif view.launches:
        state = "unknown (no end event: still running, or the supervisor died)"
    else:
        state = "unknown (no events)"
    ckpts = [
        e
        for e in events
        if e.get("kind") == EventKind.CHECKPOINT and isinstance(e.get("step"), int)
    ]
    pick = lambda kind, keys: [  # noqa: E731
        {k: e.get(k) for k in keys if k in e} for e in events if e.get("kind") == kind
    ]
    return {
        "state": state,
        "reason": view.reason,
        "attempts": view.launches,
        "counts": view.counts,
        "crashes": pick(EventKind.CRASH, ("attempt", "rank", "exit_code", "ts")),
        "hangs": pick(EventKind.HANG, ("attempt", "ranks", "step", "silent_s", "ts")),
        "rollbacks": pick(EventKind.ROLLBACK, ("from_step", "to_step", "reason", "ts")),
        "restarts": view.restarts,
        "checkpoints": len(ckpts),
        "last_checkpoint_step": max((e["step"] for e in ckpts), default=None),
        "checkpoint_invalid": pick(EventKind.CHECKPOINT_INVALID, ("path", "reason", "ts")),
        "first_ts": view.first_ts,
        "last_ts": view.last_ts,
    }


def _finding_row(f: Finding, hosts: dict[int, str]) -> dict[str, Any]:
    d = f.to_dict()
    return {
        "source": "replay",
        "monitor": d["monitor"],
        "family": d["family"],
        "step": d["step"],
        "rank": d["rank"],
        "host": hosts.get(d["rank"]) if d["rank"] is not None else None,
        "value": d["value"],
        "detail": d["detail"],
        "severity": d["severity"],
        "runbook": RUNBOOKS.get(d["monitor"]),
        "ts": d["ts"],
        "attempt": d["attempt"],
        "live": False,
        "episode": d.get("episode"),
        "phase": d.get("phase"),
    }


def _event_row(e: dict[str, Any], hosts: dict[int, str]) -> dict[str, Any]:
    kind = str(e.get("kind"))
    if kind == EventKind.ANOMALY:
        monitor = str(e.get("monitor", "anomaly"))
        rank, value, detail = e.get("rank"), e.get("value"), str(e.get("detail", ""))
        severity = str(e.get("severity", "warning"))
    elif kind == EventKind.STRAGGLER:
        monitor, rank, value = "straggler", e.get("rank"), e.get("ratio")
        detail = str(e.get("detail") or f"rank {rank} {value}x slower than the others")
        severity = str(e.get("severity", "warning"))
    else:
        monitor = kind
        rank = e.get("rank")
        if (
            rank is None
            and isinstance(e.get("ranks"), list)
            and e["ranks"]
            and isinstance(e["ranks"][0], int)
        ):
            rank = e["ranks"][0] if len(e["ranks"]) == 1 else None
        value = e.get("exit_code", e.get("silent_s"))
        detail = _event_what(e)
        sp = spec(kind)
        severity = sp.severity if sp is not None and sp.severity else "warning"
    if kind == EventKind.FAILED:
        reason = str(e.get("reason", ""))
        runbook = next((rb for k, rb in RUNBOOKS.items() if k in reason), None)
    else:
        runbook = RUNBOOKS.get(monitor)
    try:
        rank = int(rank) if rank is not None else None
    except (TypeError, ValueError):
        rank = None
    return {
        "source": "event",
        "monitor": monitor,
        "family": FAMILIES.get(monitor, "incident"),
        "step": _event_step(e),
        "rank": rank,
        "host": hosts.get(rank) if rank is not None else None,
        "value": _num(value),
        "detail": detail,
        "severity": severity,
        "runbook": runbook,
        "ts": e.get("ts"),
        "attempt": e.get("attempt"),
        "live": kind in MONITOR_FINDING_KINDS,
        "episode": e.get("episode"),
        "phase": e.get("phase"),
    }


def parse_since(text: str, now: float | None = None) -> float:
    """``10m`` / ``2h`` / ``30s`` / ``1d`` ago, or an ISO time (``2026-11-30T13:00``, local unless
    it says its zone), or unix seconds -> unix seconds."""
    import datetime as dt
    import re
    import time

    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", t)
    if m:
        mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return (time.time() if now is None else now) - float(m.group(1)) * mult
    try:
        v = float(t)
        if v > 1e8:
            return v
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise DiagnoseError(
            f"--since {text!r}: expected an ISO time (2026-11-30T13:05), a relative time "
            "(10m, 2h, 1d) or unix seconds"
        ) from None


def diagnose(
    run_dir: Path,
    attempt: int | None = None,
    since: float | None = None,
    baselines: list[Path] | None = None,
    full: bool = False,
) -> dict[str, Any]:
    """The report for one run directory (see the module docstring for its shape).

    A run whose metrics rotated (``metrics/``) replays its last :data:`WINDOW_BYTES` of records
    (seconds, whatever the run's size); what the report says of the whole run (records, last step,
    attempts, goodput, rank 0's loss around an incident) comes from the index and rank 0's lines
    of the live file, and earlier findings are the live ones in events.jsonl. ``full`` (or
    ``baselines``, whose curves span the run) replays every record, streamed."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise DiagnoseError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise DiagnoseError(f"{run_dir}: not a directory")
    run = RunDir(run_dir)
    try:
        has_metrics = run.has_metrics()
    except MetricsIndexError as e:
        raise DiagnoseError(str(e)) from None
    has_events = run.events.is_file()
    if not has_metrics and not has_events:
        raise DiagnoseError(
            f"{run_dir}: not a run directory (no metrics.jsonl and no events.jsonl)"
        )
    notes: list[str] = []
    section, config_src = load_section(run)
    events = list(read_jsonl(run.events)) if has_events else []
    if not has_metrics:
        notes.append(
            "no metrics.jsonl: the monitors had nothing to replay (the run died before its first "
            "step?)"
        )
    if not has_events:
        notes.append("no events.jsonl: no crash/hang/restart history")
    if not section.enabled:
        notes.append("recipe.json has [monitors] enabled = false: nothing replayed")
    every, wire = _rank_detail_every(run)
    if every > 1:
        live = (
            "the live straggler and memory monitors too (supervisor.node_summaries: the node "
            "agents summed up on the wire; the loss, NaN and RL monitors judged every rank)"
            if wire
            else "the live findings (events.jsonl) every record"
        )
        notes.append(
            f"metrics.jsonl holds every rank's record every {every} steps "
            "(supervisor.metrics_rank_detail_every), and between them rank 0's and the odd ones, "
            f"the rest summed up a node: the replayed monitors judged the records it holds, {live}"
        )
    behind = _behind_note(events)
    if behind:
        notes.append(behind)
    hosts = _hosts(events)
    try:  # the live (or last) attempt's ranks: a hang event does not name hosts
        for r in json.loads((run_dir / "status.json").read_text()).get("ranks") or []:
            if isinstance(r, dict) and isinstance(r.get("rank"), int) and r.get("host"):
                hosts.setdefault(r["rank"], str(r["host"]))
    except (OSError, ValueError, AttributeError):
        pass

    # one streaming pass over every record (segments, then the live file): the monitors' replay
    # and the counts see all of them; only what the report shows of them is kept (_Pass)
    seen = _Pass(events, want_curves=bool(baselines))
    try:
        segs = segments(run.path) if has_metrics else []
        if segs and not full and not baselines and all(s.info for s in segs):
            seen.rotated(run, segs)
            stream = seen.feed(tail_records(run.path, WINDOW_BYTES), account=False)
            notes.append(
                f"the monitors replayed the run's last {WINDOW_BYTES / 2**20:g} MB of records (its "
                "metrics "
                f"rotated: {len(segs)} segment(s) in metrics/); earlier findings are the "
                "supervisor's live ones (events.jsonl); the counts, last step and goodput are the "
                "whole run's; --full replays every record"
            )
        else:
            stream = seen.feed(run.iter_metrics() if has_metrics else iter(()))
        found = replay(stream, build_monitors(section))
    except MetricsIndexError as e:
        raise DiagnoseError(str(e)) from None
    metrics = seen.kept()
    replayed = [_finding_row(f, hosts) for f in found]
    rows = list(replayed)
    # live findings the supervisor wrote: match them to the replay, keep the ones the replay lacks
    for e in events:
        if e.get("kind") not in MONITOR_FINDING_KINDS:
            continue
        row = _event_row(e, hosts)
        twin = next(
            (
                r
                for r in replayed
                if r["monitor"] == row["monitor"]
                and r["step"] == row["step"]
                and (
                    row["rank"] is None or r["rank"] == row["rank"] or row["monitor"] != "straggler"
                )
            ),
            None,
        )
        if row["monitor"] == "straggler" and twin is None:
            twin = next(
                (r for r in replayed if r["monitor"] == "straggler" and r["rank"] == row["rank"]),
                None,
            )
        if twin is not None:
            twin["live"] = True
        else:
            rows.append(row)
    rows.extend(_event_row(e, hosts) for e in events if e.get("kind") in INCIDENT_KINDS)
    big = float("inf")
    rows.sort(
        key=lambda r: (
            r["ts"] if isinstance(r["ts"], (int, float)) else big,
            r["step"] if isinstance(r["step"], int) else -1,
        )
    )

    timeline: list[dict[str, Any]] = []
    for e in events:
        kind = str(e.get("kind"))
        if kind in MONITOR_FINDING_KINDS:
            continue  # listed through the findings below
        timeline.append(
            {
                "ts": e.get("ts"),
                "step": _event_step(e),
                "kind": kind,
                "what": _event_what(e),
                "runbook": RUNBOOKS.get(kind),
            }
        )
    for r in rows:
        if r["source"] == "replay" or r["live"]:
            who = (
                f" rank {r['rank']}"
                if r["rank"] is not None and not r["detail"].startswith("rank ")
                else ""
            )
            timeline.append(
                {
                    "ts": r["ts"],
                    "step": r["step"],
                    "kind": f"finding:{r['monitor']}",
                    "what": f"{r['monitor']}{who}: {r['detail']}",
                    "runbook": r["runbook"],
                }
            )
    timeline.sort(
        key=lambda t: (
            t["ts"] if isinstance(t["ts"], (int, float)) else big,
            t["step"] if isinstance(t["step"], int) else -1,
        )
    )

    ranks = sorted(seen.ranks)
    recipe_name = None
    if run.recipe_json.is_file():
        try:
            recipe_name = json.loads(run.recipe_json.read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            recipe_name = None
    incidents = _incidents.build(run_dir, events, metrics, rows, hosts, RUNBOOKS)
    launches = [
        (e["ts"], e["attempt"])
        for e in events
        if e.get("kind") == EventKind.LAUNCH
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("attempt"), int)
    ]
    if attempt is not None:
        attempts = {a for _, a in launches} | seen.attempts
        if attempts and attempt not in attempts:
            raise DiagnoseError(
                f"--attempt {attempt}: the run has attempt(s) "
                f"{', '.join(map(str, sorted(attempts)))}"
            )
        incidents = [i for i in incidents if i["attempt"] == attempt]
        rows = [
            r
            for r in rows
            if (
                r["attempt"]
                if r["attempt"] is not None
                else _incidents.attempt_at(r["ts"], launches)
            )
            == attempt
        ]
        timeline = [t for t in timeline if _incidents.attempt_at(t["ts"], launches) == attempt]
    if since is not None:
        late = lambda *ts: any(isinstance(x, (int, float)) and x >= since for x in ts)  # noqa: E731
        incidents = [i for i in incidents if late(i["ts"], i["ts_end"])]
        rows = [r for r in rows if late(r["ts"])]
        timeline = [t for t in timeline if late(t["ts"])]
    if attempt is not None or since is not None:
        for n, inc in enumerate(incidents, 1):
            inc["id"] = n
    live = bool(events) and reduce(events).end is None
    if live:
        notes.append(
            "no end event: the run is still going (or its supervisor died); these are the "
            "incidents so far"
        )
    report = {
        "run_dir": str(run_dir),
        "recipe": recipe_name,
        "config": config_src,
        "metrics_records": seen.count,
        "ranks": ranks,
        "last_step": seen.last_step,
        "findings": rows,
        "events_summary": _summarize_events(events),
        "timeline": timeline,
        "notes": notes,
        "incidents": incidents,
        "filters": {"attempt": attempt, "since": since},
        # the whole run's (filters do not apply): a live run's wall time runs to now
        "goodput": seen.goodput(now=time.time() if live else None),
    }
    if baselines:
        from ptops.diagnostics import baseline as _baseline

        try:
            report["baseline"] = _baseline.against(seen.curves, [Path(b) for b in baselines])
        except _baseline.BaselineError as e:
            raise DiagnoseError(str(e)) from None
    return report
