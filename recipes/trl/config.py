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
    # production models: the architecture stated in the recipe (so --dry-run needs no download)
    arch: Literal["qwen2", "llama"] = Field(
        "qwen2", description="decoder family (transformers config class)"
    )
    intermediate_size: int | None = Field(
        None, ge=8, description="MLP width (default 2 x hidden_size)"
    )
    num_kv_heads: int | None = Field(
        None, ge=1, description="grouped-query KV heads (default num_heads)"
    )
    tie_word_embeddings: bool = True
    max_position_embeddings: int = Field(512, ge=8)
    rope_theta: float = Field(10000.0, gt=0)
    pretrained: str | None = Field(
        None,
        description="HF hub id or local folder of the real weights (GPU nodes); unset: the tiny "
        "model "
        "built locally from these dimensions",
    )

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "TrlModel":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}"
            )
        return self


class TrlJudge(_Strict):
    """``[trl.judge]``: the LLM judge of ``reward = "judge"`` (recipes/trl/judge.py)."""

    path: str = Field(
        "",
        description="a model directory (config.json, weights, tokenizer), e.g. a reward-model "
        "stage's checkpoint; empty: a tiny judge built locally from `model` (tests, demos)",
    )
    model: TrlModel = Field(
        TrlModel(seed=1234), description="shape and seed of the locally built tiny judge"
    )
    expect_digest: str = Field(
        "",
        description="refuse to start unless the judge's weights have this sha256 "
        "(the digest is logged in the `reward_source` event)",
    )
    max_chars: int = Field(
        2000, ge=16, description="longest completion text the judge reads (the rest is cut)"
    )
    sees: Literal["completion", "answer"] = Field(
        "completion",
        description="what of a completion the judge reads: `completion` (all of it, folded and "
        "quoted; it scores the least of its score and those of it without each run of its "
        "sentences/lines that leaves the stated final answer's in place) or `answer` (for tasks "
        "with a fixed answer format: only the final answer that the math grader's extractor "
        'finds, as "The answer is N.", at most 64 characters; no answer found scores 0)',
    )


class TrlSandbox(_Strict):
    """``[trl.sandbox]``: limits of one completion's run for ``reward = "code"``
    (recipes/trl/sandbox.py)."""

    cpu_s: int = Field(
        2,
        ge=1,
        description="CPU seconds of the whole completion (its cgroup) and of each process "
        "(RLIMIT_CPU); then SIGKILL",
    )
    wall_s: float = Field(
        10.0, gt=0, description="wall-clock seconds before the whole sandbox is killed"
    )
    memory_mb: int = Field(
        512,
        ge=64,
        description="memory of the whole completion (its cgroup: all its processes together) "
        "and address space of each process (RLIMIT_AS)",
    )
    max_procs: int = Field(
        16,
        ge=1,
        description="tasks of the whole completion (cgroup pids.max) and of its uid (RLIMIT_NPROC)",
    )
    file_mb: int = Field(8, ge=1, description="largest file it may write (RLIMIT_FSIZE)")
    allow_weak_isolation: bool = Field(
        False,
        description="where the kernel refuses the network, pid, mount or IPC namespace, grade "
        "anyway with the audit hook alone (it lives in the completion's interpreter and can be "
        "switched off by it); false: such completions are not run and score 0 (status refused)",
    )


class TrlLora(_Strict):
    """LoRA adapters (peft) for ``trainer = "lora_sft"``: only the adapters train and are
    checkpointed."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )


ENGINE_MIN_HEAD = 32  # vLLM CPU: "Unsupported CPU attention configuration" below


class TrlVllm(_Strict):
    """vLLM rollouts for GRPO / RLOO (TRL's own integration; needs a GPU and the ``vllm`` extra).

    Without either the run falls back to TRL's generate path and says so once."""

    mode: Literal["colocate", "server"]
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="vLLM's share of each GPU it uses"
    )
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_length: int | None = Field(None, ge=8)
    # server mode: `trl vllm-serve` as a supervised sidecar process of the run
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    group_port: int = Field(51216, ge=1, le=65535, description="weight-sync communicator port")
    server_gpus: list[int] = Field(
        default_factory=list, description="CUDA devices of the server (server mode)"
    )
    health_timeout_s: float = Field(
        600.0, gt=0, description="the server must answer /health within this"
    )
    max_restarts: int = Field(3, ge=0, description="server restarts before the sidecar is given up")
    dtype: Literal["trainer", "float32", "bfloat16", "float16"] = Field(
        "trainer",
        description="the engine's precision; trainer: the trainer's (float32 on CPU), so that "
        "rollouts and the loss see the same policy (engine/lp_gap reports what differs)",
    )
    verify: bool = Field(
        True,
        description="after every weight sync, check that the engine serves the trainer's weights "
        "(log-probabilities of a probe sequence from both); a sync that did not take is redone "
        "once, then the run stops",
    )
    python: str | None = Field(
        None,
        description="server mode: the interpreter of the engine's environment (default: the "
        "launching one); the engine may live in its own environment, as in its own container",
    )


class TrlTarget(_Strict):
    """What a production recipe is sized for (``--dry-run``'s memory check)."""

    gpu: str = "h100"
    nodes: int = Field(1, ge=1)


class TrlSection(_Strict):
    trainer: Literal["sft", "dpo", "grpo", "lora_sft", "reward", "rloo", "gkd"]
    model: TrlModel = TrlModel()
    lr: float = Field(5e-4, gt=0)
    per_device_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1, description="gradient accumulation steps per optimizer step")
    max_length: int = Field(
        64, ge=8, description="max tokens of a training sequence (GRPO: of the prompt)"
    )
    dataset_size: int = Field(256, ge=8, description="rows of the generated local data set")
    max_grad_norm: float = Field(1.0, gt=0)
    # DPO and GRPO
    beta: float = Field(
        0.1, gt=0, description="KL coefficient (DPO beta; GRPO beta > 0 so that kl is logged)"
    )
    # GRPO
    num_generations: int = Field(
        4, ge=2, description="completions per prompt; must divide the global batch"
    )
    max_completion_length: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    reward: Literal["correct", "length", "math", "judge", "code"] = Field(
        "correct",
        description="GRPO training reward: `correct` (answer checked, + 0.2 x format), `length` "
        "(deliberately gameable: pays for characters; the held-out `verifier` is logged at "
        "weight 0), "
        "`math` (final answer verified: boxed / 'answer:' / last number, fractions, sympy), "
        "`judge` "
        "(an LLM judge's score, [trl.judge]), `code` (fraction of test asserts passed in a "
        "sandbox, [trl.sandbox])",
    )
    judge: TrlJudge = TrlJudge()
    sandbox: TrlSandbox = TrlSandbox()
    # catalogue trainers
    lora: TrlLora = TrlLora()
    teacher: str | None = Field(
        None,
        description="GKD teacher: a run directory (its newest verified checkpoint) or a "
        "checkpoint folder; "
        "unset: a locally built tiny model (seed + 1) of the student's dimensions",
    )
    teacher_model: TrlModel | None = Field(
        None,
        description="GKD teacher's architecture: the tiny teacher's dimensions when trl.teacher "
        "is unset; "
        "--dry-run's shape and memory checks for a production teacher (default: the student's)",
    )
    lmbda: float = Field(
        0.5, ge=0, le=1, description="GKD: share of on-policy (student-generated) batches"
    )
    jsd_beta: float = Field(
        0.5, ge=0, le=1, description="GKD: generalised JSD interpolation (0: forward KL)"
    )
    vllm: TrlVllm | None = None
    bf16: bool = Field(False, description="bf16 mixed precision (GPU only; ignored on CPU)")
    activation_checkpointing: bool = False
    fsdp: bool = Field(
        False,
        description="shard the model, gradients and optimizer over the ranks (transformers' "
        "FSDP full_shard, one unit per decoder layer); GPU only, ignored on CPU",
    )
    target: TrlTarget | None = None
    verifier: bool = Field(
        False,
        description="also log the held-out graded-correctness `verifier` reward (weight 0) as "
        'rewards/verifier/mean (always on with reward = "length")',
    )

    @model_validator(mode="after")
    def _engine_head_size(self) -> "TrlSection":
        """vLLM's CPU attention needs heads of >= 32 dimensions: a tiny model that did not choose
        its head count gets fewer, wider heads when an engine serves it (check_recipe refuses a
        chosen one that is too narrow)."""
        m = self.model
        if self.vllm is not None and m.pretrained is None and "num_heads" not in m.model_fields_set:
            if m.hidden_size // m.num_heads < ENGINE_MIN_HEAD:
                m.num_heads = max(1, m.hidden_size // ENGINE_MIN_HEAD)
        return self


def generation_batch(section: TrlSection, nproc: int) -> int:
    """Prompts x completions generated per optimizer step across all ranks (GRPO, RLOO)."""
    return section.per_device_batch_size * nproc * section.grad_accum


def check_recipe(recipe) -> tuple[str, str] | None:
    """The GRPO batch rule, in one place: caught at load instead of as a traceback in every rank."""
    sec = recipe.trl
    if sec is None:
        return None
    m = sec.model
    if (
        sec.vllm is not None
        and m.pretrained is None
        and m.hidden_size // m.num_heads < ENGINE_MIN_HEAD
    ):
        return (
            "trl.model.num_heads",
            f"vLLM's CPU attention needs heads of >= {ENGINE_MIN_HEAD} dimensions: hidden_size "
            f"{m.hidden_size} / num_heads {m.num_heads} = {m.hidden_size // m.num_heads} "
            f"(at most {max(1, m.hidden_size // ENGINE_MIN_HEAD)} heads)",
        )
    if sec.vllm is not None and sec.trainer not in ("grpo", "rloo"):
        return (
            "trl.vllm",
            f'vLLM rollouts are for trainer = "grpo" or "rloo" (got {sec.trainer!r})',
        )
    if (
        sec.vllm is not None
        and sec.vllm.mode == "server"
        and sec.vllm.server_gpus
        and sec.vllm.tensor_parallel_size != len(sec.vllm.server_gpus)
    ):
        return (
            "trl.vllm.server_gpus",
            f"one GPU per tensor-parallel rank: tensor_parallel_size = "
            f"{sec.vllm.tensor_parallel_size} (got {len(sec.vllm.server_gpus)} GPUs)",
        )
    if sec.vllm is not None and sec.vllm.mode == "server":
        clash = sorted(g for g in sec.vllm.server_gpus if g < recipe.launch.nproc)
        if clash:
            return (
                "trl.vllm.server_gpus",
                f"the training ranks use CUDA devices 0..{recipe.launch.nproc - 1} "
                f"(launch.nproc); the server's must come after them (got {clash})",
            )
    if (
        sec.trainer == "gkd"
        and sec.teacher_model is not None
        and sec.teacher_model.vocab_size != sec.model.vocab_size
    ):
        return (
            "trl.teacher_model.vocab_size",
            f"teacher and student share a tokenizer: {sec.model.vocab_size} "
            f"(trl.model.vocab_size), got {sec.teacher_model.vocab_size}",
        )
    if sec.trainer not in ("grpo", "rloo"):
        return None
    batch = generation_batch(sec, recipe.launch.nproc)
    if batch % sec.num_generations:
        return (
            "trl.num_generations",
            "must divide per_device_batch_size x launch.nproc x grad_accum = "
            f"{sec.per_device_batch_size} x "
            f"{recipe.launch.nproc} x {sec.grad_accum} = {batch} (got {sec.num_generations})",
        )
    return None
