"""``ptops pipeline PIPELINE.toml``: supervised stages with verified hand-offs (ops/pipeline does
the work)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer

from ptops import envnames
from ptops.ops.cli.errors import fail


def pipeline_cmd(
    file: Annotated[
        Path,
        typer.Argument(
            help="Pipeline TOML file: a name and [[stage]] tables (name, recipe, set, faults, "
            "input, gate)."
        ),
    ],
    run_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--run-dir",
            help="Pipeline directory (stages under stages/NN-name); rerunning on it resumes. "
            "Default: runs/<name>-<timestamp>.",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the final pipeline status as JSON on stdout.")
    ] = False,
    mlflow_uri: Annotated[
        Optional[str],
        typer.Option(
            "--mlflow-uri",
            help="MLflow tracking URI. Default: sqlite:///<pipeline dir>/mlflow/mlflow.db (one "
            "store per pipeline, its stages included).",
        ),
    ] = None,
    mlflow: Annotated[
        bool,
        typer.Option(
            "--mlflow/--no-mlflow",
            envvar=envnames.MLFLOW,
            help="Lineage in MLflow: a parent run, a nested child run per stage, digests as "
            "tags/params (PTOPS_MLFLOW=0: off).",
        ),
    ] = True,
) -> None:
    """Run training stages in order, each a supervised launch starting from the verified final
    checkpoint of the stage it names, each optionally gated on a metric.

    A stage with `input = "sft"` starts from sft's final checkpoint (verified file by file, its
    `ptops ckpt digest` recorded in the pipeline's and the stage's events) through the recipe key
    `train.init_from` (weights only; fresh optimizer and step count). A gate such as
    `gate = { metric = "eval/heldout", op = ">=", value = 0.5 }` reads the stage's last recorded
    value of the metric (its recipe's [eval] writes eval/<name>) and stops the pipeline, exit 1,
    with one line naming stage, metric, value and threshold.

    Rerun the same command with the same --run-dir to resume: completed stages are skipped (their
    final checkpoints must still have the recorded digests), the stage that was running resumes from
    its own last good checkpoint.

    Ctrl-C / SIGINT / SIGTERM (handled even when started with SIGINT ignored, e.g. under nohup): the
    running stage is told once (it checkpoints and stops; a second signal stops it now), then exit
    130. If the pipeline is killed outright (SIGKILL), the kernel sends its running stage SIGTERM
    (PR_SET_PDEATHSIG): the stage saves and stops, and a rerun resumes it.

    Exit 0: all stages completed; 1: a stage failed or a gate stopped it; 3: a stage said do not
    requeue (look first); 2: bad input; 130: interrupted.

    Examples:\n
      ptops pipeline recipes/pipelines/post-train-tiny.toml --run-dir runs/pipe\n
      ptops status runs/pipe            (every stage: state, steps, digests, gate)
    """
    from ptops.ops.pipeline.runner import PipelineRunner
    from ptops.ops.pipeline.spec import PipelineError, load
    from ptops.ops.pipeline.status import collect, render

    try:
        pipe = load(file)
    except PipelineError as e:
        fail(str(e))
    target = (
        run_dir or Path("runs") / f"{pipe.model.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    typer.echo(
        f"ptops pipeline: {pipe.model.name} ({len(pipe.stages)} stages) -> {target}", err=True
    )
    try:
        outcome = PipelineRunner(pipe, target, mlflow=mlflow, mlflow_uri=mlflow_uri).run()
    except PipelineError as e:
        fail(str(e))
    status = collect(target)
    if json_out:
        typer.echo(
            json.dumps(
                {**status, "exit_code": outcome.code, "message": outcome.message},
                indent=2,
                default=str,
            )
        )
    else:
        typer.echo(render(status), err=True)
    if outcome.code == 0:
        typer.echo(f"ptops pipeline: {outcome.message}", err=True)
    else:
        typer.echo(f"error: {outcome.message}", err=True)
    raise typer.Exit(outcome.code)


def register(app: typer.Typer) -> None:
    app.command("pipeline")(pipeline_cmd)
