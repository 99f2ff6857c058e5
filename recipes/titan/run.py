"""TorchTitan engine entry: ``main(recipe, probe)`` inside each torchrun rank.

Applies the CPU/torch-2.13 compatibility layer, hands the recipe and the probe
to ptops' torchtitan components (``registry``, ``context``), then runs
torchtitan's own ``torchtitan.train.main`` with
``--module ptops.recipes.titan.registry --config ptops_recipe``. A rerun on the
same run directory resumes from the newest checkpoint that verifies against its
ptops manifest (``checkpointing.ProbeCheckpointManager._load``: newer bad ones are quarantined
to ``checkpoints/invalid/``), not torchtitan's highest ``step-N`` with ``.metadata``.
Under a supervisor the ranks accept stop requests: Ctrl-C / SIGTERM of the
supervisor makes them checkpoint the current step and return (exit 0).

Environment (set by torchrun / the launcher): RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, PTOPS_RUN_DIR, PTOPS_ATTEMPT; OMP_NUM_THREADS=1 on CPU.
Extra torchtitan CLI flags may be passed in ``PTOPS_TITAN_ARGS`` (split on
whitespace), e.g. ``--compile.enable``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ptops import envnames

REGISTRY = "ptops.recipes.titan.registry"
CONFIG = "ptops_recipe"


def titan_argv() -> list[str]:
    return [
        "--module",
        REGISTRY,
        "--config",
        CONFIG,
        *shlex.split(os.environ.get(envnames.TITAN_ARGS, "")),
    ]


def preload() -> None:
    """What a warm spare rank imports ahead of its attempt (``ops/rank/warm.py``): the rest of
    ``main`` then finds torch, torchtitan and the adapter already imported."""
    from ptops.recipes.titan import compat

    compat.apply()
    from ptops.recipes.titan import registry, trainer  # noqa: F401
    # isort: split

    import torchtitan.train  # noqa: F401


def main(recipe: Any, probe: Any) -> None:
    from ptops.recipes.titan import compat

    compat.apply()
    run_dir = Path(os.environ[envnames.RUN_DIR])
    (run_dir / "titan").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from ptops.recipes.titan import (
        context,
        registry,  # noqa: F401 - before torchtitan.train, as preload
    )

    context.set_recipe(recipe)
    context.set_probe(probe)
    probe.stop.accept()  # the trainer saves and returns on a stop request (ProbeTrainer)

    import torchtitan.train

    saved = sys.argv
    sys.argv = [saved[0], *titan_argv()]
    try:
        torchtitan.train.main()
    finally:
        sys.argv = saved
