"""The probe and the recipe of this process, and the small rank helpers (rank, world, the
``titan`` rank log).

Its own module so that the trainer (``trainer.py``), the checkpoint manager (``checkpointing.py``)
and the registry (``registry.py``) share one probe and one recipe (module globals, set by
``run.main``) without importing each other. No torchtitan import: safe before ``compat.apply()``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ptops import envnames
from ptops.ops.runrecord import ranklog

# The probe of this process; set by ``ptops.recipes.titan.run.main``. Without
# one (e.g. torchtitan's own CLI with --module ptops.recipes.titan.registry)
# the components behave like stock torchtitan.
_PROBE: Any = None


def set_probe(probe: Any) -> None:
    global _PROBE
    _PROBE = probe


def get_probe() -> Any:
    return _PROBE


_RECIPE: Any = None


def set_recipe(recipe: Any) -> None:
    global _RECIPE
    _RECIPE = recipe


def get_recipe() -> Any:
    """The run's recipe: the one ``run.main`` set, else the run directory's ``recipe.json``
    (torchtitan's own CLI with ``--module ptops.recipes.titan.registry``)."""
    if _RECIPE is not None:
        return _RECIPE
    from ptops.recipes.schema import from_json

    run_dir = Path(os.environ[envnames.RUN_DIR])
    return from_json((run_dir / "recipe.json").read_text())


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _log(msg: str) -> None:
    ranklog.get("titan").info("%s", msg)


def _err_text(err: Any) -> str:
    if isinstance(err, BaseException):
        text = f"{type(err).__name__}: {err}"
    else:
        text = str(err)
    return text[:1000]
