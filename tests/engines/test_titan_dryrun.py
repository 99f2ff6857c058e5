"""``ptops launch RECIPE --dry-run`` for TorchTitan recipes: every production recipe passes (the
real parallelisation built by TorchTitan's fake backend for the declared world), and a recipe with
impossible degrees or memory fails with one clear line (exit 2) before anything is built."""

from __future__ import annotations

import json

import pytest
from conftest import run_ptops

PRODUCTION = ["llama3-8b-h100", "llama3-70b-h200", "qwen3-moe-30b-h100"]


def _dry(*args: str):
    return run_ptops("launch", *args, "--dry-run", "--json", timeout=900)


def _one_line(proc, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_shipped_recipes_include_the_production_ones():
    out = run_ptops("recipes").stdout
    for name in PRODUCTION:
        assert name in out and "INVALID" not in out.split(name)[1].splitlines()[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", PRODUCTION)
def test_production_recipe_passes_dry_run(name):
    proc = _dry(name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    tt = rep["torchtitan"]
    assert tt["ok"] and tt["world"] == rep["world"]
    assert tt["mesh"] == {k: rep["degrees"][k] for k in tt["mesh"]}
    assert tt["float8_modules"] > 0  # the recipe's float8 really swapped TorchTitan's Linears
    assert tt["within_tolerance"], tt[
        "plan_vs_measured_param_bytes"
    ]  # planner vs rank 0's real shard
    assert any("fp8 kernels" in x for x in tt["not_checked"])


@pytest.mark.slow
def test_cp_and_pp_are_built_by_the_fake_backend():
    proc = _dry(
        "llama3-8b-h100",
        "--set",
        "titan.parallelism.cp=2",
        "--set",
        "titan.parallelism.pp=2",
        "--set",
        "titan.local_batch_size=2",
        "--set",
        'titan.parallelism.pp_schedule="1F1B"',
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tt = json.loads(proc.stdout)["torchtitan"]
    assert tt["mesh"]["cp"] == 2 and tt["mesh"]["pp"] == 2 and tt["mesh"]["dp_shard"] == 16
    assert "gather" in tt["cp_rotate_method"].lower()
    assert (
        tt["within_tolerance"] or tt["model_parts"] == 1
    )  # rank 0 holds the first stage (embedding)


def test_degrees_that_do_not_divide_the_world_fail_in_one_line():
    _one_line(
        _dry("llama3-8b-h100", "--set", "titan.parallelism.tp=3"),
        "titan.parallelism",
        "world of 64",
    )
    _one_line(
        _dry("llama3-70b-h200", "--set", "titan.parallelism.dp_shard=16", "--nodes", "4"),
        "titan.parallelism",
        "expected the world of 32",
        "4 nodes",
    )


def test_a_recipe_that_cannot_fit_fails_in_one_line():
    line = _one_line(
        _dry("llama3-70b-h200", "--set", 'titan.activation_checkpoint.mode="none"'), "does not fit"
    )
    assert "h200" in line and "activations" in line


def test_cross_key_rules_are_one_line():
    _one_line(
        _dry("llama3-8b-h100", "--set", "titan.parallelism.ep=8"), "titan.parallelism.ep", "MoE"
    )
    _one_line(
        _dry(
            "titan-tiny",
            "--set",
            "titan.float8.enabled=true",
            "--set",
            "titan.float8.emulate=true",
            "--set",
            "titan.compile.enable=true",
        ),
        "titan.float8.emulate",
        "compile",
    )
    _one_line(
        _dry("llama3-8b-h100", "--set", 'titan.model.flavor="9B"'), "titan.model.flavor", "8B"
    )
    _one_line(
        _dry(
            "llama3-8b-h100",
            "--set",
            "titan.parallelism.cp=2",
            "--set",
            'titan.parallelism.cp_rotate_method="alltoall"',
        ),
        "cp_rotate_method",
        "FlexAttention",
    )
    _one_line(
        _dry("llama3-8b-h100", "--set", 'titan.float8.filter_fqns=["auto_filter_small_kn"]'),
        "titan.float8.filter_fqns",
    )


def test_cp_rotate_method_reaches_torch(tmp_path):
    """TorchTitan 0.3.0 has no field for it: building the config sets torch's own CP option."""
    from ptops.recipes.schema import load
    from ptops.recipes.titan import registry
    # isort: split

    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    rec, _ = load(
        "titan-tiny", ["titan.parallelism.cp=2", 'titan.parallelism.cp_rotate_method="alltoall"']
    )
    cfg = registry.trainer_config(rec, tmp_path)
    assert cfg.parallelism.context_parallel_degree == 2
    assert _cp_options.rotate_method.name == "ALL_TO_ALL"
    rec, _ = load("titan-tiny", ["titan.parallelism.cp=2"])
    registry.trainer_config(rec, tmp_path)
    assert _cp_options.rotate_method.name == "ALL_GATHER"


def test_float8_recipe_names_reach_torchao():
    """Each [titan.float8] recipe is a recipe name torchao knows (TorchTitan passes it to
    from_recipe_name)."""
    from typing import get_args

    from torchao.float8 import Float8LinearConfig

    from ptops.recipes.titan.config import TitanFloat8

    names = get_args(TitanFloat8.model_fields["recipe"].annotation)
    assert set(names) == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}
    for name in names:
        assert Float8LinearConfig.from_recipe_name(name) is not None
