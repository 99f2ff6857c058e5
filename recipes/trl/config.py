"""The ``[trl]`` recipe section. No torch or trl import here: the CLI validates recipes fast."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrlModel(_Strict):
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=64)
    seed: int = Field(0, description="seed of the initial weights (independent of train.seed)")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "TrlModel":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        return self


class TrlJudge(_Strict):
    """``[trl.judge]``: the LLM judge of ``reward = "judge"`` (recipes/trl/judge.py)."""

    path: str = Field("", description="a model directory (config.json, weights, tokenizer), e.g. a reward-model "
                      "stage's checkpoint; empty: a tiny judge built locally from `model` (tests, demos)")
    model: TrlModel = Field(TrlModel(seed=1234), description="shape and seed of the locally built tiny judge")
    expect_digest: str = Field("", description="refuse to start unless the judge's weights have this sha256 "
                               "(the digest is logged in the `reward_source` event)")
    max_chars: int = Field(2000, ge=16, description="longest completion text the judge reads (the rest is cut)")


class TrlSandbox(_Strict):
    """``[trl.sandbox]``: limits of one completion's run for ``reward = "code"`` (recipes/trl/sandbox.py)."""

    cpu_s: int = Field(2, ge=1, description="CPU seconds (RLIMIT_CPU); then SIGKILL")
    wall_s: float = Field(10.0, gt=0, description="wall-clock seconds before the whole sandbox is killed")
    memory_mb: int = Field(512, ge=64, description="address space (RLIMIT_AS)")
    max_procs: int = Field(16, ge=1, description="processes of the sandbox's own uid (RLIMIT_NPROC)")
    file_mb: int = Field(8, ge=1, description="largest file it may write (RLIMIT_FSIZE)")


class TrlSection(_Strict):
    trainer: Literal["sft", "dpo", "grpo"]
    model: TrlModel = TrlModel()
    lr: float = Field(5e-4, gt=0)
    per_device_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1, description="gradient accumulation steps per optimizer step")
    max_length: int = Field(64, ge=8, description="max tokens of a training sequence (GRPO: of the prompt)")
    dataset_size: int = Field(256, ge=8, description="rows of the generated local data set")
    max_grad_norm: float = Field(1.0, gt=0)
    # DPO and GRPO
    beta: float = Field(0.1, gt=0, description="KL coefficient (DPO beta; GRPO beta > 0 so that kl is logged)")
    # GRPO
    num_generations: int = Field(4, ge=2, description="completions per prompt; must divide the global batch")
    max_completion_length: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    reward: Literal["correct", "length", "math", "judge", "code"] = Field(
        "correct",
        description="GRPO training reward: `correct` (answer checked, + 0.2 x format), `length` "
        "(deliberately gameable: pays for characters; the held-out `verifier` is logged at weight 0), "
        "`math` (final answer verified: boxed / 'answer:' / last number, fractions, sympy), `judge` "
        "(an LLM judge's score, [trl.judge]), `code` (fraction of test asserts passed in a sandbox, [trl.sandbox])",
    )
    judge: TrlJudge = TrlJudge()
    sandbox: TrlSandbox = TrlSandbox()
    verifier: bool = Field(
        False, description="also log the held-out graded-correctness `verifier` reward (weight 0) as "
        "rewards/verifier/mean (always on with reward = \"length\")",
    )


def generation_batch(section: TrlSection, nproc: int) -> int:
    """Prompts x completions generated per optimizer step across all ranks (GRPO)."""
    return section.per_device_batch_size * nproc * section.grad_accum


def check_recipe(recipe) -> tuple[str, str] | None:
    """The GRPO batch rule, in one place: caught at load instead of as a traceback in every rank."""
    sec = recipe.trl
    if sec is None or sec.trainer != "grpo":
        return None
    batch = generation_batch(sec, recipe.launch.nproc)
    if batch % sec.num_generations:
        return (
            "trl.num_generations",
            f"must divide per_device_batch_size x launch.nproc x grad_accum = {sec.per_device_batch_size} x "
            f"{recipe.launch.nproc} x {sec.grad_accum} = {batch} (got {sec.num_generations})",
        )
    return None
