"""``ptops diagnose RUN_DIR [--json] [--attempt K] [--since T] [--baseline OTHER]... [--html OUT]
[--full]``: the on-call report.

Wiring (ops/cli/app.py)::

    @app.command()
    def diagnose(run_dir: Path, json_out: bool = ..., attempt: int | None = ...,
                 since: str | None = ..., baseline: list[Path] | None = ...,
                 html_out: Path | None = ..., full: bool = ...):
        from ptops.ops.cli.diagnose import diagnose_command
        raise typer.Exit(
            diagnose_command(run_dir, json_out, attempt, since, baseline, html_out, full))

Exit codes: 0 = report printed (also when it lists findings: a report is not a
verdict; read ``findings``), 2 = no such run directory / not a run directory /
bad recipe.json ``[monitors]`` section / bad ``--attempt`` or ``--since`` / a baseline without
metrics (one ``error: ...`` line on stderr).

Also runnable without the main CLI: ``python -m ptops.ops.cli.diagnose RUN_DIR [--json] [...]``.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from ptops.ops.runrecord.ranks import rank_list

EXIT_OK = 0
EXIT_BAD_INPUT = 2

_MAX_TIMELINE = 40


def diagnose_command(
    run_dir: Path,
    json_out: bool,
    attempt: int | None = None,
    since: str | None = None,
    baseline: list[Path] | None = None,
    html_out: Path | None = None,
    full: bool = False,
) -> int:
    """Print the report (JSON on stdout with ``json_out``, else a compact summary); return the exit
    code. With ``html_out`` also write the self-contained HTML page there."""
    from ptops.diagnostics.diagnose import DiagnoseError, diagnose, parse_since
    from ptops.ops.cli.oomplan import add_plan

    if html_out is not None and Path(html_out).is_dir():
        print(
            f"error: --html {html_out}: is a directory (expected a file path, e.g. report.html)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        if attempt is not None and attempt < 1:
            raise DiagnoseError(f"--attempt {attempt}: attempts are numbered from 1")
        since_ts = parse_since(since) if since is not None else None
        report = diagnose(
            Path(run_dir),
            attempt=attempt,
            since=since_ts,
            baselines=list(baseline or []) or None,
            full=full,
        )
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    add_plan(report, Path(run_dir))  # an OOM beside `ptops plan`'s estimate (titan recipes)
    if html_out is not None:
        err = write_html(Path(run_dir), report, Path(html_out))
        if err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if json_out:
        print(json.dumps(report, indent=2, allow_nan=False, default=str))
    else:
        _print_human(report)
    return EXIT_OK


def _runbook_href(name: str) -> str | None:
    """file:// link to the installed runbook (None when there is no such file)."""
    from importlib.resources import files

    try:
        path = Path(str(files("ptops.runbooks").joinpath(f"{name}.md")))
    except (ModuleNotFoundError, TypeError):
        return None
    return path.resolve().as_uri() if path.is_file() else None


def write_html(run_dir: Path, report: dict[str, Any], out: Path) -> str | None:
    """Render and write the page; the error line on failure, else None (a note on stderr says
    where)."""
    from ptops.diagnostics.html import render
    from ptops.ops.runrecord.rundir import RunDir

    # the charts' lines: a list of every record (the page is for a run a person reads, not for a
    # run directory at 16k ranks: docs/scale.md)
    metrics = RunDir(run_dir).read_metrics()
    page = render(report, metrics, runbook_href=_runbook_href)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        return f"--html {out}: cannot write ({e.strerror or e})"
    print(f"wrote {out} ({len(page) // 1024} KiB)", file=sys.stderr)
    return None


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _print_human(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)  # pipes and files: do not wrap at 80
    s = r["events_summary"]
    head = (
        f"{r['run_dir']}  recipe {r['recipe'] or '?'}  state {s['state']}  last step "
        f"{r['last_step']}  "
        f"attempts {s['attempts']}  ranks {rank_list(r['ranks'], bare=True) or '-'}  "
        f"monitors config: {r['config']}"
    )
    console.print(head, markup=False)
    if s.get("reason"):
        console.print(f"  reason: {s['reason']}", markup=False)
    bits = [f"{k} {v}" for k, v in sorted(s["counts"].items())]
    console.print(
        f"  events: {', '.join(bits) or 'none'}; last good checkpoint step: "
        f"{s['last_checkpoint_step']}",
        markup=False,
    )
    g = r.get("goodput") or {}
    if g.get("ratio") is not None:
        lost = sorted(((v, k) for k, v in g["lost_s"].items() if v >= 0.05), reverse=True)
        where = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for v, k in lost) or "nothing"
        console.print(
            f"  goodput: {g['ratio']:.0%} of {g['wall_s']:.1f} s productive; lost: {where}",
            markup=False,
        )
    for note in r["notes"]:
        console.print(f"  note: {note}", markup=False)
    f = r.get("filters") or {}
    if f.get("attempt") is not None or f.get("since") is not None:
        console.print(
            f"  showing: attempt {f.get('attempt') or 'all'}, since {_when(f.get('since'))}",
            markup=False,
        )
    _print_incidents(console, r.get("incidents") or [])
    if r.get("baseline"):
        _print_baseline(console, r["baseline"])
    findings = r["findings"]
    if not findings:
        console.print("No findings: the monitors saw nothing wrong and no incidents were recorded.")
    else:
        t = Table(title=f"{len(findings)} finding(s)", title_justify="left", show_lines=False)
        for col in ("step", "rank", "monitor", "value", "severity", "runbook", "detail"):
            t.add_column(col, overflow="fold")
        for f in findings:
            rank = (
                "-"
                if f["rank"] is None
                else str(f["rank"]) + (f"@{f['host']}" if f.get("host") else "")
            )
            src = (
                ""
                if f["source"] == "replay" and not f["live"]
                else (" (live)" if f["live"] else " (event)")
            )
            t.add_row(
                *(
                    Text(x)
                    for x in (
                        _value(f["step"]),
                        rank,
                        f["monitor"] + src,
                        _value(f["value"]),
                        f["severity"],
                        f["runbook"] or "-",
                        f["detail"],
                    )
                )
            )
        console.print(t)
        books = sorted({f["runbook"] for f in findings if f["runbook"]})
        if books:
            console.print("Runbooks: " + ", ".join(f"ptops runbook {b}" for b in books))
    tl = r["timeline"]
    if tl:
        console.print(
            f"Timeline ({len(tl)} "
            f"entries{', last ' + str(_MAX_TIMELINE) if len(tl) > _MAX_TIMELINE else ''}):"
        )
        for e in tl[-_MAX_TIMELINE:]:
            step = f"step {e['step']}" if e["step"] is not None else ""
            what = e["what"] if len(e["what"]) <= 150 else e["what"][:147] + "..."
            console.print(f"  {_when(e['ts'])} {step:>10}  {what}", markup=False)


_EVIDENCE_LINES = 16


def _print_incidents(console: Any, incs: list[dict[str, Any]]) -> None:
    if not incs:
        console.print("No incidents.")
        return
    console.print(f"{len(incs)} incident(s):", markup=False)
    for i in incs:
        where = ", ".join(
            x
            for x in (
                f"attempt {i['attempt']}" if i["attempt"] is not None else "",
                f"step {i['step']}" if i["step"] is not None else "",
                (
                    f"rank {i['rank']}"
                    if i["rank"] is not None
                    else (f"ranks {rank_list(i['ranks'], bare=True)}" if i["ranks"] else "")
                ),
                f"host {i['host']}" if i["host"] else "",
            )
            if x
        )
        console.print(
            f"\n#{i['id']} [{i['severity'].upper()}] {i['kind']}: {i['title']}", markup=False
        )
        span = _when(i["ts"]) + (
            f"-{_when(i['ts_end'])}" if i["ts_end"] and _when(i["ts_end"]) != _when(i["ts"]) else ""
        )
        console.print(f"   when {span}  {where}", markup=False)
        for line in i["evidence"][:_EVIDENCE_LINES]:
            console.print(f"   | {line}", markup=False)
        if len(i["evidence"]) > _EVIDENCE_LINES:
            console.print(
                f"   | ... {len(i['evidence']) - _EVIDENCE_LINES} more (--json)", markup=False
            )
        details = i.get("details") if isinstance(i.get("details"), dict) else {}
        for note in details.get("collection_notes") or []:  # a dump that failed, not a finding
            console.print(f"   note: {note}", markup=False)
        if i["action"]:
            console.print(f"   supervisor: {i['action']}", markup=False)
        if i["runbook"]:
            console.print(f"   runbook: ptops runbook {i['runbook']}", markup=False)
    console.print("")


def _print_baseline(console: Any, b: dict[str, Any]) -> None:
    verdict = (
        f"DIVERGES from step {b['first_divergent_step']}"
        if b["diverged"]
        else "within seed-to-seed noise"
    )
    names = ", ".join(b.get("baselines") or [str(b["run_dir"])])
    console.print(
        f"Baseline {names}: {verdict} (compared: {', '.join(b['compared']) or 'nothing'})",
        markup=False,
    )
    for m, d in b["per_metric"].items():
        if "noise" not in d:
            console.print(f"  {m}: {d.get('note')}", markup=False)
            continue
        first = (
            f"first divergent step {d['first_divergent_step']}"
            if d["diverged"]
            else "no divergence"
        )
        console.print(
            f"  {m}: {first}; noise {d['noise']:.3g}, largest gap {d['max_z']:+.1f} noise at step "
            f"{d['max_z_step']}; final {d['final']:.4g} vs {d['baseline_final']:.4g}",
            markup=False,
        )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="ptops diagnose", description="What happened in a run, which rank, which runbook."
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", dest="json_out", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--attempt",
        type=int,
        default=None,
        help="only this attempt's incidents, findings, timeline",
    )
    p.add_argument(
        "--since", default=None, help="only what happened after T (ISO time, or 10m / 2h ago)"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=None,
        help="compare loss/grad-norm/reward curves with this reference run (repeatable)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="a rotated run: replay the monitors over every record, not the newest segment on",
    )
    p.add_argument(
        "--html",
        dest="html_out",
        type=Path,
        default=None,
        help="also write a self-contained HTML report",
    )
    a = p.parse_args(argv)
    return diagnose_command(
        a.run_dir, a.json_out, a.attempt, a.since, a.baseline, a.html_out, a.full
    )


if __name__ == "__main__":
    sys.exit(main())
