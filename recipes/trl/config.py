"""The ``[trl]`` recipe section. No torch or trl import here: the CLI validates recipes fast."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrlModel(_Strict):
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=64)


class TrlSection(_Strict):
    trainer: Literal["sft", "dpo", "grpo"]
    model: TrlModel = TrlModel()
    lr: float = Field(5e-4, gt=0)
    per_device_batch_size: int = Field(4, ge=1)
    max_length: int = Field(64, ge=8)
