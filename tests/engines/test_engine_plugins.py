"""Engines from other distributions: the test builds and installs two small ones (``pip install
--target``) and runs the real ``ptops`` with them on ``PYTHONPATH``.

* ``ptops-toy-engine``: engine ``toy`` (entry point ``toy = "ptops_toy_engine:ENGINE"``), a 2-layer
  MLP on 2 gloo ranks that reports through the probe and saves with ``ptops.ckpt.SaveTransaction`` +
  DCP, and ships ``toy-tiny`` (and a ``titan-tiny`` that must lose to ptops' own);
* ``ptops-bad-plugins``: entry points ``trl`` and ``train`` (a name of ptops' own: refused before
  its code runs), ``sneaky`` (an Engine named ``titan``: refused after) and ``boom`` (its import
  raises).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_ptops

VERSION = "0.1.0"

TOY_INIT = '''
"""Toy engine for ptops: registers through the ptops.engines entry point (light: no torch here)."""
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ptops.recipes.engines import Engine

if os.environ.get("TOY_IMPORT_MARK"):  # lets the test see whether ptops imported this plugin
    with open(os.environ["TOY_IMPORT_MARK"], "a") as f:
        f.write(f"{os.getpid()}\\n")


class ToySection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hidden: int = Field(16, ge=1, description="hidden width of the MLP")
    batch: int = Field(8, ge=1, description="samples per rank and step")
    lr: float = Field(0.05, gt=0)


def check(recipe):
    if recipe.toy.batch % 2:
        return "toy.batch", f"must be even (got {recipe.toy.batch})"
    return None


ENGINE = Engine(
    name="toy",
    section=ToySection,
    entry="ptops_toy_engine.train:main",
    check=check,
    description="a 2-layer MLP regression on gloo ranks",
    recipes_dir=Path(__file__).parent / "recipes",
)
'''

TOY_TRAIN = '''
"""The toy engine's rank: the probe calls and the save transaction every ptops engine makes."""
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ptops.ckpt import SaveTransaction, resume_point


def _failed_anywhere(failed):
    t = torch.tensor([int(failed)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _save(step, model, recipe, probe, root, rank, world):
    probe.phase("checkpoint", step)
    probe.faults.on_checkpoint(step)
    t0 = time.monotonic()
    txn = SaveTransaction(root, step, leader=rank == 0, agree=_failed_anywhere, world_size=world,
                          keep=recipe.checkpoint.keep)
    if txn.begin():
        probe.faults.in_save(step)
        err = None
        try:
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(txn.path))
        except Exception as e:
            err = e
        txn.commit(err)
    if not txn.ok:
        raise RuntimeError(f"checkpoint step-{step} not saved: {txn.error}")
    if rank == 0:
        took = round(time.monotonic() - t0, 4)
        probe.event("checkpoint", step=step, path=str(txn.path), blocking_s=took, total_s=took, mode="sync")
    probe.phase("step", step)
    probe.faults.after_checkpoint(step)


def main(recipe, probe):
    probe.startup("rendezvous")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    probe.world(world, rank)
    probe.startup("build")
    torch.manual_seed(recipe.train.seed)
    cfg = recipe.toy
    model = torch.nn.Sequential(torch.nn.Linear(4, cfg.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(cfg.hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    probe.startup("load")
    root = Path(os.environ["PTOPS_RUN_DIR"]) / "checkpoints"
    box = [""]
    if rank == 0:
        entry = resume_point(root, world_size=world)
        box = [str(entry.path) if entry is not None else ""]
    dist.broadcast_object_list(box, src=0)
    start = 0
    if box[0]:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=box[0])
        model.load_state_dict(state["model"])
        start = int(Path(box[0]).name.split("-")[1])
        print(f"toy: resumed from {box[0]}", flush=True)
    for step in range(start + 1, recipe.train.steps + 1):
        probe.profile.at_step(step)
        probe.faults.before_step(step)
        probe.before_step(step)
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(recipe.train.seed * 100003 + step * world + rank)
        x = torch.randn(cfg.batch, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        if probe.faults.should_poison(step):
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        took = time.monotonic() - t0
        probe.step(step, {"loss": mean.item() / world, "grad_norm": grad_norm.item(), "lr": cfg.lr,
                          "step_s": took, "tokens_per_s": cfg.batch * world / max(took, 1e-9)})
        if step % recipe.checkpoint.interval == 0 or step == recipe.train.steps:
            _save(step, model, recipe, probe, root, rank, world)
'''  # noqa: E501

TOY_TINY = """
name = "toy-tiny"
engine = "toy"
description = "a 2-layer MLP regression on 2 gloo ranks (an engine from another package)"

[train]
steps = 6

[launch]
nproc = 2

[checkpoint]
interval = 2
keep = 2

[toy]
hidden = 16
"""

# same name as a recipe ptops ships: ptops' own must win
TOY_TITAN_TINY = 'name = "titan-tiny"\nengine = "toy"\ndescription = "SHADOW"\n'

SHADOW_INIT = """
from pydantic import BaseModel
from ptops.recipes.engines import Engine


class Section(BaseModel):
    pass


TRL = Engine(name="trl", section=Section, entry="ptops_shadow:main", description="SHADOW trl")
TITAN = Engine(name="titan", section=Section, entry="ptops_shadow:main", description="SHADOW titan")
"""

BROKEN_INIT = 'raise RuntimeError("boom: this plugin fails at import on purpose")\n'


def _dist(
    root: Path, name: str, package: str, files: dict[str, str], entry_points: dict[str, str]
) -> Path:
    d = root / name
    packages = sorted({rel.split("/")[0] for rel in files if rel.endswith("/__init__.py")})
    eps = "\n".join(f'{k} = "{v}"' for k, v in entry_points.items())
    files = {
        "pyproject.toml": f"""
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{name}"
            version = "{VERSION}"

            [project.entry-points."ptops.engines"]
            {eps}

            [tool.setuptools]
            packages = {json.dumps(packages)}

            [tool.setuptools.package-data]
            "{package}" = ["recipes/*.toml"]
            """,
        **files,
    }
    for rel, text in files.items():
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return d


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """The two distributions, built and installed once into one ``--target`` folder."""
    root = tmp_path_factory.mktemp("engine-plugins")
    toy = _dist(
        root / "src",
        "ptops-toy-engine",
        "ptops_toy_engine",
        {
            "ptops_toy_engine/__init__.py": TOY_INIT,
            "ptops_toy_engine/train.py": TOY_TRAIN,
            "ptops_toy_engine/recipes/toy-tiny.toml": TOY_TINY,
            "ptops_toy_engine/recipes/titan-tiny.toml": TOY_TITAN_TINY,
        },
        {"toy": "ptops_toy_engine:ENGINE"},
    )
    bad = _dist(
        root / "src",
        "ptops-bad-plugins",
        "ptops_shadow",
        {
            "ptops_shadow/__init__.py": SHADOW_INIT,
            "ptops_broken/__init__.py": BROKEN_INIT,
        },
        {
            "trl": "ptops_shadow:TRL",
            "sneaky": "ptops_shadow:TITAN",
            "boom": "ptops_broken",
            "train": "ptops_shadow:TRL",
        },
    )
    site = root / "site"
    # offline, with this environment's setuptools (a Python 3.11 venv has it); else pip fetches one
    local = ["--no-index", "--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *local,
            "--no-deps",
            "--target",
            str(site),
            str(toy),
            str(bad),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (site / "ptops_toy_engine" / "recipes" / "toy-tiny.toml").is_file()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "site": site, "root": root}


def _env(plugins, **extra) -> dict:
    return {"PYTHONPATH": plugins["PYTHONPATH"], **extra}


def _section(out: str, title: str) -> list[str]:
    """The indented lines under ``title:`` in ``ptops recipes``."""
    lines = out.splitlines()
    start = lines.index(f"{title}:") + 1
    body = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        body.append(line.strip())
    return body


def test_recipes_lists_plugin_engines_their_recipes_and_what_did_not_load(plugins):
    proc = run_ptops("recipes", env=_env(plugins), timeout=120)
    assert proc.returncode == 0, proc.stderr
    engines = {line.split()[0]: line for line in _section(proc.stdout, "engines")}
    assert sorted(engines) == ["script", "titan", "toy", "trl"]
    assert engines["toy"].split()[1:3] == ["ptops-toy-engine", VERSION]
    assert "a 2-layer MLP regression" in engines["toy"]
    for name in ("titan", "trl"):  # the shadows did not replace ptops' own
        assert engines[name].split()[1] == "ptops" and "SHADOW" not in engines[name]
    recipes = {line.split()[0]: line.split()[1] for line in _section(proc.stdout, "recipes")}
    assert recipes["toy-tiny"] == "toy"
    assert (
        recipes["titan-tiny"] == "titan" and "SHADOW" not in proc.stdout
    )  # ptops' own recipe won the name
    skipped = _section(proc.stdout, "engine plugins not loaded")
    assert len(skipped) == 4, skipped
    by_name = {line.split()[0]: line for line in skipped}
    bad = f"(ptops-bad-plugins {VERSION}): refused:"
    assert by_name["trl"] == f"trl {bad} engine 'trl' is already provided by ptops {VERSION}"
    assert (
        by_name["sneaky"] == f"sneaky {bad} engine 'titan' is already provided by ptops {VERSION}"
    )
    assert (
        by_name["train"] == f"train {bad} engine name 'train' is a recipe section of ptops itself"
    )
    assert by_name["boom"] == (
        f"boom (ptops-bad-plugins {VERSION}): broken: "
        "RuntimeError: boom: this plugin fails at import on purpose"
    )
    as_json = json.loads(
        run_ptops("recipes", "--json", env=_env(plugins), timeout=120, check=True).stdout
    )
    assert {
        "name": "toy",
        "provider": f"ptops-toy-engine {VERSION}",
        "description": "a 2-layer MLP regression on gloo ranks",
    } in as_json["engines"]
    toy = next(r for r in as_json["recipes"] if r["name"] == "toy-tiny")
    assert toy["engine"] == "toy"
    assert toy["path"] == str(plugins["site"] / "ptops_toy_engine" / "recipes" / "toy-tiny.toml")
    assert sorted((p["name"], p["why"]) for p in as_json["not_loaded"]) == [
        ("boom", "broken"),
        ("sneaky", "refused"),
        ("train", "refused"),
        ("trl", "refused"),
    ]


def test_help_names_installed_engines_without_importing_them(plugins):
    mark = plugins["root"] / "imported.txt"
    for args in (["--help"], ["recipes", "--help"]):
        proc = run_ptops(*args, env=_env(plugins, TOY_IMPORT_MARK=str(mark)), timeout=120)
        assert proc.returncode == 0, proc.stderr
        text = " ".join(proc.stdout.split())  # help text is wrapped to the terminal
        assert "titan, trl (ptops)" in text, proc.stdout
        assert f"toy (ptops-toy-engine {VERSION})" in text, proc.stdout
        # listed as installed (metadata only); `ptops recipes` says which of them did not load
        assert f"boom, sneaky, train (ptops-bad-plugins {VERSION})" in text, proc.stdout
    assert not mark.exists(), "--help imported an engine plugin"
    run_ptops("recipes", env=_env(plugins, TOY_IMPORT_MARK=str(mark)), timeout=120, check=True)
    assert mark.read_text().count("\n") == 1  # `ptops recipes` does import it, once


CHECKS = """
import json
from ptops.recipes.schema import RecipeError, Recipe, load, resolve
out = {"titan-tiny": str(resolve("titan-tiny").path), "fields": sorted(Recipe.model_fields)}
for sets in (["toy.batch=3"], ['trl.trainer="sft"'], ["toy.hidden=12"]):
    try:
        rec, _ = load("toy-tiny", sets)
        out[sets[0]] = rec.toy.hidden
    except RecipeError as e:
        out[sets[0]] = str(e)
print(json.dumps(out))
"""


def test_plugin_section_and_cross_check_validate_like_the_builtins(plugins):
    bad = run_ptops(
        "launch", "toy-tiny", "--dry-run", "--set", "toy.hidden=0", env=_env(plugins), timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "key 'toy.hidden': input should be greater than or equal to 1 (got 0)" in bad.stderr
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS],
        env={**os.environ, **_env(plugins)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["titan-tiny"] == str(
        REPO / "recipes" / "titan-tiny.toml"
    )  # ptops' own file, not the plugin's
    assert {"titan", "trl", "toy"} <= set(out["fields"]) and not {"sneaky", "boom"} & set(
        out["fields"]
    )
    # the plugin's own cross-key check
    assert out["toy.batch=3"].endswith("toy-tiny.toml: key 'toy.batch': must be even (got 3)")
    assert out['trl.trainer="sft"'].endswith("key 'trl': section does not apply to engine \"toy\"")
    assert out["toy.hidden=12"] == 12
    # without the plugin on the path the same name is simply unknown
    gone = run_ptops("launch", "toy-tiny", "--dry-run", timeout=120)
    assert gone.returncode == 2 and "toy-tiny: recipe file not found" in gone.stderr, gone.stderr


@pytest.fixture(scope="module")
def toy_run(plugins):
    """One supervised run of the plugin's recipe: rank 1 crashes at step 3, the supervisor resumes
    at 2."""
    run = plugins["root"] / "toy-run"
    proc = run_ptops(
        "launch",
        "toy-tiny",
        "--supervise",
        "--run-dir",
        str(run),
        "--no-mlflow",
        "--json",
        "--set",
        "train.steps=4",
        "--fault",
        "crash:rank=1,step=3",
        env=_env(plugins),
        timeout=300,
    )
    return proc, run


def test_supervised_plugin_run_completes_and_resumes_after_a_crash(toy_run):
    proc, run = toy_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("crash") == 1 and kinds.count("restart") == 1, kinds
    assert kinds[-1] == "completed" or "completed" in kinds, kinds
    done = next(e for e in events if e["kind"] == "completed")
    assert done["step"] == 4
    saved = sorted(e["step"] for e in events if e["kind"] == "checkpoint")
    assert saved == [2, 4], saved
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rank0 = {r["step"]: r for r in recs if r.get("rank") == 0 and r.get("attempt") == 2}
    assert sorted(rank0) == [3, 4]  # the second attempt resumed after the checkpoint of step 2
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rank0.values())
    log = (run / "logs" / "attempt-2" / "rank-0.log").read_text()
    assert f"toy: resumed from {run / 'checkpoints' / 'step-2'}" in log


def test_plugin_checkpoint_is_a_ptops_checkpoint(toy_run):
    _, run = toy_run
    proc = run_ptops("ckpt", "verify", str(run / "checkpoints" / "step-4"), "--json", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["ok"] and res["kind"] == "dcp" and "manifest-hash" in res["checks"], res
