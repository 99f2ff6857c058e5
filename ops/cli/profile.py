"""``ptops profile RUN_DIR [--steps N] [--json]``: where a live run's step time goes, per rank.

How it travels (the same way as ``ptops inject``): a ``profile`` control message to the
supervisor's channel; the supervisor picks one start step for every rank (past the furthest
one, ``messages.profile_start``), records ``profile_requested`` and forwards it; each rank's
probe traces N whole steps with the torch profiler (``ops/rank/profiler.py``), writes
``profiles/<id>/rank-R.json`` and reports ``profile_captured`` (or ``profile_failed``). This
command waits for every rank's report in ``events.jsonl`` (bounded by ``--timeout``, with a
progress line on stderr), then reads the traces (``diagnostics/profile.py``), writes
``profiles/<id>/summary.json`` and prints the breakdown. ``--id`` analyses a capture again
(also in a run directory copied from elsewhere; no live run needed).

Exit codes: 0 = breakdown printed; 2 = bad input, no live supervisor, the supervisor refused,
a rank failed or never captured, the run ended first (one ``error:`` line on stderr).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ptops.ops.cli.errors import fail

EXIT_OK = 0
PROGRESS_EVERY_S = 10.0


def _say(msg: str) -> None:
    print(f"ptops profile: {msg}", file=sys.stderr, flush=True)


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        fail(f"{run_dir}: no such run directory")
    if not (run_dir / "events.jsonl").exists() and not (run_dir / "recipe.json").exists():
        fail(f"{run_dir}: not a ptops run directory (no events.jsonl or recipe.json)")


def request(run_dir: Path, steps: int) -> dict[str, Any]:
    """Ask the live supervisor for a profile; its answer (id, start_step, ranks) or one error
    line."""
    from ptops.ops.rank.channel import ChannelClient, read_info
    from ptops.ops.runrecord.lock import holder

    if holder(run_dir) is None:
        fail(
            f"{run_dir}: no live supervisor (the run is not running; `ptops profile` needs a "
            "live run, "
            f"or --id to analyse a capture already taken)"
        )
    try:
        info = read_info(run_dir / "supervisor" / "channel.json")
        client = ChannelClient(
            info["address"],
            info["token"],
            {"role": "control", "pid": os.getpid()},
            connect_timeout=5,
        )
        answer = client.request({"t": "profile", "steps": int(steps)}, timeout=10)
        client.close()
    except (OSError, ValueError, KeyError, ConnectionError) as e:
        fail(f"{run_dir}: cannot reach the supervisor ({e})")
    if not answer.get("ok"):
        fail(f"{run_dir}: {answer.get('error') or 'the supervisor refused the profile request'}")
    return answer


def wait(
    run_dir: Path, answer: dict[str, Any], timeout_s: float, quiet: bool = False
) -> dict[int, dict[str, Any]]:
    """Every rank's ``profile_captured`` event for this request; one error line when a rank fails,
    the attempt or the run ends first, or ``timeout_s`` passes."""
    from ptops.ops.runrecord.events import END_KINDS, EventKind
    from ptops.ops.runrecord.lock import holder
    from ptops.ops.runrecord.rundir import JsonlTail, RunDir
    from ptops.ops.runrecord.status import read_status_file

    pid, attempt = answer["id"], int(answer["attempt"])
    first, last = int(answer["start_step"]), int(answer["start_step"]) + int(answer["steps"]) - 1
    waiting = set(int(r) for r in answer["ranks"])
    captured: dict[int, dict[str, Any]] = {}
    run = RunDir(run_dir)
    tail = JsonlTail(run.events)
    seen_request = False
    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + PROGRESS_EVERY_S

    def where() -> str:
        step = read_status_file(run).get("step")
        return f"the run is at step {step}" if step is not None else "the run's step is unknown"

    if not quiet:
        _say(f"{pid}: ranks {sorted(waiting)} trace steps {first}..{last}; {where()}")
    while waiting:
        for e in tail.records():
            kind, fields = e.get("kind"), e
            if kind == EventKind.PROFILE_REQUESTED and e.get("id") == pid:
                seen_request = True
            if not seen_request:
                continue
            if (
                kind in (EventKind.PROFILE_CAPTURED, EventKind.PROFILE_FAILED)
                and e.get("id") == pid
            ):
                rank = int(fields.get("rank", -1))
                if kind == EventKind.PROFILE_FAILED:
                    fail(
                        f"{run_dir}: rank {rank} could not profile ({fields.get('error')}); "
                        "traces so far "
                        f"in {run_dir / 'profiles' / pid}"
                    )
                captured[rank] = fields
                waiting.discard(rank)
                if not quiet:
                    part = " (partial: the rank left early)" if fields.get("partial") else ""
                    _say(
                        f"rank {rank}: captured steps {fields.get('first_step')}.."
                        f"{int(fields.get('first_step', 0)) + int(fields.get('steps', 0)) - 1}"
                        f" ({int(fields.get('bytes') or 0) / 1e6:.1f} MB){part}; waiting for "
                        f"{sorted(waiting) or 'none'}"
                    )
            elif kind == EventKind.LAUNCH and int(e.get("attempt", 0)) > attempt and waiting:
                fail(
                    f"{run_dir}: attempt {attempt} ended before ranks {sorted(waiting)} captured "
                    f"profile {pid} "
                    f"(steps {first}..{last}); see `ptops diagnose {run_dir}`"
                )
            elif kind in END_KINDS and waiting:
                fail(
                    f"{run_dir}: the run ended ({kind}) before ranks {sorted(waiting)} captured "
                    f"profile {pid} "
                    f"(steps {first}..{last})"
                )
        if not waiting:
            break
        now = time.monotonic()
        if now >= deadline:
            fail(
                f"{run_dir}: ranks {sorted(waiting)} did not capture profile {pid} within "
                f"{timeout_s:g} s: "
                f"{where()}, the profile covers steps {first}..{last} (held or hung? `ptops "
                f"status {run_dir}`)"
            )
        if holder(run_dir) is None:
            for e in tail.records():  # the last words of a supervisor that just ended
                if e.get("kind") == EventKind.PROFILE_CAPTURED and e.get("id") == pid:
                    captured[int(e.get("rank", -1))] = e
                    waiting.discard(int(e.get("rank", -1)))
            if waiting:
                fail(
                    f"{run_dir}: the supervisor exited before ranks {sorted(waiting)} captured "
                    f"profile {pid}"
                )
            break
        if not quiet and now >= next_note:
            next_note = now + PROGRESS_EVERY_S
            _say(
                f"waiting for ranks {sorted(waiting)}: {where()}, the profile covers steps "
                f"{first}..{last}"
            )
        time.sleep(0.2)
    return captured


def _load_capture(run_dir: Path, pid: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The request and the ranks' reports of a capture already taken (``--id``)."""
    from ptops.ops.runrecord.events import EventKind
    from ptops.ops.runrecord.rundir import read_jsonl

    req: dict[str, Any] | None = None
    captured: dict[int, dict[str, Any]] = {}
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e.get("id") != pid:
            continue
        if e.get("kind") == EventKind.PROFILE_REQUESTED:
            req = e
        elif e.get("kind") == EventKind.PROFILE_CAPTURED:
            captured[int(e.get("rank", -1))] = e
    if req is None:
        known = sorted(
            {
                e.get("id")
                for e in read_jsonl(run_dir / "events.jsonl")
                if e.get("kind") == EventKind.PROFILE_REQUESTED
            }
        )
        fail(
            f"{run_dir}: no profile {pid!r} in events.jsonl (profiles: "
            f"{', '.join(known) or 'none'})"
        )
    if not captured:
        fail(f"{run_dir}: profile {pid}: no rank captured a trace")
    return req, captured


def analyse(run_dir: Path, pid: str, captured: dict[int, dict[str, Any]]) -> dict[str, Any]:
    from ptops.diagnostics.profile import TraceError, analyse_files, write_summary

    paths = {
        rank: run_dir / str(ev.get("path") or f"profiles/{pid}/rank-{rank}.json")
        for rank, ev in sorted(captured.items())
    }
    try:
        report = analyse_files(paths)
    except TraceError as e:
        fail(f"{run_dir}: {e}")
    report["id"] = pid
    report["run_dir"] = str(run_dir)
    report["traces"] = {
        str(r): str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p)
        for r, p in paths.items()
    }
    try:
        report["summary"] = str(
            write_summary(run_dir / "profiles" / pid, report).relative_to(run_dir)
        )
    except OSError as e:  # a read-only copy of a run directory: the breakdown still prints
        report["summary"] = None
        _say(f"could not write the summary ({e})")
    return report


def profile_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a live supervised run.")],
    steps: Annotated[
        int,
        typer.Option(
            "--steps", min=1, max=100, help="Steps to trace on every rank (the same steps on all)."
        ),
    ] = 5,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the breakdown as one JSON object (also in profiles/<id>/summary.json).",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds to wait for every rank's trace.")
    ] = 120.0,
    pid: Annotated[
        Optional[str],
        typer.Option("--id", help="Analyse a capture already taken (profiles/<ID>/), live or not."),
    ] = None,
) -> None:
    """Trace N steps of every rank of a live run with the torch profiler and name the slow part and
    the slow rank.

    No restart: the supervisor forwards the request over its channel, every rank traces the same
    steps and writes profiles/<id>/rank-R.json (Chrome trace: open in Perfetto or chrome://tracing).
    Per rank and step: compute (outside collectives and data loading), communication (inside
    collectives, the part the fastest rank also spent), waiting for peers (inside collectives,
    beyond the fastest rank), data loading.\n
    Examples:\n
      ptops profile runs/demo --steps 5\n
      ptops profile runs/demo --json | jq .verdict\n
      ptops profile runs/demo --id 20261130-131500-ab12     (again, from the stored traces)
    """
    from ptops.diagnostics.profile import render

    run_dir = Path(run_dir)
    _check_run_dir(run_dir)
    if pid is None:
        answer = request(run_dir, steps)
        pid = str(answer["id"])
        captured = wait(run_dir, answer, timeout)
    else:
        _, captured = _load_capture(run_dir, pid)
    report = analyse(run_dir, pid, captured)
    if json_out:
        typer.echo(json.dumps(report, indent=2, allow_nan=False, default=str))
    else:
        typer.echo(render(report))
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
