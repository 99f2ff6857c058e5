"""The planner (recipes/plan.py): exact parameter counts, snapshots per recipe, memory against
measurement.

Parameter counts and FLOPs per token are compared with TorchTitan's own models built on the meta
device; activation bytes with what autograd really saves in a forward pass of a CPU model.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from ptops.recipes import plan as P
from ptops.recipes.schema import load

PRODUCTION = ["llama3-8b-h100", "llama3-70b-h200", "qwen3-moe-30b-h100"]

# exact parameter counts (TorchTitan 0.3.0's flavors; equal to the meta-device models below)
EXACT = {
    "titan-tiny": 172_352,
    "llama3-8b-h100": 8_030_261_248,
    "llama3-70b-h200": 70_553_706_496,
    "qwen3-moe-30b-h100": 30_532_122_624,
}


def _target_plan(name: str) -> dict:
    rec, _ = load(name)
    t = rec.titan.target
    gpus = (t.nodes if t else 1) * rec.launch.nproc
    return P.plan(rec, t.gpu if t else "h100", gpus, t.nodes if t else 1)


def _meta_model(name: str):
    from ptops.recipes.titan import registry  # applies the CPU compatibility layer
    # isort: split

    import torch

    rec, _ = load(name)
    spec = registry.model_spec(rec, dry_run=True)  # float8 in emulation: same parameters
    with torch.device("meta"):
        model = spec.model.build()
    return rec, spec, model


@pytest.mark.parametrize("name", list(EXACT))
def test_parameter_count_and_flops_equal_torchtitans_model_on_meta(name):
    rec, spec, model = _meta_model(name)
    counted = sum(p.numel() for p in model.parameters())
    shape = P.shape_of(rec.titan)
    assert P.param_counts(shape)["total"] == counted == EXACT[name]
    n, fpt = spec.model.get_nparams_and_flops(model, rec.titan.seq_len)
    assert n == counted
    assert P.flops_per_token(shape, rec.titan.seq_len) == fpt


SNAPSHOT = REPO / "tests" / "snapshots" / "plan.json"


def _snap(p: dict) -> dict:
    """The figures a change to the planner must show in review (rounded so they read)."""
    m, st, ck = p["memory"], p["step"], p["checkpoint"]
    return {
        "params": p["model"]["params"],
        "active_params": p["model"]["active_params"],
        "flops_per_token": p["model"]["flops_per_token"],
        "degrees": p["degrees"],
        "memory_gib": {k: round(v, 2) for k, v in m.items() if k.endswith("_gib")},
        "fits": m["fits"],
        "comm_gb": {k: round(c["bytes"] / 1e9, 2) for k, c in p["comm"].items()},
        "step_s": round(st["step_s"], 3),
        "mfu": round(st["mfu"], 3),
        "checkpoint_gb": round(ck["size_gb"], 1),
        "interval_steps": ck["interval_steps"],
    }


def test_plan_snapshots_per_recipe():
    got = {name: _snap(_target_plan(name)) for name in EXACT}
    if not SNAPSHOT.exists() or __import__("os").environ.get("PTOPS_REGEN"):
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(SNAPSHOT.read_text()), (
        "planner figures changed: PTOPS_REGEN=1 to accept"
    )
    for name in PRODUCTION:
        assert got[name]["fits"], name
        assert got[name]["params"] == EXACT[name]


def test_activation_bytes_match_what_autograd_saves():
    """The planner's per-token, per-layer activation bytes against a real forward on CPU (fp32:
    x2)."""
    import torch

    from ptops.recipes.titan.registry import tiny_llama3

    dim, layers, heads, vocab, seq, batch = 256, 2, 4, 512, 256, 2
    model = tiny_llama3(dim, layers, heads, vocab, seq).model.build()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = max(saved.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, vocab, (batch, seq)))
    measured = sum(v for k, v in saved.items() if k not in params)
    shape = P.Shape("llama3", dim, layers, heads, heads, dim // heads, P.ffn_hidden(dim, 64), vocab)
    planned = (
        2 * P._act_bytes_per_token_layer(shape) * batch * seq * layers + batch * seq * vocab * 4
    )
    assert abs(measured / planned - 1) < 0.10, (measured, planned)


def test_young_daly_interval_and_mtbf_override():
    rec, _ = load("llama3-8b-h100")
    p = P.plan(rec, "h100", 64, 8)
    ck = p["checkpoint"]
    assert ck["mtbf_hours"] == pytest.approx(54 * 24 / 419 * 16384 / 64)
    assert ck["young_interval_s"] == pytest.approx(
        (2 * ck["blocking_s"] * ck["mtbf_hours"] * 3600) ** 0.5
    )
    shorter = P.plan(rec, "h100", 64, 8, mtbf_hours=1.0)["checkpoint"]
    assert (
        shorter["daly_interval_s"] < ck["daly_interval_s"]
        and shorter["mtbf_source"] == "--mtbf-hours"
    )


def test_more_gpus_less_memory_and_fp8_needs_a_new_gpu():
    rec, _ = load("llama3-8b-h100", ["titan.global_batch_size=256"])
    a = P.plan(rec, "h100", 64, 8)["memory"]["params_gib"]
    b = P.plan(rec, "h100", 128, 16)["memory"]["params_gib"]
    assert b == pytest.approx(a / 2)
    assert any("float8" in w for w in P.plan(rec, "a100", 64, 8)["warnings"])


def test_plan_cli_json_and_bad_input(ptops):
    proc = ptops("plan", "llama3-8b-h100", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["model"]["params"] == EXACT["llama3-8b-h100"] and p["memory"]["fits"]
    assert set(p["comm"]) == {"fsdp"} and p["checkpoint"]["interval_steps"] >= 1
    bad = ptops("plan", "llama3-8b-h100", "--gpu", "v100")
    assert (
        bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "h100" in bad.stderr
    )
    text = ptops("plan", "qwen3-moe-30b-h100", "--gpus", "64", "--nodes", "8")
    assert text.returncode == 0 and "comm ep" in text.stdout and "active" in text.stdout


@pytest.mark.slow
def test_checkpoint_size_against_a_real_titan_tiny_checkpoint(faulted_runs):
    """The planner's checkpoint size (12 B a parameter: fp32 weights + two AdamW moments) against
    the bytes DCP really wrote. The tiny model's checkpoint is ~1.2x: dataloader state, RNG and DCP
    framing are a constant per rank that vanishes at production size; the planner must never be
    above it."""
    ref = faulted_runs.get("reference")
    assert ref.proc.returncode == 0, ref.proc.stderr[-2000:]
    ck = ref.run / "checkpoints" / "step-16"
    written = sum(p.stat().st_size for p in ck.glob("*.distcp"))
    planned = _target_plan("titan-tiny")["checkpoint"]["size_gb"] * 1e9
    assert 1.0 <= written / planned <= 1.4, (written, planned)


# --------------------------------------------------------------- GRPO rollouts (recipes/plan_rl.py)
@pytest.mark.parametrize(
    "sets", [[], ["trl.model.hidden_size=256", "trl.model.num_layers=3", "trl.model.num_heads=8"]]
)
def test_grpo_policy_parameters_equal_the_built_model(sets):
    """The planner's count is the model ptops trains: the shipped tiny one (built for real) and a
    bigger shape of the same family (built on the meta device)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ptops.recipes.assets import tokenizer_dir
    from ptops.recipes.plan_rl import plan_grpo
    from ptops.recipes.trl.model import _config_dict, load_model, model_dir

    rec, _ = load("trl-grpo-tiny", sets)
    if not sets:
        model = load_model(model_dir(rec.trl.model, rec.trl.model.seed))
    else:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(
                Qwen2Config(**_config_dict(rec.trl.model, tokenizer_dir(rec.trl.model.vocab_size)))
            )
    p = plan_grpo(rec, "h100", 8)
    assert p["model"]["params"] == sum(t.numel() for t in model.parameters())


def test_grpo_rollout_capacity_and_split():
    from ptops.recipes.plan_rl import plan_grpo, render_grpo

    big = [
        "trl.model.hidden_size=4096",
        "trl.model.num_layers=32",
        "trl.model.num_heads=32",
        "trl.model.vocab_size=8192",
        "trl.max_length=512",
        "trl.max_completion_length=1024",
        "trl.per_device_batch_size=64",
    ]
    rec, _ = load("trl-grpo-tiny", big)
    p = plan_grpo(rec, "h100", 8)
    r, c, s = p["rollouts"], p["colocate"], p["server"]
    assert (
        r["completions_per_step"] == 64 * 2
        and r["prompts_per_step"] == 32
        and r["generated_tokens_per_step"] == 128 * 1024
    )
    # decode is memory bound: a faster HBM (H200) generates faster with the same compute
    h200 = plan_grpo(rec, "h200", 8)
    assert h200["colocate"]["generated_tokens_per_s"] > c["generated_tokens_per_s"]
    # the split balances the two sides, and overlapping them beats doing both on every GPU in turn
    assert s["generation_gpus"] + s["training_gpus"] == 8 and 1 <= s["generation_gpus"] <= 7
    assert s["step_s"] < c["step_s"] and 0 < c["generation_share"] < 1
    # long completions make generation the larger share
    short, _ = load(
        "trl-grpo-tiny", [*big[:-2], "trl.max_completion_length=64", "trl.per_device_batch_size=64"]
    )
    assert plan_grpo(short, "h100", 8)["colocate"]["generation_share"] < c["generation_share"]
    assert "server" in render_grpo(p) and "tok/s" in render_grpo(p)
    with pytest.raises(P.PlanError, match="GRPO"):
        plan_grpo(load("trl-sft-tiny")[0], "h100", 8)


def test_plan_cli_on_a_grpo_recipe(ptops):
    out = ptops("plan", "trl-grpo-tiny", "--gpu", "h200", "--gpus", "4", "--json")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["hardware"] == {"gpu": "h200", "gpus": 4} and p["server"]["generation_gpus"] >= 1
    bad = ptops("plan", "trl-sft-tiny")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "GRPO" in bad.stderr
