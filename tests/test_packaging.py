"""The distribution lists every package, so a non-editable install is complete too."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            if "__pycache__" in rel.parts or "tests" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"add to pyproject packages: {sorted(found - listed)}"

