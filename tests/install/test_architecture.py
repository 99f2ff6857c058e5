"""ARCHITECTURE.md's table, enforced: which folder may import which (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# folder -> the other ptops folders its modules may import (ARCHITECTURE.md, "Folders ...")
ALLOWED: dict[str, set[str]] = {
    "ops/runrecord": set(),
    "monitors": set(),
    "ckpt": set(),
    "faultinject": {
        "ckpt",
        "ops/runrecord",
        "ops/supervisor",
        "recipes",
    },  # the last three: chaos.py only
    "ops/rank": {"ops/runrecord", "faultinject", "recipes"},  # recipes: entry.py finds the engine
    "recipes": {"ops/runrecord", "ckpt", "monitors"},
    "ops/supervisor": {"ops/runrecord", "ops/rank", "monitors", "ckpt", "faultinject", "recipes"},
    "ops/obs": {"ops/runrecord", "monitors"},
    "ops/node": {"ops/rank", "ops/supervisor"},  # the wire format; procs and py-spy helpers
    "ops/slurm": {"ops/runrecord", "ops/rank", "ops/supervisor", "faultinject", "recipes"},
    "diagnostics": {"ops/runrecord", "monitors", "ckpt"},
    "ops/pipeline": {
        "ops/runrecord",
        "ckpt",
        "recipes",
        "faultinject",
        "ops/obs",
    },  # stages run as `ptops launch` subprocesses
}
CHAOS_ONLY = {"ops/runrecord", "ops/supervisor", "recipes"}
FOLDERS = [*ALLOWED, "ops/cli"]


def _owner(module: str) -> str | None:
    name = module.removeprefix("ptops.").replace(".", "/")
    hits = [f for f in FOLDERS if name == f or name.startswith(f + "/")]
    return max(hits, key=len) if hits else None


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("ptops.")}


def test_every_folder_imports_only_what_the_map_allows():
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in (REPO / folder).rglob("*.py"):
            for mod in _imports(path):
                owner = _owner(mod)
                if owner is None or owner == folder:
                    continue
                ok = owner in allowed and (
                    folder != "faultinject" or owner not in CHAOS_ONLY or path.name == "chaos.py"
                )
                if not ok:
                    bad.append(
                        f"{path.relative_to(REPO)} imports {mod} ({folder} may not import {owner})"
                    )
    assert not bad, "\n".join(bad)


def test_the_map_names_every_folder_and_every_folder_exists():
    text = (REPO / "ARCHITECTURE.md").read_text()
    for folder in FOLDERS + ["runbooks"]:
        assert (REPO / folder).is_dir(), folder
        assert f"`{folder}/`" in text, f"ARCHITECTURE.md does not describe {folder}/"


def test_the_planner_is_pure():
    """recipes/plan.py imports nothing of ptops and no torch: ``ptops plan`` and the CLI stay
    light."""
    path = REPO / "recipes" / "plan.py"
    assert _imports(path) == set()
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert mods <= {"__future__", "math", "dataclasses", "typing"}, mods


TEST_HOOK = "PTOPS_" + "TEST_"  # spelled in two parts so that this file never matches its own scan


def _production_folders() -> list[Path]:
    """Every folder shipped in the package (``[tool.setuptools] package-dir``) plus ``scripts/``."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({REPO / d for d in setuptools["package-dir"].values()} | {REPO / "scripts"})


def _hook_names(folders: list[Path]) -> list[str]:
    hits = []
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if (
                path.is_file()
                and "__pycache__" not in path.parts
                and TEST_HOOK.encode() in path.read_bytes()
            ):
                lines = path.read_text(errors="replace").splitlines()
                hits += [
                    f"{path.relative_to(folder.parent)}:{i}: {ln.strip()}"
                    for i, ln in enumerate(lines, 1)
                    if TEST_HOOK in ln
                ]
    return hits


def test_no_test_hooks_in_production_folders(tmp_path):
    """Test-only switches (``PTOPS_TEST_*`` environment names) stay out of what ships: a test holds
    a run with a fault kind a user could use too (``faultinject/spec.py``), or does its trick in the
    test."""
    folders = _production_folders()
    names = {p.relative_to(REPO).as_posix() for p in folders}
    assert {"ops", "recipes", "faultinject", "ptops", "scripts"} <= names, names
    assert all(p.is_dir() for p in folders), folders
    planted = tmp_path / "pkg" / "mod.py"  # the scan finds what it looks for
    planted.parent.mkdir()
    planted.write_text(f'X = "{TEST_HOOK}SOMETHING"\n')
    assert len(_hook_names([planted.parent])) == 1
    hits = _hook_names(folders)
    assert not hits, (
        "test hooks in production code (a fault kind, or keep it in tests/):\n" + "\n".join(hits)
    )


# rank-side code whose stdout is a protocol or a program's output, not a log line
PRINT_OK = {
    "recipes/titan/dryrun.py": "the PTOPS_DRYRUN result line the CLI parses",
    "recipes/trl/dryrun.py": "the PTOPS_DRYRUN result line the CLI parses",
    "recipes/trl/rejection.py": "a command-line tool: its JSON result and one error line",
    "recipes/trl/sandbox.py": "the sandbox launcher's JSON answer to its parent",
    "ops/rank/warmlaunch.py": "torchrun's lines, mimicked: the supervisor reads their exit codes",
}


def _prints(paths: list[Path]) -> list[str]:
    import ast

    hits = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return hits


def test_rank_side_code_logs_through_ranklog():
    """What ptops says inside a rank goes through ``ops/runrecord/ranklog.py`` (one format:
    ``[ptops.COMPONENT rank R] message``), not ``print``: one format to grep at 03:00."""
    rank_side = [*(REPO / "ops" / "rank").glob("*.py"), *(REPO / "recipes").rglob("*.py")]
    rank_side += [REPO / "faultinject" / "inject.py", REPO / "ptops" / "rank.py"]
    paths = [p for p in rank_side if p.relative_to(REPO).as_posix() not in PRINT_OK]
    assert len(paths) > 20 and all(p.exists() for p in paths)
    assert all((REPO / p).exists() for p in PRINT_OK)
    hits = _prints(paths)
    assert not hits, "print in rank-side code (use ptops.ops.runrecord.ranklog):\n" + "\n".join(
        hits
    )
