"""CLI pieces of supervision: ``--fault`` parsing, ``ptops status``, ``ptops inject``.

``ops/cli/app.py`` adds the two commands with :func:`register`; the launch itself is
``ops/cli/launch.py``. Heavy imports stay out of this module's top.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ptops.ops.cli.errors import fail


def parse_faults(specs: list[str]) -> list:
    """Parse every ``--fault``; one clear line and exit 2 on the first bad one."""
    from ptops.faultinject.spec import FaultSpecError, parse_all

    try:
        return parse_all(specs)
    except FaultSpecError as e:
        fail(f"--fault: {e}")
        return []


def status_cmd(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """State, step, attempt, last good checkpoint, open findings, supervisor pid and live ranks of a
    run.

    Works on a live run (reads the supervisor's status.json) and after the fact. On a pipeline
    directory (`ptops pipeline`): the pipeline's state and every stage's state, steps, input and
    output digests and gate result.\n
    Example:  ptops status runs/demo --json
    """
    if (Path(run_dir) / "pipeline.json").is_file():  # a `ptops pipeline` directory
        from ptops.ops.pipeline.status import collect as pipeline_status
        from ptops.ops.pipeline.status import render as render_pipeline

        p = pipeline_status(run_dir)
        typer.echo(json.dumps(p, indent=2, default=str) if json_out else render_pipeline(p))
        return
    from ptops.ckpt import latest_good
    from ptops.ops.cli.status_view import render
    from ptops.ops.runrecord.metrics import MetricsIndexError
    from ptops.ops.runrecord.rundir import RunDir
    from ptops.ops.runrecord.status import collect

    try:
        good = latest_good(RunDir(run_dir).checkpoints, deep=False)
        s = collect(run_dir, good.ref() if good else None)
    except (FileNotFoundError, MetricsIndexError) as e:
        fail(str(e))
    typer.echo(json.dumps(s, indent=2, default=str) if json_out else render(s))


def inject_cmd(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory of a live run (plain or --supervise).")
    ],
    spec: Annotated[
        str,
        typer.Argument(
            help="Fault spec, e.g. hang:rank=0,step=30 (the step may be past: fires at the "
            "next), or release (ends a hold)."
        ),
    ],
) -> None:
    """Inject a fault into a live run (sent to its ranks over the supervisor's channel).

    Example:  ptops inject runs/demo crash:rank=1,step=40
    """
    from ptops.faultinject.spec import FaultSpecError, parse_live
    from ptops.ops.rank.channel import ChannelClient, read_info

    try:
        parse_live(spec)
    except FaultSpecError as e:
        fail(str(e))
    info_path = Path(run_dir) / "supervisor" / "channel.json"
    from ptops.ops.runrecord.lock import holder

    if holder(Path(run_dir)) is None:
        fail(
            f"{run_dir}: no live supervisor (the run is not running: launch it with `ptops "
            "launch`)",
            1,
        )
    try:
        info = read_info(info_path)
        client = ChannelClient(
            info["address"], info["token"], {"role": "control", "pid": 0}, connect_timeout=5
        )
        answer = client.request({"t": "inject", "spec": spec}, timeout=10)
        client.close()
    except (OSError, ValueError, KeyError, ConnectionError) as e:
        fail(f"{run_dir}: cannot reach the supervisor ({e})", 1)
    if not answer.get("ok"):
        fail(str(answer.get("error")), 2)
    typer.echo(
        f"injected {answer['fault']} into attempt {answer['attempt']} (ranks {answer['ranks']})"
    )


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)
    app.command("inject")(inject_cmd)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
