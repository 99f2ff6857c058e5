"""An OOM incident beside what ``ptops plan`` estimated for the run's recipe.

Why: a memory curve says how the rank got to its limit; the plan says where it should have
stopped. A run that crashed at 1.05x its plan is a tight recipe; one at 3x is a leak or a plan
that misses something. The planner models TorchTitan's FSDP2 memory per GPU (``recipes/plan.py``),
so only titan recipes get the comparison, and on a CPU run the measure is the host's RSS, which
the line says. Here, not in ``diagnostics/``: the planner lives with the recipes, which
``diagnostics/`` does not import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB_PER_GIB = 1024.0


def add_plan(report: dict[str, Any], run_dir: Path) -> None:
    """Give each crash incident that has a memory curve ``details["plan"]`` and one evidence line
    (placed before the curve, so the human summary shows it)."""
    crashes = [
        i
        for i in report.get("incidents", [])
        if i["kind"] == "crash" and (i.get("details") or {}).get("memory_curve")
    ]
    if not crashes:
        return
    planned = _plan(Path(run_dir), len(report.get("ranks") or []))
    if planned is None:
        return
    for inc in crashes:
        last = inc["details"]["memory_curve"][-1]
        if "cuda_reserved_mb" in last:
            measured, what = last["cuda_reserved_mb"] / MIB_PER_GIB, "CUDA reserved"
        else:
            measured, what = last.get("mem_rss_mb", 0.0) / MIB_PER_GIB, "host RSS"
        total = planned["memory_gib"]["total_gib"]
        ratio = measured / total if total else None
        inc["details"]["plan"] = {
            **planned,
            "measured_gib": round(measured, 3),
            "measured": what,
            "ratio": round(ratio, 3) if ratio is not None else None,
        }
        m = planned["memory_gib"]
        line = (
            f"ptops plan for {planned['recipe']} on {planned['world']} x {planned['gpu']}: "
            f"{total:.2f} GiB per GPU (params {m['params_gib']:.2f}, optimizer "
            f"{m['optimizer_gib']:.2f}, activations {m['activations_gib']:.2f}); rank "
            f"{inc['rank']} last recorded {measured:.2f} GiB {what}"
            + (f" ({ratio:.2f}x the plan)" if ratio is not None else "")
            + (": host memory, not the GPU memory the plan models" if what == "host RSS" else "")
        )
        ev = inc["evidence"]
        at = next((n for n, x in enumerate(ev) if x.startswith("memory of rank")), len(ev))
        ev.insert(at, line)


def _plan(run_dir: Path, ranks: int) -> dict[str, Any] | None:
    """The plan of the run's recipe for its world: ``ranks``, the ranks the report saw in the
    metrics (every node's, under Slurm too), else the recipe's ``launch.nproc``."""
    from ptops.recipes.plan import PlanError, plan
    from ptops.recipes.schema import from_json

    try:
        rec = from_json((run_dir / "recipe.json").read_text())
    except (OSError, ValueError):
        return None
    if rec.engine != "titan":
        return None
    world = ranks or rec.launch.nproc
    gpu = rec.titan.target.gpu if rec.titan.target else "h100"
    try:
        p = plan(rec, gpu, world, 1 if world <= 8 else None)
    except (PlanError, ValueError, ArithmeticError, KeyError):  # a copied run's odd recipe
        return None
    mem = {k: round(v, 4) for k, v in p["memory"].items() if k.endswith("_gib")}
    return {"recipe": rec.name, "gpu": gpu, "world": world, "memory_gib": mem}
