"""Local launcher: runs a recipe's ranks through torchrun on this machine.

The supervisor and the plain (unsupervised) launch share ``prepare_run`` and
``rank_command``, so a supervised attempt starts ranks exactly as a plain one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ptops.recipes.schema import Recipe, RecipeError, dump_json, from_json
from ptops.ops.runrecord.rundir import RunDir, final_metrics_by_step


# Sections that change how a run is watched, not what it computes: a resume may retune them.
OPERATIONAL_SECTIONS = {"supervisor", "monitors"}


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
        stored = from_json(run.recipe_json.read_text())
        a = stored.model_dump(exclude=OPERATIONAL_SECTIONS)
        b = recipe.model_dump(exclude=OPERATIONAL_SECTIONS)
        if a != b:
            diff = _first_difference(a, b)
            raise RecipeError(
                f"{run.recipe_json}: key {diff.split(' ')[0]}: this run directory holds a different recipe "
                f"({diff}); resume it with the same recipe and --set values, or use a new --run-dir"
            )
        if stored != recipe:  # retuned watchdogs on resume: allowed, and recorded
            changed = _first_difference(stored.model_dump(), recipe.model_dump())
            run.recipe_json.write_text(dump_json(recipe) + "\n")
            run.event("recipe_updated", first_change=changed)
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


def rank_command(recipe: Recipe, run: RunDir, attempt: int, extra_env: dict[str, str] | None = None) -> RankCommand:
    port = recipe.launch.master_port or free_port()
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(recipe.launch.nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "-m", "ptops.ops.rank.entry",
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        {
            "PTOPS_RUN_DIR": str(run.path.resolve()),
            "PTOPS_ATTEMPT": str(attempt),
            "OMP_NUM_THREADS": str(recipe.launch.omp_num_threads),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
        }
    )
    env.update(extra_env or {})
    return RankCommand(argv, env)


def completed_step(run: RunDir) -> int:
    """The last step rank 0 recorded, 0 when none."""
    steps = final_metrics_by_step(run.read_metrics())
    return max(steps, default=0)


def run_plain(recipe: Recipe, run: RunDir, progress) -> int:
    """One attempt without supervision: start torchrun, follow progress, record the outcome.

    Returns the process exit code to use (0 done, 1 failed, 130/143 interrupted).
    """
    attempt = run.last_attempt() + 1
    run.logs(attempt).mkdir(parents=True, exist_ok=True)
    cmd = rank_command(recipe, run, attempt)
    run.event("launch", attempt=attempt, supervised=False, nproc=recipe.launch.nproc)
    agent_log = open(run.logs(attempt) / "torchrun.log", "ab")
    proc = subprocess.Popen(cmd.argv, env=cmd.env, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    stop_signal: list[int] = []

    def _forward(signum, _frame):
        stop_signal.append(signum)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        offset = 0
        while True:
            offset = progress.follow(run.metrics, offset)
            rc = proc.poll()
            if rc is not None:
                progress.follow(run.metrics, offset)
                break
            time.sleep(0.25)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        agent_log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    step = completed_step(run)
    if stop_signal:
        run.event("stopped", attempt=attempt, signal=stop_signal[0], step=step)
        return 128 + stop_signal[0]
    if rc == 0 and step >= recipe.train.steps:
        run.event("completed", step=step)
        return 0
    run.event("failed", reason=f"torchrun exited {rc} at step {step}; see {run.logs(attempt)}", attempt=attempt)
    return 1
