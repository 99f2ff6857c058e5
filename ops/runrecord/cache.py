"""Where ptops keeps what it builds once and reuses on this machine: ``$PTOPS_CACHE`` (default
``~/.cache/ptops``). The recipes' assets (``recipes/assets.py``) and MLflow's empty store
(``ops/obs/mlflow_export.py``) live there; both check what they read and rebuild what does not."""

from __future__ import annotations

import os
from pathlib import Path

# ptops/envnames.py's CACHE, spelled here because runrecord imports nothing of ptops
CACHE_ENV = "PTOPS_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "ptops"))
