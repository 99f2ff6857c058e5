"""The run states a supervisor writes, and the transitions between them: a table, checked.

Every state change of :class:`~ptops.ops.supervisor.core.Supervisor` (and of the Slurm one,
``ops/slurm/inside.py``) goes through ``Supervisor.transition(to, why)``, and ``why`` names a
row of :data:`TRANSITIONS`: the reason, the states it may leave and the state it enters. The
table was read off the code (each former ``self.state = ...`` and what could run before it);
``docs/architecture-details.md`` renders it (``render_markdown``; a test keeps them equal).

The spelling of the states is :class:`~ptops.ops.runrecord.events.RunState` (status.json,
``ptops status``, events, exporters); this module adds no name. The enum splits in two:

- :data:`SUPERVISOR_STATES`: what a supervisor writes into ``status.json`` (the table's states).
- :data:`READER_STATES`: what only a reader derives, never a supervisor: ``new`` (a run directory
  nobody launched: ``ptops status``, the reducer), ``dead`` (``ptops status``: a live state with no
  lock holder), and the exporters' view of the latest event (``RunView.event_state`` in
  ``ops/runrecord/events.py``, ``ops/obs/prometheus.py``): ``hung``, ``crashed``,
  ``rolling_back`` (they stand until the next launch or end event).

``ptops status`` prints one text that is no state: ``unknown (unsupervised run; no status.json)``
(a launch event, no status.json, no lock holder).

A transition that is not in the table is a bookkeeping bug, never a reason to end a run: the
supervisor logs one line (``ptops: state ...: not in the table``) and takes the new state anyway.
A supervisor whose ``strict_transitions`` is set raises :class:`TransitionError` instead (the
test suite sets it for the supervisors it runs in its own process, tests/conftest.py); supervisors
a test starts as subprocesses log and record it (``ok: false`` in ``transitions.jsonl``), which the
tests of real runs check. A change to
the same state is not a transition (repeated checkpoint beats, attempt 1's launch): nothing is
checked or recorded.

Each transition is kept: the last :data:`HISTORY_LEN` in ``Supervisor.transitions`` and one JSON
line each in ``supervisor/transitions.jsonl`` of the run directory (``ts``, ``pid``, ``attempt``,
``from``, ``to``, ``why``, ``ok``), across the supervisors of the run.

When a failed attempt is restarted is data too: ``policy.RestartSpec`` (strategy, max restarts,
the storm window, the no-progress rule, the backoff), built once from ``[supervisor.restart]`` and
the launch's strategy; the ``restart`` and ``gave_up`` rows below are its two answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptops.ops.runrecord.events import RunState

S = RunState

SUPERVISOR_STATES = frozenset(
    {
        S.STARTING,
        S.RUNNING,
        S.CHECKPOINTING,
        S.COLLECTING_STACKS,
        S.STOPPING,
        S.RESTARTING,
        S.COMPLETED,
        S.FAILED,
        S.STOPPED,
    }
)
# derived by readers only (see the module's docstring): status / reducer, and the exporters' view
STATUS_ONLY_STATES = frozenset({S.NEW, S.DEAD})
EXPORTER_ONLY_STATES = frozenset({S.HUNG, S.CRASHED, S.ROLLING_BACK})
READER_STATES = STATUS_ONLY_STATES | EXPORTER_ONLY_STATES

INITIAL = S.STARTING  # a supervisor starts here (``Supervisor.__init__``)
HISTORY_LEN = 64

# the states an attempt can end in (what ``run_attempt`` may leave behind)
_ATTEMPT = (S.STARTING, S.RUNNING, S.CHECKPOINTING, S.COLLECTING_STACKS)


@dataclass(frozen=True)
class Transition:
    why: str  # the reason's name (``Supervisor.transition(to, why)``)
    sources: tuple[RunState, ...]  # the states it may leave
    to: RunState
    where: str  # the code that makes it
    doc: str


# The table. One row a reason; the rows marked "(today)" are what the code does, kept as it was,
# though a reader may not expect them (see the issue note of issue 50).
TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        "already_complete", (S.STARTING,), S.COMPLETED, "core._run_locked",
        "the run directory's run had already completed: nothing to do",
    ),
    Transition(
        "unhealthy", (S.STARTING, S.RESTARTING), S.FAILED, "core.unhealthy",
        "the health checks before an attempt failed (every node, under Slurm)",
    ),
    Transition(
        "launch", (S.RESTARTING,), S.STARTING, "attempt.run_attempt",
        "an attempt's ranks are started (attempt 1 is already starting)",
    ),
    Transition(
        "all_ranks_hello", (S.STARTING,), S.RUNNING, "messages._on_hello",
        "every rank of the world said hello",
    ),
    Transition(
        "first_record", (S.STARTING,), S.RUNNING, "messages._rank0_record",
        "rank 0's first step record",
    ),
    Transition(
        "checkpoint_begun", (S.STARTING, S.RUNNING, S.STOPPING, S.COLLECTING_STACKS),
        S.CHECKPOINTING, "messages._checkpoint_beat",
        "rank 0 entered a save's blocking part (today also while stopping - the stop asks for a "
        "save - and, under Slurm, collecting stacks: the agents' kill pumps the ranks' messages)",
    ),
    Transition(
        "checkpoint_done", (S.CHECKPOINTING, S.STOPPING, S.COLLECTING_STACKS), S.RUNNING,
        "messages._checkpoint_beat",
        "rank 0 began the step after the save (today also while stopping or collecting stacks)",
    ),
    Transition(
        "hang", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.COLLECTING_STACKS, "hangs.on_hang",
        "the hang monitor found silent ranks: their stacks are taken",
    ),
    Transition(
        "stop_signal", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.STOPPING, "stop.graceful_stop",
        "SIGINT / SIGTERM / Slurm's USR1: ranks asked to save, then stopped",
    ),
    Transition(
        "completed", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.COMPLETED, "core._run_locked",
        "the attempt's script exited 0 with every step recorded",
    ),
    Transition(
        "finding_rollback", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.RESTARTING,
        "core._run_locked (actions.after_attempt)",
        "a monitor finding's rollback: the next attempt resumes from an earlier checkpoint",
    ),
    Transition(
        "finding_stop", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.FAILED,
        "core._run_locked (actions.after_attempt)",
        "a monitor finding's stop, or the rollbacks are spent",
    ),
    Transition(
        "misconfigured", (S.STARTING, S.RUNNING, S.CHECKPOINTING), S.FAILED, "core._run_locked",
        "the ranks formed another world than the launcher asked for",
    ),
    Transition(
        "interrupted", (S.STOPPING, S.CHECKPOINTING, S.RUNNING), S.STOPPED, "core._run_locked",
        "the stopped attempt is torn down (from checkpointing / running: a save during the stop)",
    ),
    Transition(
        "gave_up", _ATTEMPT, S.FAILED, "core._run_locked (policy.RestartPolicy.decide: stop)",
        "a crash, hang or early exit the restart policy does not restart",
    ),
    Transition(
        "restart", _ATTEMPT, S.RESTARTING, "core._run_locked (RestartPolicy.decide: restart)",
        "a crash, hang or early exit restarted after the policy's backoff",
    ),
    Transition(
        "stopped_in_backoff", (S.RESTARTING,), S.STOPPED, "core._run_locked",
        "a signal during the restart backoff",
    ),
    Transition(
        "resubmitted", (*_ATTEMPT, S.RESTARTING), S.RESTARTING,
        "slurm.inside._resubmit_without",
        "Slurm: a node blamed (a crash or hang, a health check, a short allocation) and no spare "
        "left: the job is resubmitted without it and this supervisor ends (exit 5)",
    ),
    Transition(
        "requeued", (S.STOPPING, S.CHECKPOINTING, S.RUNNING), S.RESTARTING,
        "slurm.inside._requeue_after_preemption",
        "Slurm's warning signal: saved, the job requeued, this supervisor ends",
    ),
    Transition(
        "supervisor_error", tuple(sorted(SUPERVISOR_STATES)), S.FAILED, "core.run_all",
        "a bug in the supervisor (an exception): the run ends failed, no process left",
    ),
)  # fmt: skip

BY_WHY: dict[str, Transition] = {t.why: t for t in TRANSITIONS}
# state -> the states it may go to -> the reasons
ALLOWED: dict[RunState, dict[RunState, tuple[str, ...]]] = {
    s: {} for s in sorted(SUPERVISOR_STATES)
}
for _t in TRANSITIONS:
    for _s in _t.sources:
        if _s == _t.to:  # the same state again is no transition (``Supervisor.transition``)
            continue
        ALLOWED[_s][_t.to] = (*ALLOWED[_s].get(_t.to, ()), _t.why)


class TransitionError(RuntimeError):
    """A state change the table does not allow (raised under pytest only)."""


def allowed(source: str, to: str, why: str) -> bool:
    """Whether ``why`` is a row of the table that leaves ``source`` for ``to``."""
    t = BY_WHY.get(why)
    return t is not None and t.to == to and source in t.sources


def render_markdown() -> str:
    """The table as ``docs/architecture-details.md`` shows it (one line a reason)."""
    lines = [
        "| from | to | why | where |",
        "| --- | --- | --- | --- |",
    ]
    for t in TRANSITIONS:
        src = "any state" if t.why == "supervisor_error" else ", ".join(str(s) for s in t.sources)
        lines.append(f"| {src} | {t.to} | `{t.why}`: {t.doc} | `{t.where}` |")
    return "\n".join(lines) + "\n"
