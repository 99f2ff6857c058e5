"""``ptops/envnames.py``: every ``PTOPS_*`` name that crosses a process boundary, spelled once.

A name misspelt on one side of a process boundary shows only at run time, so the code takes each
name from that module and this test keeps the spelling in one place."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from conftest import REPO

from ptops import envnames

NAME = re.compile(r"PTOPS_[A-Z0-9_]+")
# files that still spell a name: ckpt/ and ops/runrecord/ import nothing of ptops (their constants
# are checked below); the others were being edited elsewhere when the names moved here
LEFT = {
    "ckpt/lifecycle.py",
    "ops/runrecord/cache.py",
    "ops/supervisor/sidecar.py",
    "faultinject/",
    "recipes/trl/",
    "diagnostics/",
}


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(envnames).items() if k.isupper() and isinstance(v, str)}


def _code_files() -> list[Path]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {REPO / d for d in setuptools["package-dir"].values()} | {REPO / "bench"}
    return sorted(p for d in folders for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def _left(rel: str) -> bool:
    return any(rel == x or (x.endswith("/") and rel.startswith(x)) for x in LEFT)


def test_the_module_imports_nothing_and_names_itself():
    tree = ast.parse((REPO / "ptops" / "envnames.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = _names()
    assert len(names) >= 40
    for attr, value in names.items():
        assert value == "PTOPS_" + attr or (attr, value) == ("DRYRUN_LINE", "PTOPS_DRYRUN"), attr
    assert len(set(names.values())) == len(names)


def test_the_leaves_keep_the_same_spelling():
    from ptops.ckpt import RESUME_ENV
    from ptops.ops.runrecord.cache import CACHE_ENV

    assert RESUME_ENV == envnames.RESUME_FROM
    assert CACHE_ENV == envnames.CACHE


def test_no_code_spells_a_name_outside_the_module():
    hits = []
    for path in _code_files():
        rel = path.relative_to(REPO).as_posix()
        if rel == "ptops/envnames.py" or _left(rel):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
                if NAME.fullmatch(text.rstrip("= ")):
                    hits.append(f"{rel}:{node.lineno}: {text!r}")
    assert not hits, "use ptops.envnames:\n" + "\n".join(hits)


def test_every_name_is_used():
    texts = {p.relative_to(REPO).as_posix(): p.read_text() for p in _code_files()}
    unused = []
    for attr, value in _names().items():
        use = re.compile(rf"\benvnames\.{attr}\b")
        used = any(use.search(t) for r, t in texts.items() if r != "ptops/envnames.py")
        left = any(f'"{value}"' in t for r, t in texts.items() if _left(r))
        if not (used or left):
            unused.append(attr)
    assert not unused, unused
