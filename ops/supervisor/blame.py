"""Which rank failed first: a pure function of what the supervisor saw.

Inputs are plain values, so the races that decide blame are unit-tested with made-up
timestamps: the order of rank goodbyes and channel EOFs (``Blame.note``, fed by the
channel handlers), the text of torchrun's log, and torchrun's exit code.

The channel sees a failure first: a rank killed outright closes its socket at once,
while its peers only fail later inside a collective. torchrun's "Root Cause" is a
fallback only: it picks the earliest *error file*, which a SIGKILLed rank never writes,
so it blames the survivor that raised (seen with crash faults). Among torchrun's
failures, a rank that torchrun itself did not SIGTERM wins.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

# A rank's error goodbye and the EOF of the peer whose death caused it race by milliseconds.
KILLED_PEER_RACE_S = 0.25

GOODBYE = "goodbye"
NO_GOODBYE = "channel closed without goodbye"

_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.M)
# the launcher's line as soon as it sees a child fail (torchrun's and warmlaunch's): the first one
# is the first of its ranks to die
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# warmlaunch writes it once, for the first child it saw fail (torchrun may log several ranks found
# dead in one poll in rank order, so its first line is no order of death; warmlaunch's neither when
# two statuses come in one select)
WARM_FAILED = re.compile(r"\[ptops\.warmlaunch\] failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# ... and one line for each child after it: how it ended
WARM_EXITED = re.compile(r"\[ptops\.warmlaunch\] exited \(exitcode: (-?\d+)\) local_rank: (\d+)")
# how a rank the launcher stopped ends: SIGTERM's default, or a handler's exit 128+15
STOPPED_CODES = (-signal.SIGTERM, 128 + signal.SIGTERM)


@dataclass(frozen=True)
class Bad:
    rank: int
    exit_code: int | None  # None: no goodbye (killed outright)
    how: str
    ts: float  # the supervisor's monotonic receive time
    # no goodbye because the link it came through closed (``LINK_CLOSED``): that node agent's or
    # relay's host, where the failure is (a relay's death ends 64 nodes' ranks at once)
    link: str | None = None


@dataclass
class Blame:
    """The first bad rank of an attempt, as the channel reported it."""

    first: Bad | None = None
    displaced: Bad | None = None  # the error goodbye a silent exit right after it displaced

    def note(
        self, rank: int, code: int | None, how: str, ts: float, link: str | None = None
    ) -> None:
        """Keep the first failure, except that a rank killed outright (no goodbye) right
        after a peer's error goodbye is the likelier cause: the peer's error is usually
        "connection closed by peer", raised within milliseconds of the kill."""
        if self.first is None:
            self.first = Bad(rank, code, how, ts, link)
        elif (
            self.first.how == GOODBYE and code is None and ts - self.first.ts <= KILLED_PEER_RACE_S
        ):
            self.displaced = self.first
            self.first = Bad(rank, code, how, ts, link)

    def link_of(self, rank: int | None) -> str | None:
        """The host of the link whose closing ended ``rank`` (the first failure), else None."""
        first = self.first
        return first.link if first is not None and first.rank == rank else None


def torchrun_failures(log_text: str) -> list[tuple[int, int]]:
    """(rank, exitcode) of every failure block in torchrun's log, in its order."""
    return [(int(m.group(1)), int(m.group(2))) for m in _FAILURE.finditer(log_text)]


def root_cause(
    first: Bad | None, log_text: str, torchrun_rc: int | None, displaced: Bad | None = None
) -> tuple[int | None, int | None, str]:
    """(rank, exit code, how it was determined) of the rank that failed first.

    ``displaced``: the error goodbye that ``first``, a silent exit just after it, displaced
    (``Blame.note``). The launcher decides between them: when it stopped the silent one (torchrun's
    failure block says SIGTERM; warmlaunch named the goodbye's rank ``failed`` and the silent one
    ``exited`` with SIGTERM's code), the silent one died after it, not before (a plain launch under
    load). The ``failed`` line alone is no order of death: two statuses ready in one ``select`` come
    in rank order (a SIGKILLed rank 1 and the rank 0 it failed, CI 2026-12-04)."""
    failures = torchrun_failures(log_text)
    ended = {int(e.group(2)): int(e.group(1)) for e in WARM_EXITED.finditer(log_text)}
    m = WARM_FAILED.search(log_text)
    if m is not None:
        ended[int(m.group(2))] = int(m.group(1))
    if first is not None and displaced is not None and first.how == NO_GOODBYE:
        stopped = dict(failures).get(first.rank) == -signal.SIGTERM  # torchrun's own stop
        warm_stopped = (
            m is not None
            and int(m.group(2)) == displaced.rank
            and ended.get(first.rank) in STOPPED_CODES
        )
        if stopped or warm_stopped:
            return displaced.rank, displaced.exit_code, displaced.how
    if first is not None:
        codes = {**ended, **dict(failures)}
        code = first.exit_code if first.exit_code is not None else codes.get(first.rank)
        return first.rank, code, first.how
    for rank, code in failures:
        if code != -signal.SIGTERM:
            return rank, code, "torchrun"
    if failures:
        return failures[0][0], failures[0][1], "torchrun"
    return None, torchrun_rc, "torchrun exit code"
