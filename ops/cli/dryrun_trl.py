"""``ptops launch TRL-RECIPE --dry-run``: the schema, then the model on the meta device, LoRA
targets, the TRL config object and a per-GPU memory estimate (``ptops.recipes.trl.dryrun`` in a
subprocess: torch and trl stay out of the CLI); errors are one ``error:`` line (exit 2). Nothing is
downloaded: the architecture is the recipe's ``[trl.model]``."""

from __future__ import annotations

from pathlib import Path

import typer

from ptops.ops.cli.errors import fail


def trl_dry_run(
    rec, path: Path, nodes: int | None, gpus_per_node: int | None, json_out: bool
) -> dict:
    from ptops.ops.cli.dryrun import engine_dry_run, say_warm
    from ptops.recipes.plan import GPUS
    from ptops.recipes.trl.vllm import sidecar_specs

    sec = rec.trl
    n_nodes = nodes if nodes is not None else (sec.target.nodes if sec.target else 1)
    per_node = gpus_per_node if gpus_per_node is not None else rec.launch.nproc
    world = n_nodes * per_node
    gpu = sec.target.gpu if sec.target else "h100"
    if gpu not in GPUS:
        fail(f"{path}: key 'trl.target.gpu': one of {', '.join(GPUS)} (got {gpu!r})")
    gpu_gib = GPUS[gpu].memory_gib
    report: dict = {
        "recipe": rec.name,
        "trainer": sec.trainer,
        "world": world,
        "nodes": n_nodes,
        "gpu": gpu,
        "schema": "ok",
        "sidecars": sidecar_specs(rec, check_available=False, resolve=False),
    }
    if not json_out:
        typer.echo(
            f"dry run: {rec.name} ({sec.trainer}) for {world} ranks ({n_nodes} nodes x "
            f"{per_node} {gpu})"
        )
        typer.echo("  schema       ok")
        typer.echo("  model        building on the meta device (no weights, no download)...")
    res = engine_dry_run(
        "ptops.recipes.trl.dryrun",
        rec,
        [str(world), str(gpu_gib)],
        path,
        "TRL dry run",
    )
    if not res.get("ok"):
        fail(f"{path}: key 'trl': TRL dry run failed: {res.get('error')}")
    if not res["fits"]:
        fail(
            f"{path}: key 'trl': does not fit: {res['memory_total_gib']:.1f} GiB per GPU estimated "
            f"({', '.join(f'{k} {v}' for k, v in res['memory_gib'].items())}) > {gpu_gib:.1f} "
            f"GiB ({gpu})"
        )
    report["trl"] = res
    if not json_out:
        typer.echo(
            f"  model        ok in {res['seconds']} s: {res['model']} {res['params']:,} params, "
            f"{res['trainable_params']:,} trainable"
            + (f" (LoRA on {', '.join(res['lora_modules'])})" if res.get("lora_modules") else "")
        )
        say_warm(res)
        if "teacher_model" in res:
            typer.echo(
                f"  teacher      ok: {res['teacher_model']} {res['teacher_params']:,} params, "
                "same vocabulary"
            )
        typer.echo(
            f"  trl config   ok: {res['trl_config']}"
            + (" (vLLM rollouts)" if res["use_vllm"] else "")
        )
        typer.echo(
            f"  memory       ok: ~{res['memory_total_gib']:.1f} of {gpu_gib:.1f} GiB per GPU ("
            + ", ".join(f"{k.removesuffix('_gib')} {v}" for k, v in res["memory_gib"].items() if v)
            + (", FSDP over the world" if sec.fsdp else "")
            + ")"
        )
        for sc in report["sidecars"]:
            typer.echo(
                f"  sidecar      {sc['name']}: "
                + " ".join(sc["argv"])
                + (
                    f" (CUDA_VISIBLE_DEVICES={sc['env']['CUDA_VISIBLE_DEVICES']})"
                    if sc["env"]
                    else ""
                )
                + f"; health {sc['health_url']}"
            )
        for item in res["not_checked"]:
            typer.echo(f"  not checked  {item}")
    return report
