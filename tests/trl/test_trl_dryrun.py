"""Every TRL production sibling passes ``ptops launch RECIPE --dry-run``: its stated architecture
built on the meta device (exact parameter counts, no download), LoRA targets found, the TRL config
object built, the per-GPU memory estimate within the GPU; mistakes are one ``error:`` line (exit
2)."""

from __future__ import annotations

import json

import pytest
from conftest import run_ptops
from helpers import assert_one_clear_line

LLAMA3_8B = 8_030_261_248  # Llama-3.1-8B (untied embeddings)
SIBLINGS = {
    "trl-lora-sft-llama3-8b": ("lora_sft", "SFTConfig"),
    "trl-reward-llama3-8b": ("reward", "RewardConfig"),
    "trl-rloo-llama3-8b": ("rloo", "RLOOConfig"),
    "trl-gkd-llama3-8b": ("gkd", "GKDConfig"),
}


@pytest.mark.parametrize("recipe", sorted(SIBLINGS))
def test_production_sibling_passes_dry_run(recipe):
    proc = run_ptops("launch", recipe, "--dry-run", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    trainer, config = SIBLINGS[recipe]
    res = rep["trl"]
    assert rep["trainer"] == trainer and res["ok"] and res["fits"] and res["trl_config"] == config
    assert 0 < res["memory_total_gib"] <= res["gpu_gib"]
    if trainer == "reward":  # the LM head is replaced by a one-score head
        assert res["model"] == "LlamaForSequenceClassification"
        assert res["params"] == LLAMA3_8B - 128256 * 4096 + 4096
    else:
        assert res["model"] == "LlamaForCausalLM" and res["params"] == LLAMA3_8B
    if trainer == "lora_sft":  # r 16 on the 7 projections of 32 layers: 16 x (in + out) each
        per_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
        assert res["trainable_params"] == 32 * per_layer
        assert res["lora_modules"] == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
    else:
        assert res["trainable_params"] == res["params"]
    if trainer == "rloo":
        assert res["use_vllm"] is True
        (sc,) = rep["sidecars"]
        assert sc["argv"][1:4] == ["vllm-serve", "--model", "meta-llama/Llama-3.1-8B-Instruct"]
        assert sc["env"] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    else:
        assert rep["sidecars"] == []
    if trainer == "gkd":
        assert (
            res["teacher_model"] == "LlamaForCausalLM" and res["teacher_params"] == 70_553_706_496
        )


def test_dry_run_mistakes_are_one_line():
    proc = run_ptops(
        "launch",
        "trl-lora-sft-tiny",
        "--set",
        'trl.lora.target_modules=["nope_proj"]',
        "--dry-run",
        timeout=600,
    )
    assert_one_clear_line(proc, "trl-lora-sft-tiny.toml", "key 'trl'", "nope_proj")
    proc = run_ptops(
        "launch", "trl-rloo-llama3-8b", "--set", "trl.fsdp=false", "--dry-run", timeout=600
    )
    assert_one_clear_line(proc, "trl-rloo-llama3-8b.toml", "does not fit", "GiB per GPU")


def test_plan_sizes_rloo_rollouts_with_the_stated_llama_architecture():
    """``ptops plan`` on the RLOO sibling: the planner's Llama count equals the meta-device build
    above."""
    from ptops.recipes.plan_rl import plan_grpo
    from ptops.recipes.schema import load

    rec, _ = load("trl-rloo-llama3-8b")
    p = plan_grpo(rec, "h100", 8)
    assert (
        p["model"]["family"] == "llama"
        and p["model"]["params"] == LLAMA3_8B
        and p["trainer"] == "rloo"
    )
    # grouped-query attention: 8 KV heads of 128 x 32 layers x (K, V) x bf16
    assert p["model"]["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
