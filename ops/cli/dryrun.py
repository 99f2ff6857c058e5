"""``ptops launch RECIPE --dry-run`` for TorchTitan recipes: everything short of a GPU.

In order, each failing with one ``error:`` line (exit 2): the schema (already done by ``load``),
the parallel degrees against the declared world (``nodes x gpus-per-node``), the planner's
memory fit on the recipe's GPU, and TorchTitan's own fake-backend build of the real
parallelisation for that world (``ptops.recipes.titan.dryrun`` in a subprocess: torch stays out
of the CLI, and a hung build is bounded by ``PTOPS_DRYRUN_TIMEOUT_S``, default 900 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from ptops import envnames
from ptops.ops.cli.errors import fail

TOLERANCE = 0.10  # planner param bytes vs the fake-backend's rank-0 shard (docs/recipes.md)


def _size(b: float) -> str:
    return f"{b / 1024**3:.3f} GiB" if b >= 1024**3 else f"{b / 1024**2:.3f} MiB"


def engine_dry_run(module: str, rec, args: list[str], path: Path, what: str) -> dict:
    """Run an engine's dry-run ``module`` on the recipe in a subprocess (torch and the engine stay
    out of the CLI process) and return its ``PTOPS_DRYRUN`` result; a timeout or a death is one
    error line. With a standing pool (``ptops warm``) that fits, the subprocess is forked from it
    (``ops/rank/warmrun.py``: seconds instead of ~13 CPU-s of imports) and the result names it
    (``warm_pool``)."""
    from ptops.ops.rank import warmrun
    from ptops.ops.supervisor.launcher import rank_constants
    from ptops.recipes.schema import dump_json

    timeout = float(os.environ.get(envnames.DRYRUN_TIMEOUT_S, "900"))
    with tempfile.TemporaryDirectory(prefix="ptops-dryrun-") as tmp:
        rj = Path(tmp) / "recipe.json"
        rj.write_text(dump_json(rec))
        # a rank's environment (offline hub), one thread: it builds what a rank builds, but here
        penv = {**os.environ, **rank_constants(1), envnames.RUN_DIR: tmp}
        pool = warmrun.standing_pool(rec.engine, penv)
        try:
            proc = None
            if pool:
                try:
                    proc = warmrun.run_module(pool, module, [str(rj), *args], penv, timeout)
                except (OSError, ValueError, KeyError):
                    pool = ""  # it went away meanwhile: a cold subprocess, as without one
            if proc is None:
                proc = subprocess.run(
                    [sys.executable, "-m", module, str(rj), *args],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    env=penv,
                )
        except subprocess.TimeoutExpired:
            fail(f"{path}: {what} did not finish in {timeout:.0f} s (PTOPS_DRYRUN_TIMEOUT_S)")
    prefix = envnames.DRYRUN_LINE + " "
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(prefix)), None)
    if line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        fail(f"{path}: {what} died (exit {proc.returncode}): {tail}")
    return {
        **json.loads(line.removeprefix(prefix)),
        **({"warm_pool": pool} if pool else {}),
    }


def say_warm(res: dict) -> None:
    if res.get("warm_pool"):
        typer.echo(
            f"  warm         forked from the standing pool {res['warm_pool']} (`ptops warm`)"
        )


def titan_dry_run(
    rec, path: Path, nodes: int | None, gpus_per_node: int | None, json_out: bool
) -> dict:
    from ptops.recipes.plan import PlanError, fit_problem, plan
    from ptops.recipes.titan.config import degrees, world_of

    t = rec.titan
    world = world_of(rec, nodes, gpus_per_node)
    n_nodes = nodes if nodes is not None else (t.target.nodes if t.target else 1)
    gpu = t.target.gpu if t.target else "h100"
    report: dict = {
        "recipe": rec.name,
        "world": world,
        "nodes": n_nodes,
        "gpu": gpu,
        "schema": "ok",
    }
    degs, problem = degrees(rec, world)
    if problem is not None:
        fail(
            f"{path}: key 'titan.parallelism': {problem} ({n_nodes} nodes x {world // n_nodes} "
            "GPUs)"
        )
    report["degrees"] = degs
    try:
        p = plan(rec, gpu, world, n_nodes)
    except PlanError as e:
        fail(f"{path}: {e}")
    problem = fit_problem(p)
    if problem is not None:
        fail(f"{path}: key 'titan': does not fit: {problem}")
    report["plan_memory_gib"] = round(p["memory"]["total_gib"], 2)
    report["plan_param_bytes_per_gpu"] = int(p["memory"]["params_gib"] * 1024**3)
    if not json_out:
        typer.echo(
            f"dry run: {rec.name} for {world} ranks ({n_nodes} nodes x {world // n_nodes} {gpu})"
        )
        typer.echo("  schema       ok")
        typer.echo("  degrees      ok: " + " ".join(f"{k}={v}" for k, v in degs.items()))
        typer.echo(
            f"  memory       ok: planner {p['memory']['total_gib']:.1f} of "
            f"{p['memory']['gpu_gib']:.1f} GiB per GPU"
            + ("" if t.target else f" (no titan.target: a {gpu} assumed)")
            + " (`ptops plan` for the breakdown)"
        )
        typer.echo(
            f"  torchtitan   building the real parallelisation for {world} ranks on a fake "
            "backend (CPU)..."
        )
    what = f"TorchTitan fake-backend dry run for {world} ranks"
    res = engine_dry_run("ptops.recipes.titan.dryrun", rec, [str(world)], path, what)
    if not res.get("ok"):
        fail(f"{path}: {what} failed: {res.get('error')}")
    measured = res["rank0_param_bytes"]
    planned = report["plan_param_bytes_per_gpu"]
    ratio = planned / measured if measured else float("inf")
    res["plan_vs_measured_param_bytes"] = round(ratio, 4)
    res["within_tolerance"] = abs(ratio - 1) <= TOLERANCE
    report["torchtitan"] = res
    if not json_out:
        m = res["mesh"]
        typer.echo(
            f"  torchtitan   ok in {res['seconds']} s: mesh "
            + " ".join(f"{k}={v}" for k, v in m.items())
            + f"; {res['model']} ({res['rank0_params']:,} params), {res['float8_modules']} "
            "Float8Linear,"
            f" {res['model_parts']} model part(s), optimizer built"
        )
        say_warm(res)
        typer.echo(
            f"  param bytes  rank 0 holds {_size(measured)}; planner {_size(planned)}"
            f" (x{ratio:.3f}; tolerance "
            f"{TOLERANCE:.0%}{'' if res['within_tolerance'] else ': OUTSIDE'})"
        )
        typer.echo(
            f"  process peak {res['peak_rss_gib']:.2f} GiB RSS (TorchTitan's memory report on CPU)"
        )
        for item in res["not_checked"]:
            typer.echo(f"  not checked  {item}")
        if t.parallelism.cp > 1:
            typer.echo(
                "  not checked  CP on CPU: the CP mesh and wrappers were built, but CP attention "
                "cannot run on CPU"
                " (no DTensor strategy for CPU SDPA); scripts/gpu_check.sh runs it on a GPU"
            )
    return report
