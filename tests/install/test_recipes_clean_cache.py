"""A newcomer's first run: every tiny shipped recipe launches alone on an empty asset cache, and the
cache never holds an entry that does not load (issue 27, item 1).

The GKD recipe's built-in teacher was built by both ranks after the process group existed;
transformers saved weights and config.json on rank 0 only, rank 1 won the rename, and the cache kept
a model folder with tokenizer files alone, marked complete, for every later run. Here: each recipe
gets its own empty ``PTOPS_CACHE`` and a plain 2-rank ``ptops launch`` (2 steps); two gloo ranks
build one asset (a non-main rank alone, then both at once); a poisoned entry (marked complete, no
config.json) is quarantined and rebuilt; a build that fails its own check is never marked complete.

The default run launches one tiny recipe per set of cached assets (BUILDS); the other tiny recipes
(FULL, the same entries as trl-sft-tiny) launch on their own clean caches with
    .venv/bin/python -m pytest -m clean_cache_full tests/install/test_recipes_clean_cache.py
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TESTS

from ptops.ops.runrecord.jsonl import read_jsonl
from ptops.recipes.schema import shipped_names

BIN = Path(sys.executable).parent
TINY = [n for n in shipped_names() if n.endswith("-tiny")]
STEPS = 2
# The default run launches one tiny recipe per set of cached assets it builds (what an empty cache
# tests); the others build the same entries as trl-gkd-tiny minus its teacher and run under
# `-m clean_cache_full` (all 11 took 23 min on a shared 2-core machine at load 10).
BUILDS = {
    "titan-tiny": {"tokenizer-512"},
    "trl-gkd-tiny": {"tokenizer-512", "trl-qwen2-h64-l2-a4-v512-s0", "trl-qwen2-h64-l2-a4-v512-s1"},
    "trl-grpo-judge-tiny": {
        "tokenizer-512",
        "trl-qwen2-h64-l2-a4-v512-s0",
        "trl-qwen2-h64-l2-a4-v512-s1234",
    },
}
FULL = {
    "trl-sft-tiny",
    "trl-dpo-tiny",
    "trl-grpo-tiny",
    "trl-grpo-math-tiny",
    "trl-grpo-code-tiny",
    "trl-lora-sft-tiny",
    "trl-reward-tiny",
    "trl-rloo-tiny",
}  # tokenizer-512 and the s0 policy


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _entries(cache: Path) -> list[Path]:
    root = cache / "v1"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def test_the_tiny_list_is_what_ptops_recipes_lists():
    out = subprocess.run(
        [str(BIN / "ptops"), "recipes"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines() if line.split()]
    listed = [n for n in names if "-tiny" in n]
    assert listed == TINY and "trl-gkd-tiny" in TINY and "titan-tiny" in TINY, (listed, TINY)
    assert sorted(TINY) == sorted([*BUILDS, *FULL]), "a new tiny recipe: put it in BUILDS or FULL"


def _marks(recipe: str) -> list:
    return ([] if recipe in BUILDS else [pytest.mark.clean_cache_full]) + (
        [pytest.mark.titan] if recipe.startswith("titan") else []
    )


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=_marks(r)) for r in TINY])
def test_tiny_recipe_launches_alone_on_a_clean_cache(recipe, tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    env = {**os.environ, "PTOPS_CACHE": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PTOPS_RANK_LOGS", None)
    t0, cpu0 = time.monotonic(), _children_cpu()
    proc = subprocess.run(
        [
            str(BIN / "ptops"),
            "launch",
            recipe,
            "--run-dir",
            str(run_dir),
            "--set",
            f"train.steps={STEPS}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    logs = "\n".join(
        f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted((run_dir / "logs" / "attempt-1").glob("rank-*.log"))
    )
    assert proc.returncode == 0, (
        f"{recipe}: exit {proc.returncode} after {took:.0f} s\n{proc.stderr[-2000:]}\n{logs}"
    )
    done = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "completed"]
    assert [e.get("step") for e in done] == [STEPS], done
    from ptops.recipes.assets import untrusted

    entries = _entries(cache)
    assert entries, f"{recipe}: nothing was built into the empty cache {cache}"
    assert {p.name: untrusted(p) for p in entries} == {p.name: None for p in entries}
    want = BUILDS.get(recipe, {"tokenizer-512", "trl-qwen2-h64-l2-a4-v512-s0"})
    assert {p.name for p in entries} == want
    assert not (cache / "v1" / ".quarantine").exists(), "a fresh cache's own build was quarantined"
    print(f"{recipe}: clean-cache launch {took:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)


def test_asset_built_under_a_process_group_is_complete(tmp_path):
    """Two real gloo ranks (tests/assets_worker.py) share one empty cache: rank 1 alone builds a
    model while rank 0 waits, then both build another at once. Every entry is complete, loads, and
    both ranks load the same weights from the same folder."""
    worker = TESTS / "assets_worker.py"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PTOPS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(tmp_path)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1, (r0, r1)
    from ptops.recipes.assets import untrusted

    for key in ("alone", "both"):
        path = Path(r0[key])
        assert untrusted(path) is None, (key, untrusted(path))
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == "qwen2" and (path / "model.safetensors").stat().st_size > 0
    assert (
        r0["digests"]["alone"] != r0["digests"]["both"]
    )  # two seeds, two models: not one folder twice
    assert not (tmp_path / "cache" / "v1" / ".quarantine").exists()
    assert not list((tmp_path / "cache" / "v1").glob(".trl-*")), (
        "a builder's temporary folder was left"
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PTOPS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "v1"


def _tiny():
    from ptops.recipes.trl.config import TrlModel

    return TrlModel(hidden_size=32, num_layers=1, num_heads=2)


def _poison_like_issue_27(entry: Path) -> None:
    """What the non-main rank published: tokenizer files and a bare marker, no weights, no
    config.json."""
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (entry / name).unlink()
    (entry / ".complete").write_text("ok\n")


def test_poisoned_entry_is_quarantined_and_rebuilt(cache):
    import torch

    from ptops.recipes.trl.model import load_model, model_dir

    torch.manual_seed(0)
    draw = torch.rand(3)
    torch.manual_seed(0)
    entry = model_dir(_tiny(), seed=7)
    assert torch.equal(torch.rand(3), draw), "building on an empty cache moved the caller's RNG"
    want = {k: v.clone() for k, v in load_model(entry).state_dict().items()}
    _poison_like_issue_27(entry)
    assert model_dir(_tiny(), seed=7) == entry  # rebuilt in place of the poisoned one
    got = load_model(entry).state_dict()
    assert sorted(got) == sorted(want) and all(
        got[k].equal(want[k]) for k in want
    )  # same seed, same model
    (quarantined,) = (cache / ".quarantine").iterdir()
    assert quarantined.name.startswith(entry.name + "-")
    assert not (quarantined / "config.json").exists() and (quarantined / "tokenizer.json").exists()
    assert "not a manifest" in (quarantined / "QUARANTINED").read_text()


def test_entry_of_an_older_ptops_is_kept_only_if_it_loads(cache):
    """A bare marker (older ptops) over a good entry: checked by loading, kept in place with a
    manifest."""
    from ptops.recipes.assets import untrusted
    from ptops.recipes.trl.model import model_dir

    entry = model_dir(_tiny(), seed=9)
    (entry / ".complete").write_text("ok\n")
    inode = (entry / "model.safetensors").stat().st_ino
    assert model_dir(_tiny(), seed=9) == entry and untrusted(entry) is None
    assert (entry / "model.safetensors").stat().st_ino == inode and not (
        cache / ".quarantine"
    ).exists()


def test_entry_changed_after_its_check_is_not_trusted(cache):
    """A manifest-marked entry that lost a file, or whose weights changed, is rebuilt; a good one is
    reused."""
    from ptops.recipes.assets import tokenizer_dir, untrusted
    from ptops.recipes.trl.model import model_dir

    entry = model_dir(_tiny(), seed=8)
    stamp = (entry / ".complete").stat().st_mtime_ns
    assert model_dir(_tiny(), seed=8) == entry and (entry / ".complete").stat().st_mtime_ns == stamp
    (entry / "config.json").unlink()
    assert untrusted(entry) == "config.json is missing"
    model_dir(_tiny(), seed=8)
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    assert untrusted(entry) == "model.safetensors differs from its manifest"
    model_dir(_tiny(), seed=8)
    assert untrusted(entry) is None and (entry / "config.json").is_file()
    tok = tokenizer_dir()
    (tok / "tokenizer.json").write_text("{}")
    assert untrusted(tokenizer_dir()) is None
    reasons = sorted(
        (q / "QUARANTINED").read_text().strip() for q in (cache / ".quarantine").iterdir()
    )
    assert reasons == [
        "config.json is missing",
        "model.safetensors differs from its manifest",
        "tokenizer.json differs from its manifest",
    ]


def test_a_build_that_fails_its_check_is_never_marked_complete(cache):
    from ptops.recipes.assets import AssetError, build_once
    from ptops.recipes.trl.model import _check

    def half(out: Path) -> None:  # the poisoned shape, built fresh
        (out / "tokenizer.json").write_text("{}")

    with pytest.raises(AssetError, match="fresh build fails its check, not cached"):
        build_once("half-model", half, _check)
    assert not (cache / "half-model").exists() and not list(cache.glob(".half-model-*"))


def test_a_dead_builders_temporary_folder_is_swept(cache):
    from ptops.recipes.assets import tokenizer_dir, untrusted

    stale = cache / ".tokenizer-512-deadbeef"  # mkdtemp's shape: a builder SIGKILLed mid-build
    stale.mkdir(parents=True)
    (stale / "tokenizer.json").write_text("{}")
    assert untrusted(tokenizer_dir()) is None and not stale.exists()


def test_the_model_check_refuses_a_missing_weight(cache, tmp_path):
    """Loading is the check: a weight file short of one tensor loads with transformers' fresh init,
    and the check refuses it (a half-written model is not complete)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ptops.recipes.assets import AssetError
    from ptops.recipes.trl.model import _check, model_dir

    entry = model_dir(_tiny(), seed=3)
    copy = tmp_path / "copy"
    shutil.copytree(entry, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    gone = next(k for k in sorted(tensors) if "mlp.up_proj" in k)
    del tensors[gone]
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AssetError, match=f"missing \\['{gone}'\\]"):
        _check(copy)
    _check(entry)
