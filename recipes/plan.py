"""The planner: what a titan recipe costs on N GPUs, before any GPU is spent. Pure (no torch, no
ptops).

``plan(recipe, gpu, gpus, nodes)`` reads a validated recipe (duck-typed: ``recipe.titan``,
``recipe.checkpoint``, ``recipe.train``) and returns a JSON-ready dict: the exact parameter count
(the same as TorchTitan's model built on the meta device: tests/engines/test_plan.py), per-GPU
memory, communication per step per parallel dimension, step time and MFU, checkpoint size and write
time, and the checkpoint interval from Young/Daly. Every hardware figure is in :data:`GPUS` with its
source; every modelling assumption is in :data:`ASSUMPTIONS` and printed with the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GiB = 1024**3


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # HBM usable by the process
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = no float8 tensor cores
    nvlink_gbs: float  # per-GPU unidirectional NVLink bandwidth, GB/s
    ib_gbs: float  # per-GPU scale-out NIC bandwidth, GB/s
    h2d_gbs: float  # host<->device PCIe bandwidth (pinned), GB/s
    hbm_tbs: float = 0.0  # HBM bandwidth, TB/s (decode is bound by it: recipes/plan_rl.py)


# Sources (datasheets): NVIDIA H100 SXM5 / H200 SXM / A100 SXM4 80GB / DGX B200 product pages.
# H100 SXM: 80 GB HBM3, 989 TFLOPS bf16 dense (1979 with sparsity), 1979 fp8 dense, NVLink4 900 GB/s
#   bidirectional (450 one way), ConnectX-7 400 Gb/s NDR per GPU (50 GB/s), PCIe Gen5 x16
#   (64 GB/s; ~50 achieved).
# H200 SXM: 141 GB HBM3e, same compute and NVLink as H100 SXM.
# A100 SXM4 80GB: 312 TFLOPS bf16 dense, no fp8, NVLink3 600 GB/s bidirectional (300 one way),
#   HDR 200 Gb/s per GPU (25 GB/s), PCIe Gen4 x16 (32 GB/s; ~25 achieved).
# B200 (DGX B200, per GPU): 180 GB HBM3e, 2.25 PFLOPS bf16 dense, 4.5 fp8 dense, NVLink5 1.8 TB/s
#   bidirectional (900 one way), ConnectX-7 400 Gb/s per GPU (50 GB/s), PCIe Gen5 (~50 achieved).
# HBM bandwidth (same datasheets): H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB 2.039 TB/s, B200 8
# TB/s.
GPUS: dict[str, Gpu] = {
    "h100": Gpu("h100", 79.6, 989.0, 1979.0, 450.0, 50.0, 50.0, hbm_tbs=3.35),
    "h200": Gpu("h200", 139.8, 989.0, 1979.0, 450.0, 50.0, 50.0, hbm_tbs=4.8),
    "a100": Gpu("a100", 79.2, 312.0, 0.0, 300.0, 25.0, 25.0, hbm_tbs=2.039),
    "b200": Gpu("b200", 178.4, 2250.0, 4500.0, 900.0, 50.0, 50.0, hbm_tbs=8.0),
}

# Llama 3 paper (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days of
# pre-training on 16,384 H100s -> 54*24/419 = 3.09 h between failures at that scale, i.e. a
# per-GPU MTBF of 3.09 h x 16384 ~ 50,700 GPU-hours. A job of N GPUs fails every 50,700/N hours.
LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 / 419 * 16384

ASSUMPTIONS = {
    "matmul_efficiency": 0.55,  # share of dense peak that large bf16/fp8 GEMMs reach in training
    # grouped expert GEMMs are small and ragged: a lower share (MoE models)
    "moe_matmul_efficiency": 0.35,
    # share of link bandwidth that NCCL ring collectives reach (bus bandwidth)
    "link_efficiency": 0.8,
    # CUDA context, NCCL buffers, allocator slack (measured ~3-5 GiB on H100)
    "fixed_overhead_gib": 4.0,
    "fragmentation": 0.05,  # caching allocator fragmentation on top of live tensors
    "storage_gbs_per_node": 5.0,  # checkpoint write bandwidth per node to shared storage, GB/s
    "selective_ac_keep": 0.5,  # torchtitan's op-level SAC keeps about half of a layer's activations
    "selective_ac_recompute": 0.1,  # ... and recomputes about a tenth of the forward
    # FSDP all-gather/reduce-scatter overlap with compute (prefetch); exposed = excess
    "fsdp_overlap": 1.0,
}


@dataclass(frozen=True)
class Shape:
    family: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int  # dense SwiGLU hidden size (0 for MoE layers)
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    qk_norm: bool = False


def ffn_hidden(dim: int, multiple_of: int, multiplier: float | None = None) -> int:
    """TorchTitan's compute_ffn_hidden_dim (SwiGLU 2/3 rule, multiplier, round up)."""
    h = int(2 * 4 * dim / 3)
    if multiplier is not None:
        h = int(multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


# The flavors of TorchTitan 0.3.0's registries (torchtitan/models/<family>/__init__.py), as shapes.
FLAVOR_SHAPES: dict[tuple[str, str], Shape] = {
    ("llama3", "8B"): Shape("llama3", 4096, 32, 32, 8, 128, ffn_hidden(4096, 1024, 1.3), 128256),
    ("llama3", "70B"): Shape("llama3", 8192, 80, 64, 8, 128, ffn_hidden(8192, 4096, 1.3), 128256),
    ("llama3", "405B"): Shape(
        "llama3", 16384, 126, 128, 8, 128, ffn_hidden(16384, 4096, 1.2), 128256
    ),
    ("qwen3", "30B-A3B"): Shape("qwen3", 2048, 48, 32, 4, 128, 0, 151936, 128, 8, 768, True),
    ("qwen3", "235B-A22B"): Shape("qwen3", 4096, 94, 64, 4, 128, 0, 151936, 128, 8, 1536, True),
}


class PlanError(ValueError):
    """A recipe the planner cannot size (unknown flavor, bad degrees): one line."""


def shape_of(titan: Any) -> Shape:
    m = titan.model
    if not m.flavor:
        return Shape(
            "llama3",
            m.dim,
            m.n_layers,
            m.n_heads,
            m.n_heads,
            m.dim // m.n_heads,
            ffn_hidden(m.dim, 64),
            m.vocab_size,
        )
    s = FLAVOR_SHAPES.get((m.family, m.flavor))
    if s is None:
        known = ", ".join(f"{f}/{v}" for f, v in FLAVOR_SHAPES)
        raise PlanError(f"the planner has no shape for {m.family} {m.flavor} (known: {known})")
    return s


def param_counts(s: Shape) -> dict[str, int]:
    """Exact parameter counts: embedding, output, per-layer dense and expert parts."""
    d, hd = s.dim, s.head_dim
    attn = (
        d * (s.n_heads + 2 * s.n_kv_heads) * hd + s.n_heads * hd * d + (2 * hd if s.qk_norm else 0)
    )
    norms = 2 * d
    if s.experts:
        router = d * s.experts
        experts = 3 * s.experts * d * s.moe_ffn
        dense_layer = attn + norms + router
    else:
        experts = 0
        dense_layer = attn + norms + 3 * d * s.ffn
    embedding = s.vocab * d
    output = d * s.vocab + d  # lm_head + final norm
    total = embedding + output + s.n_layers * (dense_layer + experts)
    active = (
        total
        - s.n_layers * experts
        + (s.n_layers * experts * s.top_k // s.experts if s.experts else 0)
    )
    return {
        "total": total,
        "embedding": embedding,
        "output": output,
        "per_layer_dense": dense_layer,
        "per_layer_experts": experts,
        "active": active,
    }


def flops_per_token(s: Shape, seq_len: int) -> int:
    """TorchTitan's own count (get_nparams_and_flops): 6 x (active non-embedding params) + 12 L H hd
    T."""
    p = param_counts(s)
    return 6 * (p["active"] - p["embedding"]) + 12 * s.n_layers * s.n_heads * s.head_dim * seq_len


def _act_bytes_per_token_layer(s: Shape) -> int:
    """bf16 activations one transformer block saves for backward, per token (no AC).

    Counted tensor by tensor (flash/SDPA attention: no s^2 term): two norm inputs and the two
    residual inputs (4 d), q/k/v (H + 2 KV) hd, attention output and wo input (2 H hd), the FFN
    input (d) and its four hidden tensors w1 out, w3 out, silu, product (4 F; top_k x moe_ffn for
    MoE).
    """
    ffn = s.top_k * s.moe_ffn if s.experts else s.ffn
    return 2 * (
        5 * s.dim
        + (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
        + 2 * s.n_heads * s.head_dim
        + 4 * ffn
    )


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def plan(
    recipe: Any, gpu: str, gpus: int, nodes: int | None = None, mtbf_hours: float | None = None
) -> dict:
    """The plan of a titan recipe on ``gpus`` GPUs of kind ``gpu`` spread over ``nodes`` nodes."""
    if gpu not in GPUS:
        raise PlanError(f"--gpu: one of {', '.join(GPUS)} (got {gpu!r})")
    g = GPUS[gpu]
    nodes = nodes or max(1, math.ceil(gpus / 8))
    if gpus % nodes:
        raise PlanError(
            f"--gpus {gpus} cannot be spread evenly over {nodes} nodes (--nodes; default: 8 GPUs "
            "a node)"
        )
    per_node = gpus // nodes
    t = recipe.titan
    s = shape_of(t)
    par = t.parallelism
    other = par.dp_replicate * par.tp * par.pp * par.cp
    shard = par.dp_shard if par.dp_shard != -1 else (gpus // other if gpus % other == 0 else 0)
    if shard < 1 or shard * other != gpus:
        raise PlanError(
            "titan.parallelism: dp_replicate x dp_shard x tp x pp x cp = "
            f"{par.dp_replicate}x{par.dp_shard}x"
            f"{par.tp}x{par.pp}x{par.cp} does not make {gpus} GPUs"
        )
    tp, pp, cp, ep, rep = par.tp, par.pp, par.cp, par.ep, par.dp_replicate
    counts = param_counts(s)
    n = counts["total"]

    # ---- memory per GPU --------------------------------------------------------------------
    # FSDP2 keeps fp32 sharded parameters, fp32 sharded gradients, and AdamW's two fp32 moments:
    # all sharded over dp_shard x cp (the FSDP mesh) x tp, and pipeline stages split the layers.
    model_shards = shard * cp * tp * pp
    params_b = 4 * n / model_shards
    grads_b = 4 * n / model_shards
    optim_b = 8 * n / model_shards
    # the unsharded bf16 copy of the layer being computed plus the prefetched next one
    layer_b = 2 * (counts["per_layer_dense"] / tp + counts["per_layer_experts"] / max(ep, 1) / tp)
    gather_b = 2 * layer_b
    layers_per_stage = math.ceil(s.n_layers / pp)
    tokens_mb = (par.pp_microbatch_size if pp > 1 else t.local_batch_size) * t.seq_len / cp
    per_layer_tok = _act_bytes_per_token_layer(s) / tp
    mode = t.activation_checkpoint.mode
    if mode == "full":
        kept = 2 * s.dim / tp  # each block's input only ...
        act_layer = tokens_mb * kept
        act_extra = (
            tokens_mb * per_layer_tok
        )  # ... plus one block's activations while it is recomputed
    elif mode == "selective":
        act_layer = tokens_mb * per_layer_tok * ASSUMPTIONS["selective_ac_keep"]
        act_extra = tokens_mb * per_layer_tok * (1 - ASSUMPTIONS["selective_ac_keep"])
    else:
        act_layer = tokens_mb * per_layer_tok
        act_extra = 0.0
    # 1F1B keeps up to pp microbatches of its stage's layers in flight on the first stage
    in_flight = min(pp, t.local_batch_size // par.pp_microbatch_size) if pp > 1 else 1
    activations_b = act_layer * layers_per_stage * in_flight + act_extra
    logits_b = tokens_mb * s.vocab * (2 + 4) / tp  # bf16 logits + fp32 upcast in the loss
    live = params_b + grads_b + optim_b + gather_b + activations_b + logits_b
    total_b = live * (1 + ASSUMPTIONS["fragmentation"]) + ASSUMPTIONS["fixed_overhead_gib"] * GiB
    memory = {
        "params_gib": params_b / GiB,
        "grads_gib": grads_b / GiB,
        "optimizer_gib": optim_b / GiB,
        "fsdp_gather_gib": gather_b / GiB,
        "activations_gib": activations_b / GiB,
        "logits_gib": logits_b / GiB,
        "overhead_gib": (total_b - live) / GiB,
        "total_gib": total_b / GiB,
        "gpu_gib": g.memory_gib,
        "fits": total_b <= g.memory_gib * GiB,
        "activation_checkpoint": mode,
    }

    # ---- compute -----------------------------------------------------------------------------
    dp = rep * shard
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
    if global_batch % (t.local_batch_size * dp):
        raise PlanError(
            f"key 'titan.global_batch_size': {global_batch} is not a multiple of "
            "local_batch_size x data-parallel "
            f"degree = {t.local_batch_size} x {dp} on {gpus} GPUs (TorchTitan asserts it)"
        )
    warnings = []
    if t.float8.enabled and not t.float8.emulate and not g.fp8_tflops:
        warnings.append(
            f"float8 needs SM89+ (H100 and newer): on {gpu} set titan.float8.enabled=false"
        )
    tokens_step = global_batch * t.seq_len
    fpt = flops_per_token(s, t.seq_len)
    model_flops = fpt * tokens_step
    recompute = {"full": 1 / 3, "selective": ASSUMPTIONS["selective_ac_recompute"], "none": 0.0}[
        mode
    ]
    hw_flops_gpu = model_flops * (1 + recompute) / gpus
    peak = g.bf16_tflops * 1e12
    if t.float8.enabled and g.fp8_tflops and not t.float8.emulate:
        # the linear layers (6N of 6N + attention) run at fp8 speed; attention stays bf16
        lin_share = 6 * (counts["active"] - counts["embedding"]) / fpt
        eff_peak = 1 / (lin_share / (g.fp8_tflops * 1e12) + (1 - lin_share) / peak)
    else:
        eff_peak = peak
    mm_eff = ASSUMPTIONS["moe_matmul_efficiency" if s.experts else "matmul_efficiency"]
    compute_s = hw_flops_gpu / (eff_peak * mm_eff)
    microbatches = t.local_batch_size // par.pp_microbatch_size if pp > 1 else 1
    bubble = (pp - 1) / (microbatches + pp - 1) if pp > 1 else 0.0
    compute_s = compute_s / (1 - bubble)

    # ---- communication per step, per GPU -------------------------------------------------------
    def link(span: int) -> tuple[str, float]:
        """A group whose ranks lie within one node uses NVLink, else the NICs."""
        return ("nvlink", g.nvlink_gbs) if span <= per_node else ("ib", g.ib_gbs)

    eff = ASSUMPTIONS["link_efficiency"]
    accum = (
        global_batch // (t.local_batch_size * dp) if global_batch >= t.local_batch_size * dp else 1
    )
    experts_total = counts["per_layer_experts"] * s.n_layers
    stage_params = (n - experts_total) / (tp * pp)  # dense parameters a GPU gathers
    comm: dict[str, dict] = {}
    fsdp_n = shard * cp
    if fsdp_n > 1:
        # all-gather in bf16 for forward and again for backward (reshard after forward) per
        # micro-step, reduce-scatter of fp32 gradients once per step
        vol = (2 * 2 * stage_params * accum + 4 * stage_params) * _ring(fsdp_n)
        kind, bw = link(tp * cp * shard)
        comm["fsdp"] = {
            "group": fsdp_n,
            "bytes": vol,
            "link": kind,
            "seconds": vol / (bw * 1e9 * eff),
        }
    efsdp = shard * cp * tp // ep if s.experts else 0
    if experts_total and efsdp > 1:
        # experts are sharded ep ways, then FSDP'd over the efsdp = dp_shard*cp*tp/ep ranks left
        ex = experts_total / ep / pp
        vol = (2 * 2 * ex * accum + 4 * ex) * _ring(efsdp)
        kind, bw = link(ep * efsdp)
        comm["fsdp_experts"] = {
            "group": efsdp,
            "bytes": vol,
            "link": kind,
            "seconds": vol / (bw * 1e9 * eff),
        }
    if rep > 1:
        vol = 2 * 4 * stage_params / fsdp_n * _ring(rep)
        kind, bw = link(tp * cp * shard * rep)
        comm["dp_replicate"] = {
            "group": rep,
            "bytes": vol,
            "link": kind,
            "seconds": vol / (bw * 1e9 * eff),
        }
    local_tokens = t.local_batch_size * t.seq_len / cp * accum
    if tp > 1:
        per_layer = (8 + (4 if mode == "full" else 0)) * local_tokens * s.dim * 2 * _ring(tp)
        vol = per_layer * layers_per_stage
        kind, bw = link(tp)
        comm["tp"] = {"group": tp, "bytes": vol, "link": kind, "seconds": vol / (bw * 1e9 * eff)}
    if cp > 1:
        kv = local_tokens * 2 * s.n_kv_heads * s.head_dim * 2 / tp
        vol = (
            3 * kv * (cp - 1) * layers_per_stage
        )  # K,V around the ring in forward, twice in backward
        kind, bw = link(tp * cp)
        comm["cp"] = {"group": cp, "bytes": vol, "link": kind, "seconds": vol / (bw * 1e9 * eff)}
    if ep > 1 and s.experts:
        vol = 4 * local_tokens * s.top_k * s.dim * 2 * _ring(ep) * layers_per_stage / tp
        kind, bw = link(ep)
        comm["ep"] = {"group": ep, "bytes": vol, "link": kind, "seconds": vol / (bw * 1e9 * eff)}
    if pp > 1:
        vol = 2 * t.local_batch_size * t.seq_len / cp * s.dim * 2 / tp * accum
        kind, bw = link(tp * cp * shard * rep * pp)
        comm["pp"] = {"group": pp, "bytes": vol, "link": kind, "seconds": vol / (bw * 1e9 * eff)}
    exposed = sum(
        c["seconds"] for k, c in comm.items() if k in ("tp", "cp", "ep", "pp", "dp_replicate")
    )
    fsdp_s = comm.get("fsdp", {}).get("seconds", 0.0) + comm.get("fsdp_experts", {}).get(
        "seconds", 0.0
    )
    fsdp_exposed = max(0.0, fsdp_s - compute_s * ASSUMPTIONS["fsdp_overlap"])
    step_s = compute_s + exposed + fsdp_exposed
    mfu = model_flops / (step_s * gpus * peak)

    # ---- checkpoints and their interval ------------------------------------------------------
    ckpt_b = 12 * n  # fp32 params + AdamW moments (DCP, sharded over every rank)
    write_s = ckpt_b / (ASSUMPTIONS["storage_gbs_per_node"] * 1e9 * nodes)
    staging_s = (
        12 * n / model_shards / (g.h2d_gbs * 1e9)
    )  # async: training blocks while the shard is copied
    blocking_s = staging_s if t.async_checkpoint else write_s
    hours = mtbf_hours if mtbf_hours is not None else LLAMA3_GPU_HOURS_PER_FAILURE / gpus
    mtbf_s = hours * 3600
    delta = blocking_s
    if (
        delta < 2 * mtbf_s
    ):  # Daly 2006, higher-order estimate of the optimum compute time between checkpoints
        tau = (
            math.sqrt(2 * delta * mtbf_s)
            * (1 + math.sqrt(delta / (2 * mtbf_s)) / 3 + delta / (18 * mtbf_s))
            - delta
        )
    else:
        tau = mtbf_s
    young = math.sqrt(2 * delta * mtbf_s)
    interval_steps = max(1, round(tau / step_s))
    return {
        "recipe": getattr(recipe, "name", ""),
        "model": {
            "family": s.family,
            "flavor": t.model.flavor or f"d{s.dim}-l{s.n_layers}",
            "params": n,
            "active_params": counts["active"],
            "flops_per_token": fpt,
        },
        "hardware": {"gpu": gpu, "gpus": gpus, "nodes": nodes, "gpus_per_node": per_node},
        "degrees": {"dp_replicate": rep, "dp_shard": shard, "tp": tp, "pp": pp, "cp": cp, "ep": ep},
        "batch": {
            "global_batch": global_batch,
            "seq_len": t.seq_len,
            "tokens_per_step": tokens_step,
            "grad_accumulation": accum,
        },
        "memory": memory,
        "comm": comm,
        "step": {
            "compute_s": compute_s,
            "exposed_comm_s": exposed + fsdp_exposed,
            "pp_bubble": bubble,
            "step_s": step_s,
            "mfu": mfu,
            "tokens_per_s_per_gpu": tokens_step / step_s / gpus,
            "float8": bool(t.float8.enabled and g.fp8_tflops and not t.float8.emulate),
        },
        "checkpoint": {
            "size_gb": ckpt_b / 1e9,
            "write_s": write_s,
            "async_staging_s": staging_s,
            "blocking_s": blocking_s,
            "mtbf_hours": hours,
            "mtbf_source": "--mtbf-hours"
            if mtbf_hours is not None
            else "Llama 3 paper: 419 interruptions / 54 days / 16,384 GPUs",
            "young_interval_s": young,
            "daly_interval_s": tau,
            "interval_steps": interval_steps,
            "recipe_interval_steps": recipe.checkpoint.interval,
        },
        "warnings": warnings,
        "rollout": "none: a pre-training recipe (GRPO recipes: `ptops plan <trl grpo recipe>` "
        "gives rollout capacity)",
        "assumptions": dict(ASSUMPTIONS),
    }


def fit_problem(p: dict) -> str | None:
    """One line when a plan does not fit its GPU."""
    m = p["memory"]
    if m["fits"]:
        return None
    return (
        f"needs {m['total_gib']:.1f} GiB per GPU, a {p['hardware']['gpu']} has {m['gpu_gib']:.1f} "
        f"(params {m['params_gib']:.1f} + grads {m['grads_gib']:.1f} + optimizer "
        f"{m['optimizer_gib']:.1f} + "
        f"activations {m['activations_gib']:.1f} + logits {m['logits_gib']:.1f}, "
        f"AC={m['activation_checkpoint']}): "
        "raise dp_shard/tp/pp, turn on activation checkpointing, or lower local_batch_size/seq_len"
    )


def render(p: dict) -> str:
    """The plan as text for a terminal."""
    m, st, ck, hw, mo = p["memory"], p["step"], p["checkpoint"], p["hardware"], p["model"]
    d = p["degrees"]
    lines = [
        f"{p['recipe']}: {mo['family']} {mo['flavor']}  {mo['params']:,} parameters"
        + (f" ({mo['active_params']:,} active)" if mo["active_params"] != mo["params"] else ""),
        f"  hardware    {hw['gpus']} x {hw['gpu']} ({hw['nodes']} nodes x {hw['gpus_per_node']})",
        "  degrees     " + " ".join(f"{k}={v}" for k, v in d.items()),
        f"  batch       {p['batch']['global_batch']} x {p['batch']['seq_len']} = "
        f"{p['batch']['tokens_per_step']:,} tokens/step"
        f" (accumulation {p['batch']['grad_accumulation']})",
        f"  memory/GPU  {m['total_gib']:.1f} of {m['gpu_gib']:.1f} GiB "
        f"{'fits' if m['fits'] else 'DOES NOT FIT'}:"
        f" params {m['params_gib']:.2f}, grads {m['grads_gib']:.2f}, optimizer "
        f"{m['optimizer_gib']:.2f},"
        f" FSDP gather {m['fsdp_gather_gib']:.2f}, activations {m['activations_gib']:.2f} (AC "
        f"{m['activation_checkpoint']}),"
        f" logits {m['logits_gib']:.2f}, overhead {m['overhead_gib']:.2f}",
    ]
    for k, c in p["comm"].items():
        lines.append(
            f"  comm {k:12s} group {c['group']:4d}  {c['bytes'] / 1e9:8.2f} GB/step over "
            f"{c['link']:6s} {c['seconds']:.3f} s"
        )
    lines += [
        f"  step        {st['step_s']:.2f} s (compute {st['compute_s']:.2f}, exposed comm "
        f"{st['exposed_comm_s']:.2f},"
        f" PP bubble {st['pp_bubble']:.0%}), MFU {st['mfu']:.1%}, "
        f"{st['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
        + (" (float8 linears)" if st["float8"] else ""),
        f"  checkpoint  {ck['size_gb']:.1f} GB, write {ck['write_s']:.1f} s, async staging "
        f"{ck['async_staging_s']:.2f} s;"
        f" MTBF {ck['mtbf_hours']:.1f} h ({ck['mtbf_source']})",
        f"  interval    Young {ck['young_interval_s'] / 60:.1f} min, Daly "
        f"{ck['daly_interval_s'] / 60:.1f} min"
        f" = every {ck['interval_steps']} steps (recipe: {ck['recipe_interval_steps']})",
        f"  rollout     {p['rollout']}",
    ]
    lines += [f"  WARNING     {w}" for w in p["warnings"]]
    return "\n".join(lines)
