"""The ``[titan]`` recipe section. No torch import here: the CLI validates recipes fast."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TitanModel(_Strict):
    dim: int = Field(64, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=64, description="size of the locally built tokenizer")


class TitanParallelism(_Strict):
    dp_shard: int = Field(-1, description="FSDP2 shard degree; -1 = the ranks left over")
    dp_replicate: int = Field(1, ge=1, description="DDP replicas")
    tp: int = Field(1, ge=1, description="tensor parallel degree")
    pp: int = Field(1, ge=1, description="pipeline parallel degree")
    pp_schedule: str = Field("1F1B", description="pipeline schedule name")


class TitanSection(_Strict):
    model: TitanModel = TitanModel()
    parallelism: TitanParallelism = TitanParallelism()
    seq_len: int = Field(128, ge=8)
    local_batch_size: int = Field(4, ge=1)
    lr: float = Field(8e-4, gt=0)
    warmup_steps: int = Field(2, ge=0)
    max_norm: float = Field(1.0, gt=0)
    deterministic: bool = Field(True, description="torch.use_deterministic_algorithms in every rank")
    async_checkpoint: bool = Field(
        True, description="DCP async save for interval checkpoints: training blocks only while the state is staged"
    )
    train_timeout_s: int = Field(100, ge=1, description="collective timeout after the first step (hang -> error)")
