"""The ``ptops`` command line. Heavy imports (torch, trl) stay out of this path."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from ptops import __version__, envnames
from ptops.ops.cli.errors import fail
from ptops.ops.cli.obs import WANDB_HELP


def engines_installed() -> str:
    """The engines installed, from package metadata: ``--help`` names them without importing a
    plugin. A built-in engine whose packages are not found (``find_spec``, no import) is named with
    the extra that installs it (``ops/cli/installcheck.py``)."""
    from ptops.ops.cli.installcheck import engine_label
    from ptops.recipes.engines import installed

    by: dict[str, list[str]] = {}
    for name, provider in installed():
        own = provider.startswith("ptops ")
        by.setdefault("ptops" if own else provider, []).append(engine_label(name) if own else name)
    return "; ".join(f"{', '.join(sorted(names))} ({provider})" for provider, names in by.items())


class _NamesEngines:
    """``--help`` ends with the engines installed (ptops' own and plugins of the ``ptops.engines``
    group)."""

    def format_help(self, ctx, formatter) -> None:  # type: ignore[no-untyped-def]
        super().format_help(ctx, formatter)  # type: ignore[misc]
        formatter.write_paragraph()
        formatter.write_text(
            f"Engines installed: {engines_installed()}. Recipes, and plugins that did not "
            "load: `ptops recipes`."
        )


class _RootGroup(_NamesEngines, TyperGroup):
    pass


class _EnginesCommand(_NamesEngines, TyperCommand):
    pass


app = typer.Typer(
    name="ptops",
    cls=_RootGroup,
    help=(
        "Operations and reliability for TorchTitan and TRL training runs.\n\n"
        "Start with:  ptops launch titan-tiny   (a shipped recipe; see `ptops recipes`)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ptops {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    pass


class _LaunchCommand(_EnginesCommand):
    """Everything after ``--`` is the user's command (``ptops launch --supervise -- python
    train.py``)."""

    def parse_args(self, ctx, args):  # type: ignore[no-untyped-def]
        if "--" in args:
            i = args.index("--")
            ctx.meta["ptops.command"] = list(args[i + 1 :])
            args = list(args[:i])
        else:  # the command without its -- (ptops launch --supervise python train.py): say so
            from ptops.ops.cli.launch import command_hint

            hint = command_hint(self.params, args)
            if hint:
                fail(hint)
        return super().parse_args(ctx, args)


@app.command(cls=_LaunchCommand)
def launch(
    ctx: typer.Context,
    recipe: Annotated[
        Optional[str],
        typer.Argument(
            help="Recipe TOML file, or the name of a shipped recipe (titan-tiny, trl-sft-tiny, "
            "...). "
            "Or none, and your own command after --."
        ),
    ] = None,
    run_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--run-dir",
            help="Run directory; rerunning on an existing one resumes it. Default: "
            "runs/<recipe>-<timestamp>.",
        ),
    ] = None,
    set_: Annotated[
        list[str],
        typer.Option(
            "--set",
            help="Override a recipe key, e.g. --set train.steps=30 (repeatable; values parse as "
            "TOML).",
        ),
    ] = [],
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Validate without GPUs and start nothing: the schema, the resolved recipe and "
            "rank command; for TorchTitan recipes also the parallel degrees against the "
            "world, the planner's memory fit and TorchTitan's fake-backend build of the real "
            "parallelisation; for TRL recipes the model on the meta device, LoRA targets, "
            "the TRL config and a per-GPU memory estimate.",
        ),
    ] = False,
    nodes: Annotated[
        Optional[int],
        typer.Option(
            "--nodes",
            min=1,
            help="--dry-run: nodes of the world to check (default: titan.target.nodes / "
            "trl.target.nodes, else 1).",
        ),
    ] = None,
    gpus_per_node: Annotated[
        Optional[int],
        typer.Option(
            "--gpus-per-node", min=1, help="--dry-run: GPUs per node (default: launch.nproc)."
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the final summary as JSON on stdout.")
    ] = False,
    supervise: Annotated[
        bool,
        typer.Option(
            "--supervise",
            help="Restart a crashed or hung run from the last good checkpoint, and act on "
            "monitor findings (without it, the same watch ends the run failed). Exit 1: a "
            "requeue may help; 3 no progress, 4 misconfigured, 5 resubmitted (Slurm): do not "
            "requeue (docs/exit-codes.md).",
        ),
    ] = False,
    metrics_port: Annotated[
        Optional[int],
        typer.Option(
            "--metrics-port",
            help="Serve Prometheus metrics on 127.0.0.1:PORT while the run lives (0 picks a free "
            "port).",
        ),
    ] = None,
    mlflow_uri: Annotated[
        Optional[str],
        typer.Option(
            "--mlflow-uri",
            help="MLflow tracking URI (a server, or sqlite:///path). Default: sqlite:///<run "
            "dir>/mlflow/mlflow.db inside the run directory.",
        ),
    ] = None,
    mlflow: Annotated[
        bool,
        typer.Option(
            "--mlflow/--no-mlflow",
            envvar=envnames.MLFLOW,
            help="Log params, per-step metrics, events and an incident summary to MLflow "
            "(PTOPS_MLFLOW=0 turns it off for every launch of a shell or a CI job).",
        ),
    ] = True,
    wandb: Annotated[bool, typer.Option("--wandb", help=WANDB_HELP)] = False,
    wandb_project: Annotated[
        Optional[str],
        typer.Option(
            "--wandb-project",
            help="With --wandb: W&B project (online; default: the recipe's name).",
        ),
    ] = None,
    wandb_entity: Annotated[
        Optional[str],
        typer.Option("--wandb-entity", help="With --wandb: W&B entity (team or user; online)."),
    ] = None,
    fault: Annotated[
        list[str],
        typer.Option(
            "--fault",
            help="Inject a fault, e.g. crash:rank=1,step=12 (repeatable; first attempt only "
            "unless attempt=N).",
        ),
    ] = [],
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="With --supervise: submit to Slurm (sbatch). The supervisor runs in the batch "
            "step, each attempt is an srun step of one node agent per node; --dry-run prints "
            "the sbatch script. Recipe section [slurm] holds the same keys.",
        ),
    ] = False,
    spare_nodes: Annotated[
        Optional[int],
        typer.Option(
            "--spare-nodes",
            min=0,
            help="--slurm: extra nodes held to replace a blamed node without requeueing.",
        ),
    ] = None,
    partition: Annotated[
        Optional[str], typer.Option("--partition", help="--slurm: partition.")
    ] = None,
    time_limit: Annotated[
        Optional[str],
        typer.Option(
            "--time",
            help="--slurm: time limit (e.g. 04:00:00); the supervisor saves and requeues on the "
            "warning signal before it.",
        ),
    ] = None,
    account: Annotated[Optional[str], typer.Option("--account", help="--slurm: account.")] = None,
    qos: Annotated[
        Optional[str], typer.Option("--qos", help="--slurm: quality of service.")
    ] = None,
) -> None:
    """Run a recipe's ranks with torchrun, checkpoint as the recipe says, resume on rerun.

    Your own training script: put its command after --. Each of launch.nproc ranks runs it
    (torchrun's RANK, WORLD_SIZE, MASTER_ADDR set); a Python script runs inside the rank, so without
    any change it gets crash and hang detection with every rank's stacks, restarts, goodput and
    `ptops diagnose`; with `import ptops.rank` (step records, checkpoint/resume, rollback) also
    monitors, numeric rollback, a save on preemption and exact resume. The run is complete when the
    script exits 0 on every rank. See examples/README.md.

    Examples:\n
      ptops launch --supervise -- python examples/fsdp2/train.py --steps 12\n
      ptops launch --supervise --set launch.nproc=4 --fault crash:rank=1,step=6 --
        python train.py --lr 3e-4\n
      ptops launch titan-tiny --run-dir runs/demo\n
      ptops launch recipes/trl-grpo-tiny.toml --set train.steps=40 --set launch.nproc=2\n
      ptops launch titan-tiny --set titan.parallelism.tp=2 --dry-run\n
      ptops launch llama3-70b-h200 --dry-run --nodes 16 --gpus-per-node 8\n
      ptops launch titan-tiny --supervise --fault crash:rank=1,step=12\n
      ptops launch titan-tiny --supervise --wandb
        (W&B offline files in RUN_DIR/wandb; `wandb sync` uploads)\n
      ptops launch titan-tiny --supervise --slurm --nodes 2 --spare-nodes 1 --time 04:00:00
    """
    from ptops.ops.cli.supervise import parse_faults
    from ptops.ops.supervisor import launcher
    from ptops.recipes.schema import RecipeError, dump_json, load

    faults = parse_faults(fault)
    command = ctx.meta.get("ptops.command")
    if command is not None and recipe is not None:
        fail(f"give a recipe ({recipe}) or a command after --, not both")
    if command is None and recipe is None:
        fail(
            "missing a recipe, or your own command after -- "
            "(e.g. ptops launch --supervise -- python train.py)"
        )
    if slurm and not supervise:
        fail("--slurm: add --supervise (a Slurm job always runs under the supervisor)")
    from ptops.faultinject.spec import NODE_KINDS

    for f in faults:
        if f.kind in NODE_KINDS and not slurm:
            fail(
                f"--fault {f.text}: acts on a node of a multi-node run (add --slurm); one node "
                "has one clock"
            )
    try:
        if slurm:
            from ptops.ops.cli import slurm as slurm_cli
            from ptops.ops.slurm.commands import SlurmError

            set_ = [
                *set_,
                *slurm_cli.overrides(
                    nodes, gpus_per_node, spare_nodes, partition, time_limit, account, qos
                ),
            ]
        if command is not None:
            recipe = _command_recipe(command)
        rec, path = load(recipe, set_)
        if not slurm:  # a Slurm job's nodes may hold another environment than this login node
            from ptops.ops.cli.installcheck import launch_check

            launch_check(rec.engine, recipe or str(path))
        for f in faults:
            compute = f.kind == "bitflip" and f.params.get("target") == "compute"
            if compute and rec.engine != "titan":
                fail(
                    f"--fault {f.text}: target=compute flips what a rank hands to FSDP's gradient "
                    f"reduce-scatter, which only titan recipes have (this recipe's engine: "
                    f"{rec.engine}; target=grad is the same error after the reduce)"
                )
        target = run_dir or launcher.default_run_dir(rec)
        if slurm:
            try:
                raise typer.Exit(slurm_cli.run(rec, path, target, fault, dry_run, json_out))
            except SlurmError as e:
                fail(f"slurm: {e}")
        if dry_run:
            from ptops.ops.runrecord.rundir import RunDir

            cmd = launcher.rank_command(rec, RunDir(target), 1)
            if rec.engine in ("titan", "trl"):
                from ptops.ops.cli.dryrun import titan_dry_run
                from ptops.ops.cli.dryrun_trl import trl_dry_run

                if not json_out:
                    typer.echo(dump_json(rec))
                check = titan_dry_run if rec.engine == "titan" else trl_dry_run
                report = check(rec, path, nodes, gpus_per_node, json_out)
                if json_out:
                    report["rank_command"] = cmd.argv
                    report["resolved_recipe"] = json.loads(dump_json(rec))
                    typer.echo(json.dumps(report))
                else:
                    typer.echo("  rank command " + " ".join(cmd.argv))
                return
            typer.echo(dump_json(rec))
            typer.echo(" ".join(cmd.argv))
            return
        run = launcher.prepare_run(rec, path, target)
    except RecipeError as e:
        fail(str(e))
    from ptops.ops.cli.launch import run_launch
    from ptops.ops.obs.live import LiveExporters
    from ptops.ops.runrecord.lock import LockedError, acquire

    try:
        lock_fd = acquire(run.path)  # one launcher per run directory, supervised or not
    except LockedError as e:
        fail(str(e))
    exporters = LiveExporters(
        run.path,
        metrics_port,
        mlflow_uri,
        mlflow,
        wandb=wandb or bool(wandb_project or wandb_entity),
        wandb_project=wandb_project,
        wandb_entity=wandb_entity,
    )
    try:  # the supervisor owns the lock from here and releases it
        code = run_launch(rec, run, faults, json_out, lock_fd, supervise)
    finally:
        exporters.close()
    raise typer.Exit(code)


def _command_recipe(command: list[str]) -> str:
    """``-- COMMAND...`` as a recipe file of engine ``script`` (removed when this process ends)."""
    import atexit
    import os
    import tempfile

    from ptops.recipes.schema import command_recipe_toml

    fd, tmp = tempfile.mkstemp(prefix="ptops-script-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(command_recipe_toml(command, Path.cwd()))
    atexit.register(lambda: Path(tmp).unlink(missing_ok=True))
    return tmp


@app.command(
    cls=_EnginesCommand,
    help="List the engines (ptops' own and those other packages install: "
    "entry point group ptops.engines), the recipes they ship, and any engine plugin that did not "
    "load.",
)
def recipes(
    json_out: Annotated[
        bool, typer.Option("--json", help="Engines, recipes and plugins not loaded, as JSON.")
    ] = False,
) -> None:
    from ptops.recipes import engines
    from ptops.recipes.schema import RecipeError, load, shipped_recipes

    found = engines.engines()
    shipped = []
    for name, path in shipped_recipes().items():
        try:
            rec, _ = load(name)
            shipped.append(
                {
                    "name": name,
                    "engine": rec.engine,
                    "description": rec.description,
                    "path": str(path),
                }
            )
        except RecipeError as e:
            shipped.append({"name": name, "engine": None, "error": str(e), "path": str(path)})
    skipped = engines.not_loaded()
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "engines": [
                        {"name": n, "provider": engines.provider(n), "description": e.description}
                        for n, e in found.items()
                    ],
                    "recipes": sorted(shipped, key=lambda r: r["name"]),
                    "not_loaded": [
                        {"name": p.name, "provider": p.provider, "why": p.why, "error": p.error}
                        for p in skipped
                    ],
                },
                indent=1,
            )
        )
        return
    width = max((len(n) for n in found), default=6)
    pwidth = max((len(engines.provider(n)) for n in found), default=12)
    typer.echo("engines:")
    for name, eng in found.items():
        typer.echo(f"  {name:{width}s}  {engines.provider(name):{pwidth}s}  {eng.description}")
    width = max((len(r["name"]) for r in shipped), default=18)
    typer.echo("recipes:")
    for r in sorted(shipped, key=lambda r: r["name"]):
        if r["engine"] is None:
            typer.echo(f"  {r['name']:{width}s} INVALID {r['error']}")
        else:
            typer.echo(f"  {r['name']:{width}s} {r['engine']:6s} {r['description']}")
    if skipped:
        typer.echo("engine plugins not loaded:")
    for p in skipped:
        typer.echo(f"  {p.name} ({p.provider}): {p.why}: {p.error}")


from ptops.ops.cli.supervise import register as _register_supervision  # noqa: E402

_register_supervision(app)

from ptops.ops.cli.plan import register as _register_plan  # noqa: E402

_register_plan(app)

from ptops.ops.cli.obs import register as _register_observability  # noqa: E402

_register_observability(app)


@app.command()
def diagnose(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory (also one copied from elsewhere).")
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", help="Only attempt K's incidents, findings, timeline."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Only what happened after T: ISO time, or 10m / 2h ago."),
    ] = None,
    baseline: Annotated[
        list[Path] | None,
        typer.Option(
            "--baseline",
            metavar="RUN_DIR",
            help="Reference run of the same recipe: report where loss/grad-norm/reward curves "
            "diverge "
            "beyond seed-to-seed noise (repeat for several seeds: their spread is the noise).",
        ),
    ] = None,
    html_out: Annotated[
        Optional[Path],
        typer.Option(
            "--html",
            help="Also write the report as one self-contained HTML page (charts, incidents on "
            "the step "
            "axis, runbook links; no network needed to open it).",
        ),
    ] = None,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="A run whose metrics rotated (metrics/): replay the monitors over every record "
            "(streamed; minutes at scale), not the newest segment on.",
        ),
    ] = False,
) -> None:
    """What happened in a run: incidents first (crash, hang, numeric, straggler, RL, checkpoint),
    each with where (attempt, step, rank, host), evidence, what the supervisor did and the runbook.

    A hang names the odd rank out from every rank's stack (stacks/attempt-K/) and the collective it
    never joined (flight recorder); a crash says the signal or exit code in words, the exception and
    the last log lines of the rank that died first; a numeric incident shows loss and grad norm
    around it and the rollback taken. Below: the findings (replayed monitors + live events), a
    summary of the run's events (events_summary: state, attempts, restarts, last checkpoint) and a
    timeline. --json prints the same report as one JSON object (run_dir, incidents, findings,
    events_summary, timeline). Works on a copied run directory and on a live run (incidents so far).

    Exit 0 with a report (incidents or not); exit 2 when RUN_DIR is not a run directory or an option
    is bad.

    Examples:\n
      ptops diagnose runs/demo --json\n
      ptops diagnose runs/demo --attempt 2 --since 30m\n
      ptops diagnose runs/new --baseline runs/reference --baseline runs/reference-seed2\n
      ptops diagnose runs/demo --html demo-report.html   (open it in any browser, offline)
    """
    from ptops.ops.cli.diagnose import diagnose_command

    raise typer.Exit(diagnose_command(run_dir, json_out, attempt, since, baseline, html_out, full))


from ptops.ops.cli.profile import register as _register_profile  # noqa: E402

_register_profile(app)

from ptops.ops.cli.ckpt import app as _ckpt_app  # noqa: E402

app.add_typer(_ckpt_app, name="ckpt")

from ptops.ops.cli.chaos import register as _register_chaos  # noqa: E402

_register_chaos(app)

from ptops.ops.cli.pipeline import register as _register_pipeline  # noqa: E402

_register_pipeline(app)

from ptops.ops.cli.warm import register as _register_warm  # noqa: E402

_register_warm(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
