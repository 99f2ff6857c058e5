"""Rollout capacity of a GRPO recipe: how fast vLLM generates on the stated GPUs, how many rollouts
a step takes, and the GPU split between generation and training it implies. Pure, like ``plan.py``.

The policy is the recipe's own model (``[trl.model]``: a Qwen2-shaped decoder with tied embeddings,
as ``recipes/trl/model.py`` builds it); its parameter count is exact (tests/engines/test_plan.py
builds the model). Generation is modelled as vLLM does it: a prefill of the prompts (compute bound),
then decode steps in which every running sequence emits one token and each step reads the weights
once plus every running sequence's KV cache (memory-bandwidth bound), with as many sequences running
at once as the KV cache left after the weights holds. Training is 6N FLOPs per token of prompt +
completion, plus 2N for the reference model's forward when beta > 0.
"""

from __future__ import annotations

import math
from typing import Any

from .plan import ASSUMPTIONS, GPUS, PlanError

RL_ASSUMPTIONS = {
    "hbm_efficiency": 0.7,  # share of HBM bandwidth a decode step reaches (weights + KV reads)
    # vLLM's gpu_memory_utilization: the KV cache gets this share minus the weights
    "kv_cache_share": 0.9,
    "bytes_per_param": 2,  # bf16 weights in vLLM
    "bytes_per_kv": 2,  # bf16 KV cache
}


def qwen2_params(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int
) -> int:
    """Exact parameters of a Qwen2ForCausalLM with tied embeddings (q/k/v biases, no o bias,
    RMSNorm)."""
    hd = hidden // heads
    attn = hidden * hidden + hidden + 2 * (hidden * kv_heads * hd + kv_heads * hd) + hidden * hidden
    mlp = 3 * hidden * intermediate
    return vocab * hidden + layers * (attn + mlp + 2 * hidden) + hidden


def llama_params(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool
) -> int:
    """Exact parameters of a LlamaForCausalLM (no biases, RMSNorm; lm_head unless tied)."""
    hd = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * hd
    return (
        vocab * hidden * (1 if tied else 2)
        + layers * (attn + 3 * hidden * intermediate + 2 * hidden)
        + hidden
    )


def _gen_seconds(
    n: int, kv_per_token: float, seqs: int, prompt: int, completion: int, gpus: int, g
) -> dict:
    """Prefill + decode time of ``seqs`` sequences on ``gpus`` data-parallel vLLM engines."""
    per_engine = math.ceil(seqs / gpus)
    weights = RL_ASSUMPTIONS["bytes_per_param"] * n
    kv_room = g.memory_gib * 1024**3 * RL_ASSUMPTIONS["kv_cache_share"] - weights
    if kv_room <= 0:
        raise PlanError(
            f"the policy's bf16 weights ({weights / 1024**3:.1f} GiB) do not fit one {g.name} "
            "for vLLM"
        )
    max_running = max(1, int(kv_room // (kv_per_token * (prompt + completion))))
    running = min(per_engine, max_running)
    waves = math.ceil(per_engine / running)
    bw = g.hbm_tbs * 1e12 * RL_ASSUMPTIONS["hbm_efficiency"]
    peak = g.bf16_tflops * 1e12 * ASSUMPTIONS["matmul_efficiency"]
    # a decode step: read the weights once and the running sequences' KV (half full on average)
    step_bytes = weights + running * kv_per_token * (prompt + completion / 2)
    step_s = max(step_bytes / bw, running * 2 * n / peak)
    decode_s = waves * completion * step_s
    prefill_s = per_engine * prompt * 2 * n / peak
    return {
        "seconds": prefill_s + decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "running_per_gpu": running,
        "max_running_per_gpu": max_running,
        "waves": waves,
    }


def plan_grpo(recipe: Any, gpu: str, gpus: int) -> dict:
    """Rollouts per step, generated tokens/s and the generation/training split for a GRPO recipe."""
    if gpu not in GPUS:
        raise PlanError(f"--gpu: one of {', '.join(GPUS)} (got {gpu!r})")
    g = GPUS[gpu]
    t = recipe.trl
    if t.trainer not in ("grpo", "rloo"):
        raise PlanError(
            f"ptops plan sizes rollouts of GRPO and RLOO recipes (trl.trainer = {t.trainer!r})"
        )
    m = t.model
    kv_heads = getattr(m, "num_kv_heads", None) or m.num_heads
    inter = getattr(m, "intermediate_size", None) or 2 * m.hidden_size
    if getattr(m, "arch", "qwen2") == "llama":
        n = llama_params(
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            kv_heads,
            inter,
            m.vocab_size,
            m.tie_word_embeddings,
        )
    else:
        n = qwen2_params(m.hidden_size, m.num_layers, m.num_heads, kv_heads, inter, m.vocab_size)
    hd = m.hidden_size // m.num_heads
    kv_per_token = 2 * m.num_layers * kv_heads * hd * RL_ASSUMPTIONS["bytes_per_kv"]
    completions = t.per_device_batch_size * recipe.launch.nproc * t.grad_accum
    prompts = completions // t.num_generations
    lp, lc = t.max_length, t.max_completion_length
    peak = g.bf16_tflops * 1e12 * ASSUMPTIONS["matmul_efficiency"]
    train_flops = completions * (lp + lc) * (6 * n + (2 * n if t.beta > 0 else 0))

    def train_s(k: int) -> float:
        return train_flops / (peak * k)

    colocated = _gen_seconds(n, kv_per_token, completions, lp, lc, gpus, g)
    colo_step = colocated["seconds"] + train_s(gpus)
    split = None
    if (
        gpus >= 2
    ):  # server mode: generation on some GPUs, training on the rest, overlapped (one step stale)
        best = min(
            range(1, gpus),
            key=lambda k: max(
                _gen_seconds(n, kv_per_token, completions, lp, lc, k, g)["seconds"],
                train_s(gpus - k),
            ),
        )
        gen = _gen_seconds(n, kv_per_token, completions, lp, lc, best, g)
        split = {
            "generation_gpus": best,
            "training_gpus": gpus - best,
            "generation_s": gen["seconds"],
            "training_s": train_s(gpus - best),
            "step_s": max(gen["seconds"], train_s(gpus - best)),
        }
    return {
        "recipe": getattr(recipe, "name", ""),
        "model": {
            "family": getattr(m, "arch", "qwen2"),
            "params": n,
            "kv_bytes_per_token": kv_per_token,
        },
        "trainer": t.trainer,
        "hardware": {"gpu": gpu, "gpus": gpus},
        "rollouts": {
            "prompts_per_step": prompts,
            "completions_per_step": completions,
            "num_generations": t.num_generations,
            "prompt_tokens": lp,
            "completion_tokens": lc,
            "generated_tokens_per_step": completions * lc,
        },
        "colocate": {
            "generation": colocated,
            "training_s": train_s(gpus),
            "step_s": colo_step,
            "generated_tokens_per_s": completions * lc / colocated["seconds"],
            "generation_share": colocated["seconds"] / colo_step,
        },
        "server": split,
        "assumptions": {**{k: ASSUMPTIONS[k] for k in ("matmul_efficiency",)}, **RL_ASSUMPTIONS},
    }


def render_grpo(p: dict) -> str:
    r, c, s, mo = p["rollouts"], p["colocate"], p["server"], p["model"]
    lines = [
        f"{p['recipe']}: {p.get('trainer', 'grpo').upper()} rollouts on {p['hardware']['gpus']} "
        f"x {p['hardware']['gpu']}",
        f"  model       {mo['family']}, {mo['params']:,} parameters, KV "
        f"{mo['kv_bytes_per_token']:,} bytes/token",
        f"  per step    {r['prompts_per_step']} prompts x {r['num_generations']} = "
        f"{r['completions_per_step']} completions, "
        f"{r['generated_tokens_per_step']:,} generated tokens (prompt {r['prompt_tokens']}, "
        f"completion {r['completion_tokens']})",
        f"  colocate    generate {c['generation']['seconds']:.3g} s "
        f"({c['generated_tokens_per_s']:,.0f} tok/s; "
        f"{c['generation']['running_per_gpu']} sequences running per GPU, "
        f"{c['generation']['waves']} wave(s)) + "
        f"train {c['training_s']:.3g} s = {c['step_s']:.3g} s/step; generation is "
        f"{c['generation_share']:.0%} of the step",
    ]
    if s:
        lines.append(
            f"  server      {s['generation_gpus']} GPU(s) generate ({s['generation_s']:.3g} s), "
            f"{s['training_gpus']} train ({s['training_s']:.3g} s), overlapped: "
            f"{s['step_s']:.3g} s/step"
        )
    return "\n".join(lines)
