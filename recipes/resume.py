"""Where a rank's engine resumes: :func:`ptops.ckpt.resume_point`, with its findings reported the
same way by every adapter (a log line in the rank's log, ``checkpoint_invalid`` through the
probe)."""

from __future__ import annotations

from typing import Any, Callable

from ptops.ckpt import Entry, resume_point
from ptops.ops.runrecord.events import EventKind


def resume_entry(
    ckpt_dir: Any,
    *,
    probe: Any,
    world_size: int,
    versions: dict[str, str],
    log: Callable[[str], None],
) -> Entry | None:
    """The checkpoint to resume from (None: from scratch); invalid newer ones quarantined and
    reported."""

    def report(**invalid: Any) -> None:
        log(
            f"checkpoint {invalid['path']} is not good ({invalid['reason']}); moved to "
            f"{invalid['moved_to']}"
        )
        if probe is not None:
            probe.event(EventKind.CHECKPOINT_INVALID, **invalid)

    entry = resume_point(
        ckpt_dir, deep=True, on_invalid=report, world_size=world_size, versions=versions
    )
    if entry is not None and entry.reason:
        log(f"{entry.path}: {entry.reason}")
    return entry
