"""Hugging Face TRL engine: registers ``[trl]`` (light: no torch or trl import here)."""

from ptops.recipes.engines import Engine, register
from ptops.recipes.trl.config import TrlSection, check_recipe

register(
    Engine(
        name="trl",
        section=TrlSection,
        entry="ptops.recipes.trl.run:main",
        check=check_recipe,
        description="Hugging Face TRL post-training (SFT, DPO, GRPO, LoRA SFT, reward model, "
        "RLOO, GKD)",
        sidecars="ptops.recipes.trl.vllm:sidecars",
    )
)
