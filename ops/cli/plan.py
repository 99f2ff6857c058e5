"""``ptops plan``: what a TorchTitan recipe needs and costs on N GPUs (``ptops.recipes.plan``,
pure)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from ptops.ops.cli.errors import fail


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        recipe: Annotated[
            str,
            typer.Argument(help="A TorchTitan recipe file or shipped name (llama3-8b-h100, ...)."),
        ],
        gpu: Annotated[
            Optional[str],
            typer.Option(
                "--gpu", help="h100, h200, a100 or b200 (default: titan.target.gpu, else h100)."
            ),
        ] = None,
        gpus: Annotated[
            Optional[int],
            typer.Option(
                "--gpus", min=1, help="GPUs in all (default: titan.target.nodes x launch.nproc)."
            ),
        ] = None,
        nodes: Annotated[
            Optional[int],
            typer.Option(
                "--nodes",
                min=1,
                help="Nodes the GPUs are spread over (default: the target's, else GPUs/8).",
            ),
        ] = None,
        mtbf_hours: Annotated[
            Optional[float],
            typer.Option(
                "--mtbf-hours",
                min=0.001,
                help="Job MTBF in hours (default: the Llama 3 fleet rate scaled to --gpus).",
            ),
        ] = None,
        set_: Annotated[
            list[str], typer.Option("--set", help="Override a recipe key, as for ptops launch.")
        ] = [],
        json_out: Annotated[
            bool, typer.Option("--json", help="Print the plan as one JSON object.")
        ] = False,
    ) -> None:
        """Size a TorchTitan recipe (or a TRL GRPO recipe's rollouts) before it burns GPU hours.

        Prints the exact parameter count, per-GPU memory (parameters, gradients and AdamW state
        under the recipe's FSDP/TP/PP/CP/EP sharding; activations under its activation
        checkpointing; logits), communication per step per parallel dimension and its time on NVLink
        / InfiniBand, step time and MFU (6N + attention FLOPs against the GPU's bf16/fp8 peak),
        checkpoint size and write time, and the checkpoint interval from Young/Daly. Every hardware
        figure and assumption is in ptops/recipes/plan.py with its source; --json includes the
        assumptions.

        For a TRL GRPO recipe: the policy's exact parameter count, rollouts per step, vLLM
        generation time and generated tokens/s on the stated GPUs (prefill compute bound, decode HBM
        bound, as many sequences running as the KV cache holds), training time, and the GPU split
        between generation and training (colocated vs a separate vLLM server) it implies.

        Exit 0 with a plan (also one that does not fit: memory.fits is false); exit 2 on bad input.

        Examples:\n
          ptops plan llama3-8b-h100\n
          ptops plan llama3-70b-h200 --gpu h100 --gpus 256 --nodes 32 --json\n
          ptops plan trl-grpo-tiny --gpu h100 --gpus 8\n
          ptops plan llama3-8b-h100 --mtbf-hours 12 --set titan.activation_checkpoint.mode='"full"'
        """
        from ptops.recipes.plan import PlanError, render
        from ptops.recipes.plan import plan as make_plan
        from ptops.recipes.schema import RecipeError, load

        try:
            rec, path = load(recipe, set_)
        except RecipeError as e:
            fail(str(e))
        if rec.engine == "trl":  # RL recipes: rollout capacity and the generation/training split
            from ptops.recipes.plan_rl import plan_grpo, render_grpo

            try:
                p = plan_grpo(rec, gpu or "h100", gpus or rec.launch.nproc)
            except PlanError as e:
                fail(f"{path}: {e}")
            typer.echo(json.dumps(p, indent=2) if json_out else render_grpo(p))
            return
        if rec.engine != "titan":
            fail(
                f"{path}: key 'engine': ptops plan sizes TorchTitan and TRL GRPO recipes (got "
                f"{rec.engine!r})"
            )
        t = rec.titan
        g = gpu or (t.target.gpu if t.target else "h100")
        n_nodes = nodes or (t.target.nodes if t.target and gpus is None else None)
        total = gpus or ((t.target.nodes if t.target else 1) * rec.launch.nproc)
        try:
            p = make_plan(rec, g, total, n_nodes, mtbf_hours)
        except PlanError as e:
            fail(f"{path}: {e}")
        typer.echo(json.dumps(p, indent=2) if json_out else render(p))
