"""``ptops chaos``: run fault scenarios against real supervised runs and report how they healed.

``ops/cli/app.py`` adds the command with :func:`register`. The runner lives in
:mod:`ptops.faultinject.chaos`; heavy imports stay inside the command.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ptops.faultinject.chaos import default_recipes_help
from ptops.ops.cli.errors import fail


def chaos_cmd(
    recipe: Annotated[
        list[str],
        typer.Option(
            "--recipe", help="Recipe to run scenarios on (repeatable). " + default_recipes_help()
        ),
    ] = [],
    scenario: Annotated[
        list[str],
        typer.Option(
            "--scenario",
            help="RECIPE/KIND (titan-tiny/crash), KIND (every selected recipe) or a fault spec, "
            "e.g. titan-tiny/hang:rank=1,step=5 (repeatable). Default: the recipe's default "
            "matrix.",
        ),
    ] = [],
    work_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--work-dir", help="Where the run directories go. Default: runs/chaos-<timestamp>."
        ),
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the report as JSON on stdout (progress still goes to stderr)."
        ),
    ] = False,
    list_only: Annotated[
        bool,
        typer.Option("--list", help="List the selected scenarios and their faults; run nothing."),
    ] = False,
    sets: Annotated[
        list[str],
        typer.Option(
            "--set",
            help="KEY=VALUE for every launch, the baselines' too (repeatable), e.g. "
            "trl.vllm.mode=colocate for the engine's seam scenarios (stale-sync, sync-hang, "
            "engine-hang; engine-crash and engine-hang with trl.vllm.mode=server).",
        ),
    ] = [],
    launch_timeout: Annotated[
        float,
        typer.Option("--launch-timeout", help="Seconds one launch may take before it is stopped."),
    ] = 600.0,
    junit: Annotated[
        Optional[Path],
        typer.Option(
            "--junit",
            help="Also write a JUnit XML file (one test case per scenario; detect/recover times "
            "as properties) for GitLab CI, GitHub Actions, Jenkins.",
        ),
    ] = None,
) -> None:
    """Inject faults into real supervised runs; report detection, recovery and whether the result
    equals a fault-free run.

    For each scenario: a supervised launch with the fault (relaunched like a requeue
    when preempted or when its supervisor was killed), and once per recipe a
    fault-free baseline with the same seed and settings. Reported per scenario:
    pass/fail, time to detect, time to recover, steps recomputed, final checkpoint
    digest equal to the baseline's, no lost data. Exit 1 if any scenario fails.

    Examples:\n
      ptops chaos --scenario titan-tiny/crash --scenario titan-tiny/corrupt-ckpt\n
      ptops chaos --recipe trl-sft-tiny --json\n
      ptops chaos --scenario titan-tiny/crash --junit chaos-junit.xml\n
      ptops chaos --scenario titan-tiny/slow:rank=1,step=3,seconds=1,steps=5 --list\n
      .venv-vllm/bin/ptops chaos --recipe trl-grpo-tiny --set trl.vllm.mode=colocate
      --scenario stale-sync --scenario sync-hang --scenario engine-hang --scenario crash
    """
    from ptops.faultinject import chaos

    try:
        scenarios = chaos.select(recipe, scenario, sets)
        chaos.check_recipes(scenarios)
    except chaos.ScenarioError as e:
        fail(str(e))
    if list_only:
        for sc in scenarios:
            mine = [x for x in sc.sets if x not in chaos.COMMON_SETS]
            extra = "".join(f" --set {x}" for x in (*mine, *sc.extra_sets))
            typer.echo(
                f"{sc.name:28s} {' '.join('--fault ' + f for f in sc.faults)}{extra}   detect: "
                f"{', '.join(sc.detect)}"
            )
        return
    if junit is not None and not junit.parent.is_dir():
        fail(f"--junit {junit}: folder {junit.parent} does not exist")
    target = work_dir or Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    if target.exists() and any(target.iterdir()):
        fail(f"--work-dir {target}: exists and is not empty (chaos needs fresh run directories)")

    def progress(msg: str) -> None:
        typer.echo(f"chaos {time.strftime('%H:%M:%S')}  {msg}", err=True)

    progress(f"{len(scenarios)} scenario(s) -> {target}")
    try:
        report = chaos.run_all(scenarios, target, progress, launch_timeout_s=launch_timeout)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    if junit is not None:
        from ptops.faultinject.junit import to_junit

        junit.write_text(to_junit(report))
        progress(f"JUnit XML -> {junit}")
    if json_out:
        typer.echo(json.dumps(report, indent=1))
    else:
        print_table(report)
    raise typer.Exit(0 if report["passed"] else 1)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(
        file=sys.stdout, width=None if sys.stdout.isatty() else 150
    )  # piped: no squeezed columns
    t = Table(title=f"ptops chaos: {report['work_dir']}", show_lines=False)
    for col, kw in (
        ("scenario", {}),
        ("result", {}),
        ("detected by", {}),
        ("detect", {"justify": "right"}),
        ("recover", {"justify": "right"}),
        ("recomputed", {"justify": "right"}),
        ("digest = baseline", {}),
        ("no lost data", {}),
        ("wall", {"justify": "right"}),
    ):
        t.add_column(col, **kw)
    fmt = lambda x: "-" if x is None else f"{x:.1f} s"  # noqa: E731
    for r in report["scenarios"]:
        t.add_row(
            r["scenario"],
            "[green]PASS[/green]" if r["passed"] else "[red]FAIL[/red]",
            r["detected_by"] or "-",
            fmt(r["detect_s"]),
            fmt(r["recover_s"]),
            "-" if r["steps_recomputed"] is None else str(r["steps_recomputed"]),
            {True: "yes", False: "[red]NO[/red]", None: "?"}[r["digest_equal"]],
            "yes" if r["no_lost_data"] else "[red]NO[/red]",
            f"{r['wall_s']:.0f} s",
        )
    console.print(t)
    for r in report["scenarios"]:
        if r["problems"]:
            console.print(
                f"[red]{r['scenario']}[/red]: " + "; ".join(r["problems"]), highlight=False
            )
    n = len(report["scenarios"])
    ok = sum(1 for r in report["scenarios"] if r["passed"])
    console.print(
        f"{ok}/{n} passed in {report['wall_s']:.0f} s; run directories and chaos-report.json "
        f"under {report['work_dir']}"
    )


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos_cmd)
