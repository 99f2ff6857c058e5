"""Where a TRL rank runs: its process group and its device. Shared by the adapter (``run.py``) and
the catalogue's trainers (``catalogue.py``), so neither imports the other's internals; torch is
imported on the first call (a rank's start-up imports it once, where it pays)."""

from __future__ import annotations

from typing import Any


def dist() -> Any:
    """``torch.distributed`` when this process is in an initialised process group, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()
