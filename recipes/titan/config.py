"""The ``[titan]`` recipe section. No torch import here: the CLI validates recipes fast.

Every key maps onto one TorchTitan 0.3.0 config field (``registry.trainer_config`` does the
mapping); nothing here re-implements a TorchTitan feature. The cross-key rules a rank would
otherwise hit as a traceback (degrees that do not divide the world, float8 with compile in
emulation, CP with an odd sequence split) are in :func:`check`, one clear line each.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# TorchTitan model families and the flavors of its own registries that ptops recipes may name.
FLAVORS: dict[str, tuple[str, ...]] = {
    "llama3": ("debugmodel", "1B", "3B", "8B", "70B", "405B"),
    "qwen3": (
        "debugmodel",
        "0.6B",
        "1.7B",
        "4B",
        "8B",
        "14B",
        "32B",
        "debugmodel_moe",
        "30B-A3B",
        "235B-A22B",
    ),
}
MOE_FLAVORS = {("qwen3", "debugmodel_moe"), ("qwen3", "30B-A3B"), ("qwen3", "235B-A22B")}
GPUS = ("h100", "h200", "a100", "b200")


class TitanModel(_Strict):
    family: Literal["llama3", "qwen3"] = Field(
        "llama3", description="TorchTitan model family (torchtitan.models.<family>)"
    )
    flavor: str = Field(
        "",
        description="a flavor of TorchTitan's own registry (llama3: 8B, 70B, ...; qwen3: "
        "30B-A3B, ...); "
        "empty = the small llama3 built from dim/n_layers/n_heads below",
    )
    dim: int = Field(64, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=64, description="size of the locally built tokenizer")


class TitanParallelism(_Strict):
    dp_shard: int = Field(-1, description="FSDP2 shard degree; -1 = the ranks left over")
    dp_replicate: int = Field(1, ge=1, description="DDP replicas (HSDP when dp_shard > 1)")
    tp: int = Field(1, ge=1, description="tensor parallel degree")
    pp: int = Field(1, ge=1, description="pipeline parallel degree")
    pp_schedule: str = Field("1F1B", description="pipeline schedule name")
    pp_microbatch_size: int = Field(
        1, ge=1, description="parallelism.pipeline_parallel_microbatch_size"
    )
    cp: int = Field(
        1, ge=1, description="context parallel degree (parallelism.context_parallel_degree)"
    )
    cp_load_balancer: Literal["headtail", "ptrr", "none"] = Field(
        "headtail",
        description="CP sequence load balancer (parallelism.context_parallel_load_balancer)",
    )
    cp_rotate_method: Literal["allgather", "alltoall"] = Field(
        "allgather",
        description="how CP SDPA rotates K/V shards: TorchTitan 0.3.0 has no key for it, so the "
        "rank calls torch's own "
        "torch.distributed.tensor.experimental._attention.set_rotate_method (FlexAttention "
        "supports only allgather)",
    )
    ep: int = Field(
        1,
        ge=1,
        description="expert parallel degree (MoE flavors only); borrows ranks from dp_shard*cp*tp",
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = Field("default")


class TitanFloat8(_Strict):
    """Float8 linear training through
    ``torchtitan.components.quantization.Float8LinearConverter``."""

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "rowwise",
        description="torchao float8 scaling recipe (Float8LinearConverter recipe_name, passed to "
        "torchao's "
        "Float8LinearConfig.from_recipe_name; TorchTitan 0.3.0's type hint lists only the "
        "rowwise two, torchao "
        "also takes tensorwise). With emulate=true TorchTitan 0.3.0 ignores it (emulation is "
        "tensorwise)",
    )
    filter_fqns: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="module FQNs left in bf16 (substring match); Linears whose dims are not "
        "multiples of 16 are always left",
    )
    emulate: bool = Field(
        False, description="emulated float8 (CPU tests; torchao's tensorwise emulation, no compile)"
    )
    moe_experts: bool = Field(
        False,
        description="float8 grouped GEMMs for MoE experts (Float8GroupedExpertsConverter; SM89+)",
    )


class TitanActivationCheckpoint(_Strict):
    mode: Literal["none", "selective", "full"] = Field(
        "none",
        description="activation checkpointing: none, selective (TorchTitan SelectiveAC) or full "
        "(FullAC)",
    )


class TitanCompile(_Strict):
    enable: bool = Field(False, description="torch.compile (compile.enable)")
    components: list[Literal["model", "loss"]] = Field(default_factory=lambda: ["model", "loss"])


class TitanTarget(_Strict):
    """The hardware a recipe is written for: what ``--dry-run`` and ``ptops plan`` check by
    default."""

    gpu: Literal["h100", "h200", "a100", "b200"] = "h100"
    nodes: int = Field(1, ge=1, description="nodes; the world is nodes x launch.nproc")


class TitanSection(_Strict):
    model: TitanModel = TitanModel()
    parallelism: TitanParallelism = TitanParallelism()
    float8: TitanFloat8 = TitanFloat8()
    activation_checkpoint: TitanActivationCheckpoint = TitanActivationCheckpoint()
    compile: TitanCompile = TitanCompile()
    target: TitanTarget | None = Field(
        None, description="declared production hardware (recipes that never run on CPU)"
    )
    seq_len: int = Field(128, ge=8)
    local_batch_size: int = Field(4, ge=1)
    global_batch_size: int = Field(
        -1, description="-1: local_batch_size x data-parallel degree (no accumulation)"
    )
    lr: float = Field(8e-4, gt=0)
    warmup_steps: int = Field(2, ge=0)
    max_norm: float = Field(1.0, gt=0)
    mixed_precision_param: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP2 parameter dtype for compute (bf16 on GPUs; fp32 on CPU)"
    )
    deterministic: bool = Field(
        True, description="torch.use_deterministic_algorithms in every rank"
    )
    async_checkpoint: bool = Field(
        True,
        description="DCP async save for interval checkpoints: training blocks only while the "
        "state is staged",
    )
    pinned_memory_checkpoint: bool = Field(
        False,
        description="async_with_pinned_mem: stage to pinned host memory (GPU only; torchtitan "
        "asserts an accelerator)",
    )
    train_timeout_s: int = Field(
        100, ge=1, description="collective timeout after the first step (hang -> error)"
    )
    hf_assets_path: str = Field(
        "", description="tokenizer folder (HF assets); empty = the locally built tokenizer"
    )
    initial_load_path: str = Field(
        "",
        description="continued pre-training: weights loaded when the run has no checkpoint yet "
        "(checkpoint.initial_load_path)",
    )
    initial_load_in_hf: bool = Field(
        False, description="initial_load_path holds Hugging Face safetensors"
    )
    dataset: str = Field(
        "", description="a TorchTitan dataset name (e.g. c4); empty = the local text corpus"
    )


def is_moe(model: TitanModel) -> bool:
    return (model.family, model.flavor) in MOE_FLAVORS


def world_of(recipe: Any, nodes: int | None = None, gpus_per_node: int | None = None) -> int:
    t = recipe.titan
    n = nodes if nodes is not None else (t.target.nodes if t.target else 1)
    g = gpus_per_node if gpus_per_node is not None else recipe.launch.nproc
    return n * g


def degrees(recipe: Any, world: int) -> tuple[dict[str, int], str | None]:
    """TorchTitan's ParallelDims rules, checked before any rank starts: (degrees, problem or
    None)."""
    p = recipe.titan.parallelism
    other = p.dp_replicate * p.tp * p.pp * p.cp
    shard = p.dp_shard
    if shard == -1:
        if world % other:
            return {}, (
                f"dp_replicate x tp x pp x cp = {p.dp_replicate}x{p.tp}x{p.pp}x{p.cp} = {other} "
                f"does not divide the world of {world} ranks"
            )
        shard = world // other
    elif shard < 1:
        return {}, f"dp_shard must be -1 or >= 1 (got {shard})"
    d = {
        "dp_replicate": p.dp_replicate,
        "dp_shard": shard,
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
        "ep": p.ep,
    }
    if shard * other != world:
        return d, (
            "dp_replicate x dp_shard x tp x pp x cp = "
            f"{p.dp_replicate}x{shard}x{p.tp}x{p.pp}x{p.cp} = "
            f"{shard * other}, expected the world of {world} ranks"
        )
    if p.ep > 1:
        dense = shard * p.cp * p.tp
        if dense % p.ep:
            return (
                d,
                f"ep={p.ep} must divide dp_shard x cp x tp = {dense} (EP borrows ranks from FSDP "
                "and TP)",
            )
    return d, None


def check(recipe: Any) -> tuple[str, str] | None:
    """Cross-key rules of ``[titan]`` (one clear line each, via recipes/schema.py)."""
    t = recipe.titan
    m, p = t.model, t.parallelism
    if m.flavor and m.flavor not in FLAVORS[m.family]:
        return (
            "titan.model.flavor",
            f"a {m.family} flavor of TorchTitan 0.3.0 ({', '.join(FLAVORS[m.family])}), got "
            f"{m.flavor!r}",
        )
    if not m.flavor and m.family != "llama3":
        return (
            "titan.model.flavor",
            f"a flavor is required for family {m.family!r} (only llama3 builds from dim/n_layers)",
        )
    world = world_of(recipe)
    _, problem = degrees(recipe, world)
    if problem is not None:
        return "titan.parallelism", problem + (
            f" (launch.nproc={recipe.launch.nproc} x titan.target.nodes={t.target.nodes})"
            if t.target
            else f" (launch.nproc={recipe.launch.nproc})"
        )
    if p.cp > 1 and p.cp_rotate_method == "alltoall" and m.flavor:
        return "titan.parallelism.cp_rotate_method", (
            '"allgather": TorchTitan\'s flavors use FlexAttention, whose CP supports only allgather'
        )
    if p.ep > 1 and not is_moe(m):
        return (
            "titan.parallelism.ep",
            "expert parallel needs an MoE flavor "
            f"({', '.join(f for _, f in sorted(MOE_FLAVORS))}); {m.family} {m.flavor or 'small'} "
            "has no experts",
        )
    if (
        t.float8.enabled
        and t.float8.emulate
        and t.compile.enable
        and "model" in t.compile.components
    ):
        return (
            "titan.float8.emulate",
            "emulated float8 cannot be compiled (TorchTitan refuses it): set "
            "titan.compile.enable=false",
        )
    if "auto_filter_small_kn" in t.float8.filter_fqns:
        return "titan.float8.filter_fqns", (
            "no 'auto_filter_small_kn': with TorchTitan 0.3.0's config-based converter torchao's "
            "auto filter "
            "swaps no Linear at all (it checks for nn.Linear modules); list the FQNs to keep in "
            "bf16 instead"
        )
    ilp = t.initial_load_path
    if ilp and recipe.train.init_from:
        return (
            "train.init_from",
            "not together with titan.initial_load_path (both name the initial weights)",
        )
    if ilp and not (ilp.startswith("/") or "://" in ilp):
        return (
            "titan.initial_load_path",
            f"an absolute path or a remote URI (TorchTitan refuses relative ones), got {ilp!r}",
        )
    if t.float8.moe_experts and not is_moe(m):
        return "titan.float8.moe_experts", "only for MoE flavors"
    if not m.flavor and m.dim % m.n_heads:
        return "titan.model.dim", f"divisible by n_heads={m.n_heads} (got {m.dim})"
    div = (p.tp) * (2 * p.cp if p.cp > 1 else 1)
    if t.seq_len % div:
        return (
            "titan.seq_len",
            f"divisible by tp x 2cp = {div} (sequence and context parallel split it), got "
            f"{t.seq_len}",
        )
    if p.pp > 1 and t.local_batch_size % p.pp_microbatch_size:
        return (
            "titan.local_batch_size",
            f"divisible by parallelism.pp_microbatch_size={p.pp_microbatch_size}",
        )
    return None
