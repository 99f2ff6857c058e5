"""``train.init_from``: a run that starts from another run's weights (a pipeline stage's input).

Weights only, before step 0: the optimizer, LR schedule and step count start fresh, because the
stage is a new training run on top of a finished one. The checkpoint is verified deeply (every
file against its manifest) before a rank loads it: a stage must never start from stale or damaged
weights silently. A run that resumes from its own checkpoint ignores ``init_from`` (its own
checkpoint already holds weights that started there).
"""

from __future__ import annotations

from pathlib import Path

from ptops.ckpt import detect_kind, latest_good, verify
from ptops.ops.runrecord import ranklog


class InitFromError(ValueError):
    """One line naming the key, the path and why it cannot be the starting point."""


def resolve(spec: str | Path) -> Path:
    """A checkpoint folder as is, a run directory (or its ``checkpoints/``) -> its newest good
    checkpoint; verified deeply either way. Raises :class:`InitFromError`."""
    p = Path(spec)
    if not p.exists():
        raise InitFromError(f"train.init_from: {p}: no such checkpoint or run directory")
    if detect_kind(p) == "unknown":
        try:
            good = latest_good(p, deep=True)
        except FileNotFoundError:
            good = None
        if good is None:
            raise InitFromError(f"train.init_from: {p}: no good checkpoint there")
        p = Path(good.path)
    res = verify(p, deep=True)
    if not res.ok:
        raise InitFromError(f"train.init_from: {p}: not a good checkpoint ({res.reason})")
    return p


def weights_dir(recipe) -> Path | None:
    """The verified checkpoint a recipe's ``train.init_from`` names, or None when unset."""
    spec = recipe.train.init_from
    if not spec:
        return None
    path = resolve(spec)
    ranklog.get("init_from").info("weights from %s (verified)", path)  # into each rank's log
    return path
