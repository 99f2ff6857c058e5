"""Local launcher: runs a recipe's ranks through torchrun on this machine.

Every launch, plain or ``--supervise``, runs through the Supervisor; this module is
what it needs from the machine: the run directory (``prepare_run``) and the rank
command (``rank_command``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ptops import envnames
from ptops.ops.rank import RANK_PYTHON
from ptops.ops.runrecord.events import EventKind
from ptops.ops.runrecord.metrics import MetricsIndexError, rank0_records, segments
from ptops.ops.runrecord.rundir import RunDir, final_metrics_by_step
from ptops.recipes.schema import Recipe, RecipeError, dump_json, from_json

# Sections that change how a run is watched, not what it computes: a resume may retune them.
OPERATIONAL_SECTIONS = {"supervisor", "monitors", "slurm"}


def default_run_dir(recipe: Recipe) -> Path:
    return Path("runs") / f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _first_difference(a: dict, b: dict, prefix: str = "") -> str:
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            found = _first_difference(va, vb, f"{prefix}{key}.")
            if found:
                return found
        elif va != vb:
            return f"{prefix}{key} (run has {va!r}, given {vb!r})"
    return ""


def prepare_run(recipe: Recipe, recipe_path: Path, run_dir: Path) -> RunDir:
    """Create a new run directory, or check that an existing one holds this same recipe."""
    run = RunDir(Path(run_dir))
    if run.recipe_json.exists():
        try:  # a resumed run's rotated metrics: a hostile index is a line before launch, not a
            segments(run.path)  # supervisor error after it
        except MetricsIndexError as e:
            raise RecipeError(f"{e} (the run directory to resume)") from None
        stored = from_json(run.recipe_json.read_text())
        a = stored.model_dump(exclude=OPERATIONAL_SECTIONS)
        b = recipe.model_dump(exclude=OPERATIONAL_SECTIONS)
        if a != b:
            diff = _first_difference(a, b)
            raise RecipeError(
                f"{run.recipe_json}: key {diff.split(' ')[0]}: this run directory holds a "
                "different recipe "
                f"({diff}); resume it with the same recipe and --set values, or use a new --run-dir"
            )
        if stored != recipe:  # retuned watchdogs on resume: allowed, and recorded
            changed = _first_difference(stored.model_dump(), recipe.model_dump())
            run.recipe_json.write_text(dump_json(recipe) + "\n")
            run.event(EventKind.RECIPE_UPDATED, first_change=changed)
        return run
    run.create()
    run.recipe_json.write_text(dump_json(recipe) + "\n")
    shutil.copyfile(recipe_path, run.recipe_toml)
    for p in (run.recipe_json, run.recipe_toml):
        os.chmod(p, 0o600)
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankCommand:
    argv: list[str]
    env: dict[str, str]


def rank_command(
    recipe: Recipe, run: RunDir, attempt: int, extra_env: dict[str, str] | None = None
) -> RankCommand:
    port = recipe.launch.master_port or free_port()
    # -P (every interpreter ptops starts): the cwd is not put first on sys.path, so a folder named
    # ``ptops`` where the user launches (the project's checkout is one) cannot shadow the installed
    # package. torchrun starts its workers as ``python -u -m ...`` itself; ``--no-python`` makes it
    # run our interpreter line instead. A user's script still sees its own folder (and a ``-m``
    # module the cwd) on sys.path: recipes/script/run.py puts them there as ``python`` would.
    argv = [
        sys.executable, "-P", "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(recipe.launch.nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "--no-python", *RANK_PYTHON,
    ]  # fmt: skip
    env = {**os.environ, **rank_constants(recipe.launch.omp_num_threads)}
    env.update({envnames.RUN_DIR: str(run.path.resolve()), envnames.ATTEMPT: str(attempt)})
    env.update(extra_env or {})
    return RankCommand(argv, env)


def node_agent_command(cmd: RankCommand, nproc: int, log: Path) -> RankCommand:
    """``cmd`` (torchrun, or warmlaunch) run by a node agent on this machine: the ranks connect
    to the agent, which relays them to the supervisor as every node of a Slurm run does. The
    launcher's output goes to ``log`` (the agent's own lines too: the supervisor's file)."""
    env = {
        **cmd.env,
        envnames.NODE_ARGV: json.dumps(cmd.argv),
        envnames.NODE_LOG: str(log),
        envnames.NODE_NPROC: str(nproc),
        envnames.NODE_NNODES: "1",
        envnames.NODE_RANK: "0",
    }
    return RankCommand([sys.executable, "-P", "-m", "ptops.ops.node.agent"], env)


def rank_constants(omp_num_threads: int) -> dict[str, str]:
    """The environment every rank gets whatever its run; a standing warm pool (``ptops warm``)
    imports under it too, so its children match a cold rank."""
    return {
        "OMP_NUM_THREADS": str(omp_num_threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }


def completed_step(run: RunDir) -> int:
    """The last step rank 0 recorded, 0 when none (rank 0's lines only: a resumed run at scale
    does not parse every rank's)."""
    steps = final_metrics_by_step(rank0_records(run.path))
    return max(steps, default=0)
