"""TorchTitan engine: registers ``[titan]`` (light: no torch import here)."""

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
