"""Retention: delete old good checkpoints, never the ones that matter.

Kept, whatever the numbers say:
* the checkpoint `LATEST` names and the newest one that verifies;
* the `keep_last` newest valid checkpoints and every valid one whose step is a
  multiple of `keep_every` (when > 0);
* for each step in `keep_before`, the newest valid checkpoint strictly before it: with
  silent-data-corruption checks every N steps, a rollback goes to the newest good checkpoint
  before the last step the replicas agreed on (`monitors/sdc.py`), which `keep_last` alone
  could prune while the run went on (:func:`sdc_rollback_steps`);
* anything with a `.writing` marker or modified in the last `min_age_s` seconds
  (a save may be in flight: shards without `.metadata`, no `trainer_state.json` yet);
* anything invalid: it is left for `quarantine` / `ptops diagnose`, never deleted here.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from ._util import WRITING_MARKER, newest_mtime
from .catalog import _rmtree_safely, checkpoints_dir, list_checkpoints
from .manifest import read_latest


@dataclass
class PruneReport:
    deleted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> why kept
    freed_bytes: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def sdc_rollback_steps(step: int, every: int) -> list[int]:
    """The last three sdc check steps at or before ``step`` (checks every ``every`` steps;
    ``recipes/sdc.py``): a corruption found at the next check rolls back to before one of them,
    and the supervisor may take a check or two to act while the ranks go on saving."""
    if every <= 0:
        return []
    last = step // every * every
    return [s for s in (last, last - every, last - 2 * every) if s > 0]


def prune(
    dir: str | os.PathLike,
    keep_last: int = 3,
    keep_every: int = 0,
    *,
    keep_before: Iterable[int] = (),
    min_age_s: float = 30.0,
    dry_run: bool = False,
) -> PruneReport:
    """Delete valid checkpoints that no rule keeps; see the module doc. `dir` is a
    checkpoints folder or a run directory. Returns what was deleted and why the rest
    was kept."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1 (the latest good checkpoint is always kept)")
    root = checkpoints_dir(dir)
    entries = list_checkpoints(root, deep=False)  # newest first
    rep = PruneReport(dry_run=dry_run)
    latest = read_latest(root)
    latest_name = latest.name if latest else None
    now = time.time()
    n_valid = 0
    latest_good_seen = False
    before = sorted(set(int(s) for s in keep_before))  # each: its newest valid checkpoint < it
    for e in entries:
        p = Path(e.path)
        name = p.name
        why = None
        if (p / WRITING_MARKER).exists():
            why = "save in progress (.writing)"
        elif now - newest_mtime(p) < min_age_s:
            why = f"modified in the last {min_age_s:g}s (may be being written)"
        elif not e.ok:
            why = f"invalid, left for quarantine: {e.reason}"
        elif name == latest_name:
            why = "named by LATEST"
        elif not latest_good_seen:
            why = "latest good"
        elif n_valid < keep_last:
            why = f"among the {keep_last} newest valid"
        elif keep_every > 0 and e.step % keep_every == 0:
            why = f"step is a multiple of {keep_every}"
        elif e.ok and any(e.step < s for s in before):
            why = f"newest before step {min(s for s in before if e.step < s)} (an sdc rollback)"
        if e.ok:
            before = [s for s in before if not e.step < s]  # found: older ones are not needed
            latest_good_seen = True
            n_valid += 1
        if why:
            rep.kept[name] = why
            continue
        rep.deleted.append(name)
        rep.freed_bytes += e.size_bytes
        if not dry_run:
            _rmtree_safely(p)
    return rep
