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
    "faultinject": {"ckpt", "ops/runrecord", "ops/supervisor", "recipes"},  # the last three: chaos.py only
    "ops/rank": {"ops/runrecord", "faultinject", "recipes"},  # recipes: entry.py finds the engine
    "recipes": {"ops/runrecord", "ckpt", "monitors"},
    "ops/supervisor": {"ops/runrecord", "ops/rank", "monitors", "ckpt", "faultinject", "recipes"},
    "ops/obs": {"ops/runrecord", "monitors"},
    "ops/node": {"ops/rank", "ops/supervisor"},  # the wire format; procs and py-spy helpers
    "ops/slurm": {"ops/runrecord", "ops/rank", "ops/supervisor", "faultinject", "recipes"},
    "diagnostics": {"ops/runrecord", "monitors", "ckpt"},
    "ops/pipeline": {"ops/runrecord", "ckpt", "recipes", "faultinject", "ops/obs"},  # stages run as `ptops launch` subprocesses
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
                ok = owner in allowed and (folder != "faultinject" or owner not in CHAOS_ONLY or path.name == "chaos.py")
                if not ok:
                    bad.append(f"{path.relative_to(REPO)} imports {mod} ({folder} may not import {owner})")
    assert not bad, "\n".join(bad)


def test_the_map_names_every_folder_and_every_folder_exists():
    text = (REPO / "ARCHITECTURE.md").read_text()
    for folder in FOLDERS + ["runbooks"]:
        assert (REPO / folder).is_dir(), folder
        assert f"`{folder}/`" in text, f"ARCHITECTURE.md does not describe {folder}/"


def test_the_planner_is_pure():
    """recipes/plan.py imports nothing of ptops and no torch: ``ptops plan`` and the CLI stay light."""
    path = REPO / "recipes" / "plan.py"
    assert _imports(path) == set()
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert mods <= {"__future__", "math", "dataclasses", "typing"}, mods
