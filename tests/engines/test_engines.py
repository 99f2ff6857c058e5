"""Engines register themselves; every command resolves a RECIPE argument the same way."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO

from ptops.recipes import engines
from ptops.recipes.schema import Recipe, RecipeError, load, resolve


def test_every_engine_folder_registers_a_section_and_an_entry_point():
    found = engines.engines()
    folders = sorted(p.name for p in (REPO / "recipes").iterdir() if (p / "__init__.py").is_file())
    assert sorted(found) == folders == ["script", "titan", "trl"]
    for name, eng in found.items():
        assert name in Recipe.model_fields, f"Recipe has no [{name}] section"
        module, _, func = eng.entry.partition(":")
        assert func and importlib.util.find_spec(module) is not None, eng.entry


def test_engine_registry_loads_without_torch():
    """The CLI validates recipes fast: registering engines must not import torch, trl or
    torchtitan."""
    code = (
        "import sys; from ptops.recipes.schema import load; load('trl-grpo-tiny'); "
        "load('titan-tiny'); "
        "print(sorted(m for m in ('torch', 'trl', 'torchtitan', 'transformers') if m in "
        "sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.strip().replace("'", '"')) == []


def test_engine_cross_check_is_the_engines_own():
    """The GRPO batch rule lives in recipes/trl/config.py and is applied by the schema at load."""
    from ptops.recipes.trl.config import check_recipe

    assert engines.get("trl").check is check_recipe
    rec, _ = load("trl-grpo-tiny")
    assert check_recipe(rec) is None
    with pytest.raises(
        RecipeError, match=r"key 'trl.num_generations': must divide .* = 8 \(got 3\)"
    ):
        load("trl-grpo-tiny", ["trl.num_generations=3"])


def test_stored_recipe_json_is_validated_like_a_toml_file():
    from ptops.recipes.schema import dump_json, from_json

    rec, _ = load("trl-grpo-tiny")
    assert from_json(dump_json(rec)) == rec
    bad = json.loads(dump_json(rec))
    bad["trl"]["num_generations"] = 3
    with pytest.raises(RecipeError, match="recipe.json: key 'trl.num_generations'"):
        from_json(json.dumps(bad))


@pytest.mark.parametrize(
    "given", ["titan-tiny", "recipes/titan-tiny.toml", str(REPO / "recipes" / "titan-tiny.toml")]
)
def test_one_resolver_for_names_relative_and_absolute_paths(given, monkeypatch):
    monkeypatch.chdir(REPO)
    ref = resolve(given)
    assert ref.name == "titan-tiny" and ref.path == REPO / "recipes" / "titan-tiny.toml"


@pytest.mark.parametrize(
    "given", ["titan-tiny", "recipes/titan-tiny.toml", str(REPO / "recipes" / "titan-tiny.toml")]
)
def test_chaos_takes_a_recipe_as_launch_does(given, tmp_path, monkeypatch):
    """``ptops chaos --recipe recipes/titan-tiny.toml`` used to die with FileNotFoundError
    (FileExistsError absolute)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptops",
            "chaos",
            "--recipe",
            given,
            "--scenario",
            "crash",
            "--list",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "titan-tiny/crash"
    from ptops.faultinject.chaos import select

    monkeypatch.chdir(REPO)
    (sc,) = select([given], ["crash"])  # (cwd is the repo: the relative form resolves there)
    assert sc.recipe == "titan-tiny" and sc.launch_argv(tmp_path / "r")[4] == str(
        REPO / "recipes" / "titan-tiny.toml"
    )


def test_chaos_unknown_recipe_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "ptops", "chaos", "--recipe", "nope.toml", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().count("\n") == 0 and "nope.toml: recipe file not found" in proc.stderr
    )
