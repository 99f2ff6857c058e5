"""The engine registry: adding an engine touches one folder, here or in another distribution.

Each built-in engine is a sub-package of ``ptops.recipes`` whose ``__init__`` calls :func:`register`
with its recipe section (a pydantic model, no torch import), its rules that span sections,
and the ``module:function`` that each rank runs. The schema builds the ``Recipe`` model from
this registry, so ``[<engine>]`` sections, validation and the rank entry point all follow.

An engine from another distribution registers through the entry point group ``ptops.engines``
(:data:`GROUP`): the entry point's name is the engine's name, its value ``module:ATTR`` names an
:class:`Engine` (or just ``module``, whose import calls :func:`register`). Built-ins load first and
keep their names: a plugin never shadows ``titan`` or ``trl``, and a plugin that fails to load is
recorded in :func:`not_loaded` (one line) instead of breaking every ptops command.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

GROUP = "ptops.engines"

# (recipe) -> None, or (key, what was expected) for one clear error line
CrossCheck = Callable[[Any], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Engine:
    name: str  # also the recipe section's name: [titan], [trl]
    section: type  # pydantic model of that section
    entry: str  # "package.module:function" called as function(recipe, probe) inside every rank
    check: CrossCheck | None = None
    description: str = ""
    # "module:function" -> (recipe) -> [sidecar dicts] (ops/supervisor/sidecar.py); imported in the
    # CLI: keep it light
    sidecars: str | None = None
    # a folder of <name>.toml recipes this engine ships (`ptops launch NAME`); ptops' own names win
    # a clash
    recipes_dir: str | os.PathLike | None = None
    # the run is complete when every rank exits 0, whatever step it reached (a user's script decides
    # its own length; the recipe's train.steps then only sizes the progress line)
    complete_on_exit: bool = False


@dataclass(frozen=True)
class NotLoaded:
    """A plugin entry point that gave no engine: refused (name taken or invalid) or broken (it
    raised)."""

    name: str  # the entry point's name
    provider: str  # "distribution version"
    why: str  # "refused" or "broken"
    error: str  # one line


_ENGINES: dict[str, Engine] = {}
_PROVIDERS: dict[str, str] = {}  # engine name -> "distribution version"
_NOT_LOADED: list[NotLoaded] = []
_RESERVED: set[str] = (
    set()
)  # names an engine cannot take (the recipe's own sections: train, launch, ...)
_discovered = False
_loading: str | None = None  # provider of the plugin being loaded now


class _Refused(Exception):
    pass


def _ptops_provider() -> str:
    from ptops import __version__

    return f"ptops {__version__}"


def _name_problem(name: Any) -> str | None:
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or name.startswith("_")
        or name != name.lower()
    ):
        return f"engine name {name!r} is not a lowercase identifier (it is the recipe's [section])"
    if name in _RESERVED:
        return f"engine name {name!r} is a recipe section of ptops itself"
    if name in _ENGINES:
        return f"engine {name!r} is already provided by {_PROVIDERS.get(name, 'ptops')}"
    return None


def register(engine: Engine) -> Engine:
    if _loading is None:  # ptops' own engines (its sub-packages)
        _ENGINES[engine.name] = engine
        _PROVIDERS[engine.name] = _ptops_provider()
        return engine
    problem = _name_problem(engine.name)
    if problem is None:
        problem = _shape_problem(engine)
    if problem is not None:
        raise _Refused(problem)
    _ENGINES[engine.name] = engine
    _PROVIDERS[engine.name] = _loading
    return engine


def _shape_problem(engine: Any) -> str | None:
    """What a plugin's Engine gets wrong that would otherwise fail later, inside the schema or every
    rank."""
    from pydantic import BaseModel

    if not (isinstance(engine.section, type) and issubclass(engine.section, BaseModel)):
        return f"engine {engine.name!r}: section is not a pydantic model"
    for what, spec in (("entry", engine.entry), ("sidecars", engine.sidecars)):
        if spec is not None and (not isinstance(spec, str) or not all(spec.partition(":")[::2])):
            return f"engine {engine.name!r}: {what} {spec!r} is not 'module:function'"
    if engine.check is not None and not callable(engine.check):
        return f"engine {engine.name!r}: check is not callable"
    return None


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, _Refused) else str(e)
    return " ".join(text.split())[:300]


def builtin_names() -> list[str]:
    """ptops' own engines (its sub-packages), without importing them."""
    import ptops.recipes as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)


def installed() -> list[tuple[str, str]]:
    """(engine name, "distribution version") of ptops' own engines and every plugin entry point that
    does not take a built-in name, read from the installed metadata without importing any plugin:
    for ``--help``."""
    own = builtin_names()
    found = [(name, _ptops_provider()) for name in own]
    for ep in metadata.entry_points(group=GROUP):
        if ep.name not in own:
            found.append(
                (ep.name, f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?")
            )
    return found


def _load_plugins() -> None:
    global _loading
    eps = sorted(
        metadata.entry_points(group=GROUP),
        key=lambda ep: (ep.name, ep.dist.name if ep.dist else ""),
    )
    for ep in eps:
        provider = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        problem = _name_problem(ep.name)
        if problem is not None:  # refused before its code runs
            _NOT_LOADED.append(NotLoaded(ep.name, provider, "refused", problem))
            continue
        before = set(_ENGINES)
        _loading = provider
        try:
            obj = ep.load()
            if isinstance(obj, Engine) and _ENGINES.get(obj.name) is not obj:
                register(obj)
            added = set(_ENGINES) - before
            if ep.name not in added:
                raise _Refused(
                    f"entry point {ep.name!r} registered no engine of that name "
                    f"(registered: {', '.join(sorted(added)) or 'none'})"
                )
        except (Exception, SystemExit) as e:  # a plugin must never break ptops
            for name in set(_ENGINES) - before:
                del _ENGINES[name]
                _PROVIDERS.pop(name, None)
            why = "refused" if isinstance(e, _Refused) else "broken"
            _NOT_LOADED.append(NotLoaded(ep.name, provider, why, _one_line(e)))
        finally:
            _loading = None


def discover() -> None:
    """Import every engine sub-package of ``ptops.recipes`` once (their ``__init__`` registers),
    then the plugins of the ``ptops.engines`` entry point group."""
    global _discovered
    if _discovered:
        return
    _discovered = (
        True  # first: a plugin that asks for the registry while it loads gets what is there so far
    )
    import ptops.recipes as pkg

    try:
        for mod in pkgutil.iter_modules(pkg.__path__):
            if mod.ispkg:
                importlib.import_module(f"{pkg.__name__}.{mod.name}")
    except BaseException:
        _discovered = (
            False  # ptops' own engine failed to import: a real error, raised on every call
        )
        raise
    _load_plugins()


def reserve(names: set[str] | frozenset[str] | Any) -> None:
    """Names no plugin engine may take (the schema's own sections); a plugin that took one is
    dropped."""
    _RESERVED.update(names)
    for name in [n for n in _ENGINES if n in _RESERVED and _PROVIDERS.get(n) != _ptops_provider()]:
        del _ENGINES[name]
        provider = _PROVIDERS.pop(name, "?")
        why = f"engine name {name!r} is a recipe section of ptops itself"
        _NOT_LOADED.append(NotLoaded(name, provider, "refused", why))


def engines() -> dict[str, Engine]:
    discover()
    return dict(sorted(_ENGINES.items()))


def provider(name: str) -> str:
    """The distribution (and version) an engine comes from: ``ptops 0.1.0`` for the built-ins."""
    discover()
    return _PROVIDERS.get(name, "?")


def not_loaded() -> list[NotLoaded]:
    discover()
    return list(_NOT_LOADED)


def recipe_dirs() -> list[Path]:
    """The folders of recipes the engines ship, in engine-name order (ptops' own folder is the
    schema's)."""
    return [Path(e.recipes_dir) for e in engines().values() if e.recipes_dir is not None]


def get(name: str) -> Engine:
    found = engines().get(name)
    if found is None:
        raise KeyError(name)
    return found


def sidecar_specs(recipe: Any) -> list[dict[str, Any]]:
    """The sidecar processes (e.g. a vLLM server) the recipe's engine asks the launcher to keep."""
    hook = get(recipe.engine).sidecars
    if not hook:
        return []
    module, _, func = hook.partition(":")
    return list(getattr(importlib.import_module(module), func)(recipe))


def entry_point(name: str) -> Callable[[Any, Any], None]:
    """The adapter's ``main(recipe, probe)``, imported only now (inside the rank: torch and all)."""
    module, _, func = get(name).entry.partition(":")
    return getattr(importlib.import_module(module), func)
