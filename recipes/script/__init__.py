"""Bring your own training script: registers ``[script]`` (light: no torch import here).

``ptops launch [--supervise] -- python train.py ARGS`` synthesises a recipe of this engine; a recipe
TOML can hold the same section, so chaos, pipelines and Slurm take a user's script like any recipe.
"""

from ptops.recipes.engines import Engine, register
from ptops.recipes.script.config import ScriptSection, check

register(
    Engine(
        name="script",
        section=ScriptSection,
        entry="ptops.recipes.script.run:main",
        check=check,
        description="your own training script (python train.py ..., or any command), with the "
        "optional "
        "ptops.rank API for step records, exact resume and rollback",
        complete_on_exit=True,
    )
)
