"""Entry point of every rank: ``python -m ptops.recipes.entry`` under torchrun.

The launcher writes the resolved recipe to ``RUN_DIR/recipe.json`` and sets
``PTOPS_RUN_DIR`` and ``PTOPS_ATTEMPT``; each rank sends its own output to
``logs/attempt-K/rank-R.log`` so that two ranks never interleave in one file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _redirect_output(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    from ptops.ops.probe import Probe
    from ptops.ops.recipe import from_json
    from ptops.ops.rundir import RunDir

    run = RunDir(Path(os.environ["PTOPS_RUN_DIR"]))
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("PTOPS_ATTEMPT", "1"))
    if os.environ.get("PTOPS_RANK_LOGS", "1") == "1":
        _redirect_output(run.rank_log(attempt, rank))
    recipe = from_json(run.recipe_json.read_text())
    probe = Probe.from_env()
    probe.startup()
    if recipe.engine == "titan":
        from ptops.recipes.titan.run import main as engine_main
    else:
        from ptops.recipes.trl.run import main as engine_main
    engine_main(recipe, probe)


if __name__ == "__main__":
    main()
