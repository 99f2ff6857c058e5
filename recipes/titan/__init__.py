"""TorchTitan engine: registers ``[titan]`` (light: no torch import here).

Inside a rank: ``run.py`` (entry) applies ``compat.py``, then ``registry.py`` builds torchtitan's
job config from the recipe, naming ptops' components: ``trainer.py`` (the train step, its probe,
fault and silent-data-corruption hooks, the NaN loss), ``checkpointing.py`` (save, commit, resume;
helped by ``staging.py`` and ``qkvsplit.py``), ``metrics.py``, ``dataset.py``; ``context.py`` holds
the probe they share. ``config.py`` (``[titan]``), ``dryrun.py`` and ``rollback.py`` complete it.
"""

from ptops.recipes.engines import Engine, register
from ptops.recipes.titan.config import TitanSection, check

register(
    Engine(
        name="titan",
        section=TitanSection,
        entry="ptops.recipes.titan.run:main",
        check=check,
        description="TorchTitan pre-training / full-parameter SFT (FSDP2, TP, PP, CP, EP, "
        "float8, AC, compile)",
    )
)
