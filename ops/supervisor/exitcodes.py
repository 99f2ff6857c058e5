"""The exit codes of ``ptops launch`` (plain or ``--supervise``, local or Slurm): one table.

Why one table: a scheduler, a wrapper script and a person at 03:00 each act on the code alone, and
every path that ends a run (the run loop, the restart policy, finding actions, the Slurm hooks, the
CLI's summary and ``docs/exit-codes.md``) must mean the same thing by it. Pure data, no imports of
ptops, so the docs test and any caller read it without starting anything.

The split follows what a scheduler can do about the run, as NVIDIA's ft_launcher does (its
``--ft-no-restart-exit-code``, default 93, means "NVRx decided: do not requeue"; an exhausted
``--max-restarts`` stays exit 1, requeue left to the scheduler): ptops' 3, 4 and 5 are that verdict,
split by what a person should do next; 1 is the spent budget of one allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPLETED = 0
FAILED_MAY_REQUEUE = 1
BAD_INPUT = 2
NO_PROGRESS = 3
MISCONFIGURED = 4
RESUBMITTED = 5
STOPPED_SIGINT = 130
STOPPED_SIGTERM = 143


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    requeue: str  # what a scheduler should do: "yes", "no", "no (done)", ...
    means: str  # when ptops exits with it
    nvrx: str  # what NVIDIA's ft_launcher does in the same situation


TABLE: tuple[ExitCode, ...] = (
    ExitCode(
        COMPLETED,
        "completed",
        "no (done)",
        "every step trained and recorded, final checkpoint written; also a Slurm batch step that "
        "saved on the warning signal and requeued its own job (scontrol requeue)",
        "0",
    ),
    ExitCode(
        FAILED_MAY_REQUEUE,
        "failed_may_requeue",
        "yes",
        "gave up in this allocation: supervisor.restart.max_restarts spent, a plain launch's crash "
        "or hang, a supervisor error; a requeue (e.g. on other nodes) may help",
        "1 (--max-restarts spent; requeue left to the scheduler)",
    ),
    ExitCode(
        BAD_INPUT,
        "bad_input",
        "no",
        "refused before any rank started: recipe, --set, --fault, or the run directory is locked "
        "by another supervisor (one error: line names the file, key and expectation)",
        "torchrun's argument errors (1 or 2)",
    ),
    ExitCode(
        NO_PROGRESS,
        "no_progress",
        "no",
        "ptops decided a rerun would fail the same way: restart storm, restarts without progress "
        "(no newer good checkpoint or script save, no step further), the same error at the same "
        "step twice in a row, a monitor finding whose action is stop, rollbacks spent",
        "93 (no-restart: attribution stop, or no progress across cycles)",
    ),
    ExitCode(
        MISCONFIGURED,
        "misconfigured",
        "no",
        "the job itself is wrong, not the nodes or the luck: a world of the wrong size, an "
        "ImportError / ModuleNotFoundError / SyntaxError before the first step, the same error on "
        "every rank before its first step, the recipe's engine not installed; fix, then relaunch",
        "1 (restarted until --max-restarts)",
    ),
    ExitCode(
        RESUBMITTED,
        "resubmitted",
        "no (already resubmitted)",
        "Slurm: a node was blamed and no spare was left; ptops submitted a new job with --exclude "
        "of the blamed nodes and this job ends (the new job adopts the run directory)",
        "no equivalent (hot spares inside the job; exclusion is the scheduler's)",
    ),
    ExitCode(
        STOPPED_SIGINT,
        "stopped_sigint",
        "no (stopped by request)",
        "Ctrl-C: ranks asked to save, then stopped; relaunching resumes from that save",
        "130",
    ),
    ExitCode(
        STOPPED_SIGTERM,
        "stopped_sigterm",
        "the scheduler's call (preemption, scancel)",
        "SIGTERM: ranks asked to save, then stopped; relaunching resumes from that save",
        "143",
    ),
)

BY_CODE = {e.code: e for e in TABLE}


def describe(code: int) -> ExitCode | None:
    """The table's row for ``code``; None for a code ptops does not define."""
    return BY_CODE.get(code)


def stopped(signum: int) -> int:
    """A run stopped by a signal: 130 for SIGINT, else 143 (SIGTERM; also Slurm's USR1 warning when
    the requeue after it failed), so no code outside the table reaches a scheduler."""
    return STOPPED_SIGINT if signum == 2 else STOPPED_SIGTERM


def requeue_may_help(code: int) -> bool:
    """Whether a scheduler should requeue on ``code`` (only the spent-budget failure)."""
    return code == FAILED_MAY_REQUEUE
