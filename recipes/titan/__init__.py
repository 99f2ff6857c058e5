"""TorchTitan engine: registers ``[titan]`` (light: no torch import here)."""

from ptops.recipes.engines import Engine, register
from ptops.recipes.titan.config import TitanSection

register(
    Engine(
        name="titan",
        section=TitanSection,
        entry="ptops.recipes.titan.run:main",
        description="TorchTitan pre-training / full-parameter SFT (FSDP2, TP, PP)",
    )
)
