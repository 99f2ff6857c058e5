"""The engine registry: adding an engine touches one folder.

Each engine is a sub-package of ``ptops.recipes`` whose ``__init__`` calls :func:`register`
with its recipe section (a pydantic model, no torch import), its rules that span sections,
and the ``module:function`` that each rank runs. The schema builds the ``Recipe`` model from
this registry, so ``[<engine>]`` sections, validation and the rank entry point all follow.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

# (recipe) -> None, or (key, what was expected) for one clear error line
CrossCheck = Callable[[Any], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Engine:
    name: str  # also the recipe section's name: [titan], [trl]
    section: type  # pydantic model of that section
    entry: str  # "package.module:function" called as function(recipe, probe) inside every rank
    check: CrossCheck | None = None
    description: str = ""
    # "module:function" -> (recipe) -> [sidecar dicts] (ops/supervisor/sidecar.py); imported in the CLI: keep it light
    sidecars: str | None = None


_ENGINES: dict[str, Engine] = {}
_discovered = False


def register(engine: Engine) -> Engine:
    _ENGINES[engine.name] = engine
    return engine


def discover() -> None:
    """Import every engine sub-package of ``ptops.recipes`` once (their ``__init__`` registers)."""
    global _discovered
    if _discovered:
        return
    import ptops.recipes as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.ispkg:
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
    _discovered = True


def engines() -> dict[str, Engine]:
    discover()
    return dict(sorted(_ENGINES.items()))


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
