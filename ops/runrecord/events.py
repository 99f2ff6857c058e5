"""The run record's vocabulary, declared once: event kinds with their fields, run states,
and the one reducer from ``events.jsonl`` to what a reader wants to know about a run.

Writers (supervisor, launcher, probe, engine adapters) and readers (``ptops status``,
the Prometheus and MLflow exporters, ``diagnose``, chaos) name kinds and states from
here, so a kind cannot be read under one spelling and written under another. The
values are the strings already in run directories: the on-disk format is unchanged.

Imports nothing of ptops (design.md: ``ops/runrecord/`` is the bottom layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable, Mapping


class EventKind(StrEnum):
    """Every ``kind`` written to ``events.jsonl`` (``SPECS`` says its fields)."""

    LAUNCH = "launch"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_VERIFIED = "checkpoint_verified"
    SCRIPT_SAVE = "script_save"
    SCRIPT_RESUME = "script_resume"
    FAULT_INJECTED = "fault_injected"
    INJECT = "inject"
    CRASH = "crash"
    EARLY_EXIT = "early_exit"
    HANG = "hang"
    MISCONFIGURED = "misconfigured"
    HEALTH_CHECK = "health_check"
    INBOX_BEHIND = "inbox_behind"
    INBOX_CAUGHT_UP = "inbox_caught_up"
    STRAGGLER = "straggler"
    ANOMALY = "anomaly"
    MONITOR_ERROR = "monitor_error"
    RESTART = "restart"
    ROLLBACK = "rollback"
    ROLLBACK_APPLIED = "rollback_applied"
    EXCLUDE_NODE = "exclude_node"
    ADOPT = "adopt"
    ORPHANS_KILLED = "orphans_killed"
    RECIPE_UPDATED = "recipe_updated"
    STAGE_INPUT = "stage_input"
    HOLD_RELEASED = "hold_released"
    PROFILE_REQUESTED = "profile_requested"
    PROFILE_CAPTURED = "profile_captured"
    PROFILE_FAILED = "profile_failed"
    REWARD_SOURCE = "reward_source"
    SLURM_SUBMITTED = "slurm_submitted"
    SLURM_ALLOCATION = "slurm_allocation"
    NODE_BLAMED = "node_blamed"
    NODE_REPLACED = "node_replaced"
    PREEMPTED = "preempted"
    SLURM_REQUEUE = "slurm_requeue"
    SIDECAR_STARTED = "sidecar_started"
    SIDECAR_DIED = "sidecar_died"
    SIDECAR_RESTARTED = "sidecar_restarted"
    TEACHER = "teacher"
    VLLM_FALLBACK = "vllm_fallback"
    ENGINE_RESYNC = "engine_resync"
    ENGINE_STALE = "engine_stale"
    GRADER_FAILED = "grader_failed"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


class RunState(StrEnum):
    """Every state a run is reported in (``status.json``, ``ptops status``, exporters)."""

    NEW = "new"  # a run directory nobody launched yet
    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RESTARTING = "restarting"
    COLLECTING_STACKS = "collecting_stacks"
    STOPPING = "stopping"
    # what the latest event says happened, until the next progress (exporters' view)
    HUNG = "hung"
    CRASHED = "crashed"
    ROLLING_BACK = "rolling_back"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    DEAD = "dead"  # status.json says live but no supervisor holds the lock


# A supervisor writes these into status.json while it works; without a lock holder they mean "dead".
LIVE_STATES = frozenset(
    {
        RunState.STARTING,
        RunState.RUNNING,
        RunState.CHECKPOINTING,
        RunState.RESTARTING,
        RunState.COLLECTING_STACKS,
        RunState.STOPPING,
    }
)
TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.STOPPED})
# The ``ptops_run_state{state=...}`` series, in exposition order (alert rules select on them).
EXPORTED_STATES = (
    RunState.STARTING,
    RunState.RUNNING,
    RunState.HUNG,
    RunState.CRASHED,
    RunState.RESTARTING,
    RunState.ROLLING_BACK,
    RunState.COMPLETED,
    RunState.FAILED,
    RunState.STOPPED,
)


@dataclass(frozen=True)
class EventSpec:
    """One kind: its fields, and what readers make of it.

    ``required``: always written (design.md's contract where it names the kind); ``optional``:
    written by some writers or some of the time. ``state``: the run state an event of this kind
    moves the run to (exporters' view). ``finding``: ``ptops status`` lists it as an open finding of
    the live attempt. ``severity``: an incident in its own right for ``diagnose`` (None: not one).
    ``summary``: listed in the MLflow incident summary. ``runbook``: ``runbooks/<name>.md`` for it
    (monitor findings get theirs from the monitor registry).
    """

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    state: RunState | None = None
    finding: bool = False
    severity: str | None = None
    summary: bool = False
    runbook: str | None = None
    doc: str = ""


K = EventKind
_RANK = ("rank", "attempt")  # the probe stamps every rank-side event with these

SPECS: dict[EventKind, EventSpec] = {
    K.LAUNCH: EventSpec(
        ("attempt",),
        (
            "supervised",
            "nproc",
            "from_step",
            "supervisor_pid",
            "faults",
            "ranks_from",
            "warm_pool",
            "warm_wait_s",
            "standing_pool",
            "cold_why",
            "cold_detail",
        ),
        state=RunState.RUNNING,
        doc="an attempt's ranks were started; ranks_from: \"warm\" (forked from the run's warm "
        "pool, after warm_wait_s waiting for its import, or from the standing_pool of `ptops "
        'warm`) or "cold" (torchrun; cold_why: no_pool, pool_not_started, pool_exited, '
        "pool_not_ready, pool_declined, stopping, standing_pool_gone, standing_pool_differs)",
    ),
    K.CHECKPOINT: EventSpec(
        ("step", "path", "blocking_s", "total_s"),
        ("mode", "prep_s", "state_dict_s", "call_s", "wait_s", "qkv_split", *_RANK),
        doc="a checkpoint was committed (sent by rank 0 after its commit)",
    ),
    K.CHECKPOINT_SKIPPED: EventSpec(
        ("step",),
        ("writing_step", "writing_s", *_RANK),
        doc="an interval save was skipped: the previous async save was still being "
        "written (one writer; never queued)",
    ),
    K.CHECKPOINT_VERIFIED: EventSpec(
        ("step", "path"),
        ("verify_s", *_RANK),
        doc="rank 0 read a committed checkpoint back in the background and it verified",
    ),
    K.SCRIPT_SAVE: EventSpec(
        ("step", "path"),
        ("fingerprint", *_RANK),
        doc="an unchanged script saved a state of its own (torch.save, DCP save) after this many "
        "optimizer steps (fingerprint: of its bytes): its snapshot, if a later attempt loads it",
    ),
    K.SCRIPT_RESUME: EventSpec(
        ("step", "path"),
        _RANK,
        doc="an unchanged script loaded a file it saved at this step in an earlier attempt: its "
        "steps continue from there",
    ),
    K.CHECKPOINT_INVALID: EventSpec(
        ("path", "reason"),
        ("moved_to", "step", "found_by", *_RANK),
        finding=True,
        severity="critical",
        summary=True,
        runbook="CheckpointCorrupt",
        doc="a checkpoint failed verification and was set aside",
    ),
    K.CHECKPOINT_FAILED: EventSpec(
        ("step", "path", "error", "final"),
        _RANK,
        severity="warning",
        summary=True,
        runbook="CheckpointSaveFailing",
        doc="a checkpoint save failed, nothing committed",
    ),
    K.FAULT_INJECTED: EventSpec(
        ("fault", "rank", "step"),
        ("attempt", "node"),
        summary=True,
        doc="an injected fault fired in a rank (clock-skew: in a node's health check, rank and "
        "step null)",
    ),
    K.INJECT: EventSpec(
        ("fault", "attempt", "ranks"), doc="`ptops inject` armed a fault in a live attempt"
    ),
    K.CRASH: EventSpec(
        ("attempt", "rank", "exit_code"),
        ("step", "host", "how", "link_closed"),
        state=RunState.CRASHED,
        finding=True,
        severity="critical",
        summary=True,
        runbook="TrainingCrashLoop",
        doc="a rank exited non-zero (rank: the blamed one; link_closed: its node agent's or "
        "relay's link closed first, host is that link's)",
    ),
    K.EARLY_EXIT: EventSpec(
        ("attempt", "step"),
        severity="critical",
        runbook="TrainingCrashLoop",
        doc="torchrun exited 0 before the last step",
    ),
    K.HANG: EventSpec(
        ("attempt", "ranks", "step", "silent_s"),
        (
            "phase",
            "section",
            "timeout_s",
            "stalled",
            "why",
            "stacks",
            "stack_sources",
            "stacks_s",
            "teardown_s",
            "found_ts",
            "behind_s",
            "also_quiet",
            "engine_version",
        ),
        state=RunState.HUNG,
        finding=True,
        severity="critical",
        summary=True,
        runbook="TrainingHang",
        doc="ranks made no progress past their budget; stacks were collected (a run's sidecars "
        "too: stack_sources.sidecars); phase names an engine or grader seam where the ranks were "
        "in one (engine_version: the model version of the engine's last sync)",
    ),
    K.MISCONFIGURED: EventSpec(
        ("attempt", "reason"),
        ("rank", "host", "world_size", "expected_world_size"),
        finding=True,
        severity="critical",
        summary=True,
        runbook="TrainingCrashLoop",
        doc="ranks formed a process group other than the launcher asked for (e.g. worlds "
        "of one): the run fails at once, a restart cannot fix it",
    ),
    K.STRAGGLER: EventSpec(
        ("rank", "ratio"),
        ("step", "detail", "severity", "attempt"),
        finding=True,
        summary=True,
        doc="the straggler monitor's finding",
    ),
    K.ANOMALY: EventSpec(
        ("monitor", "step", "value", "detail"),
        ("severity", "rank", "attempt", "episode", "phase", "host"),
        finding=True,
        summary=True,
        doc="a metric monitor's finding (runbook: the monitor registry's); episode monitors add "
        "episode and phase (open | escalate | resolved: the all-clear, severity info, closes "
        "the episode's open findings); host: the named rank's, as the live attempt knew it",
    ),
    K.MONITOR_ERROR: EventSpec(
        ("monitor", "error"),
        ("step", "rank", "attempt"),
        severity="warning",
        summary=True,
        doc="a monitor raised on a record; it is reported once and the others keep running",
    ),
    K.RESTART: EventSpec(
        ("attempt", "from_step", "reason"),
        ("prev_from_step", "delay_s", "reached", "progress_step", "signature"),
        state=RunState.RESTARTING,
        summary=True,
        doc="the supervisor relaunches (attempt: the next one)",
    ),
    K.ROLLBACK: EventSpec(
        ("from_step", "to_step", "reason"),
        (
            "monitor",
            "attempt",
            "next_attempt",
            "to_path",
            "skip_batches",
            "skip_at_step",
            "lr_scale",
            "lr_factor",
            "count",
        ),
        state=RunState.ROLLING_BACK,
        finding=True,
        summary=True,
        doc="a monitor finding sends the run back to an earlier checkpoint",
    ),
    K.ROLLBACK_APPLIED: EventSpec(
        ("what", "step"),
        ("lr_factor", "lr", "skip_batches", "batches_dropped", "from_step", "to_step", *_RANK),
        doc="the engine applied a rollback's lr scale or batch skip",
    ),
    K.EXCLUDE_NODE: EventSpec(
        ("attempt", "rank", "host", "step", "reason"),
        ("acted", "note"),
        doc="a straggler policy asked to exclude a node (recorded)",
    ),
    K.ADOPT: EventSpec(
        ("previous_supervisor_pid", "last_attempt"),
        doc="a new supervisor took over a run whose supervisor died",
    ),
    K.ORPHANS_KILLED: EventSpec(
        ("pids",), doc="leftover processes of the run were killed before a launch"
    ),
    K.RECIPE_UPDATED: EventSpec(("first_change",), doc="a relaunch runs a changed recipe"),
    K.STAGE_INPUT: EventSpec(
        ("pipeline", "stage", "input_stage", "input_checkpoint", "input_digest"),
        ("index", "run_dir", "resumed", "refs"),
        doc="a `ptops pipeline` stage: the verified checkpoint (and digest) it starts from",
    ),
    K.HOLD_RELEASED: EventSpec(
        ("rank", "attempt", "step", "held_s", "by"),
        doc="a rank held by a `hold` fault went on (by: release | committed | timeout)",
    ),
    K.PROFILE_REQUESTED: EventSpec(
        ("id", "attempt", "start_step", "steps", "ranks"),
        ("dir",),
        doc="`ptops profile` asked every rank for a profiler trace of `steps` steps "
        "from `start_step` (traces in profiles/<id>/)",
    ),
    K.PROFILE_CAPTURED: EventSpec(
        ("id", "rank", "attempt", "first_step", "steps", "path"),
        ("bytes", "wall_s", "export_s", "pause_s", "partial"),
        doc="a rank wrote its profiler trace (path: relative to the run directory; "
        "partial: the rank left before the last step; pause_s: what stopping and writing the "
        "trace held the rank)",
    ),
    K.PROFILE_FAILED: EventSpec(
        ("id", "rank", "attempt", "error"),
        ("first_step",),
        doc="a rank could not take its part of a profile (training went on)",
    ),
    K.REWARD_SOURCE: EventSpec(
        ("reward",),
        (
            "funcs",
            "weights",
            "judge_path",
            "judge_kind",
            "judge_digest",
            "judge_params",
            "judge_sees",
            "judge_bound",
            "math_bound",
            "sandbox",
            "sandbox_limits",
            *_RANK,
        ),
        doc="what a GRPO run's reward is: its functions and weights, the judge's identity "
        "(path, sha256 of its weights, what it reads: judge_sees) and its bound, the math "
        "comparer's bound, or the code sandbox's isolation",
    ),
    K.SLURM_SUBMITTED: EventSpec(
        ("job_id", "script"),
        ("nodes", "spare_nodes", "exclude"),
        doc="`ptops launch --slurm` submitted the run (sbatch --parsable)",
    ),
    K.SLURM_ALLOCATION: EventSpec(
        ("job_id", "nodes"),
        ("restart_count", "batch_host", "active", "spares"),
        doc="the batch step's supervisor started in its allocation (nodes: all of them; "
        "restart_count: SLURM_RESTART_COUNT, 1 after the first requeue)",
    ),
    K.NODE_BLAMED: EventSpec(
        ("attempt", "node", "strikes", "reason"),
        ("ranks", "limit"),
        doc="a failed attempt's ranks were all on one node: a strike against it",
    ),
    K.NODE_REPLACED: EventSpec(
        ("attempt", "node", "by"),
        ("spares_left",),
        doc="a node with strikes >= the limit is swapped for a spare node of the allocation "
        "(from attempt: the next one)",
    ),
    K.PREEMPTED: EventSpec(
        ("attempt", "signal"),
        ("step", "saved_step"),
        doc="Slurm's warning signal (--signal=B:USR1@S): the ranks saved at a step boundary",
    ),
    K.SLURM_REQUEUE: EventSpec(
        ("job_id", "reason"),
        ("exclude", "new_job_id", "how"),
        doc="the job goes back to the queue (how: requeue = scontrol requeue; resubmit = "
        "sbatch --exclude of the blamed nodes)",
    ),
    K.SIDECAR_STARTED: EventSpec(
        ("name", "pid"),
        ("restarts", "argv"),
        doc="a sidecar process of the run (e.g. the vLLM server) answered its health check",
    ),
    K.SIDECAR_DIED: EventSpec(
        ("name", "exit_code"),
        ("reason", "restarts", "gave_up"),
        severity="critical",
        summary=True,
        doc="a sidecar exited or stopped answering its health check (gave_up: "
        "its restarts are spent, it stays down)",
    ),
    K.SIDECAR_RESTARTED: EventSpec(
        ("name", "pid", "restarts"),
        summary=True,
        doc="a dead sidecar was started again and is healthy",
    ),
    K.TEACHER: EventSpec(
        ("path", "digest", "step"),
        ("spec", "pinned", *_RANK),
        doc="the distillation teacher checkpoint a run reads (pinned by its first attempt)",
    ),
    K.VLLM_FALLBACK: EventSpec(
        ("mode", "reason"),
        _RANK,
        doc="[trl.vllm] asked for vLLM but it cannot run here: TRL's generate path instead",
    ),
    K.ENGINE_RESYNC: EventSpec(
        ("mode", "step", "why"),
        ("gap", *_RANK),
        summary=True,
        doc="a weight sync to the vLLM engine did not take (the engine's log-probabilities of the "
        "probe sequence are not the trainer's; gap: how far), or the engine restarted and lost it "
        "(its version is not the synced one): synced again",
    ),
    K.ENGINE_STALE: EventSpec(
        ("mode", "step", "gap"),
        ("version", *_RANK),
        finding=True,
        severity="critical",
        summary=True,
        runbook="EngineStaleWeights",
        doc="the vLLM engine still served other weights than the trainer's after a sync and a "
        "re-sync (version: the trainer step of its last good sync): the run stops",
    ),
    K.GRADER_FAILED: EventSpec(
        ("step", "grader", "error", "retried", "no_verdict"),
        ("attempt_of_call", *_RANK),
        severity="warning",
        summary=True,
        runbook="GraderNoVerdict",
        doc="a reward function's call failed as its infrastructure does (its process or service "
        "went away: OSError, EOFError, TimeoutError); retried: called again; else its batch has no "
        "verdict (no_verdict completions: None for every reward function, TRL's unscorable, never "
        "a 0 or a 1; the step's grader/no_verdict)",
    ),
    K.COMPLETED: EventSpec(
        ("step",), ("attempt",), state=RunState.COMPLETED, doc="the run reached its last step"
    ),
    K.HEALTH_CHECK: EventSpec(
        ("attempt", "ok", "checks"),
        ("failed", "nodes", "failed_nodes"),
        doc="the checks before an attempt (ops/supervisor/health.py) on every node it may use "
        "(Slurm: spares too): checks [{name, ok, detail, node}] (ok null: does not apply here), "
        "failed: the names that failed, failed_nodes {node: [names]}; locally a failure ends the "
        "run (failed, exit 1) before any rank starts, under Slurm the node is replaced by a spare "
        "that passed (node_blamed, node_replaced) or the job resubmitted without it",
        runbook="NodeUnhealthy",
    ),
    K.INBOX_BEHIND: EventSpec(
        ("attempt", "lag_s", "queued"),
        doc="the supervisor's inbox held messages received lag_s ago and not yet handled: hang "
        "checks judge at the oldest one's arrival until it drains (no false hang from a backlog; "
        "detection is late by the lag instead); once per episode, closed by inbox_caught_up",
        runbook="SupervisorBehind",
    ),
    K.INBOX_CAUGHT_UP: EventSpec(
        ("attempt", "behind_s", "max_lag_s", "max_queued", "why"),
        doc="an inbox_behind episode ended: behind_s how long it lasted, max_lag_s and max_queued "
        "its worst lag and backlog (hang detection was late by up to max_lag_s); why: drained, or "
        "attempt_ended (the attempt ended while behind)",
        runbook="SupervisorBehind",
    ),
    K.FAILED: EventSpec(
        ("reason",),
        ("attempt", "exit_code", "traceback"),
        state=RunState.FAILED,
        severity="critical",
        summary=True,
        doc="the run gave up (reason names the cause; traceback: the short traceback of a fatal "
        "error, e.g. at import, from the rank's goodbye)",
    ),
    K.STOPPED: EventSpec(
        (),
        ("attempt", "signal", "step", "reason"),
        state=RunState.STOPPED,
        doc="the run was stopped by a signal",
    ),
}
del K

# Kinds that end a run; each one's value is also its terminal state.
END_KINDS = frozenset({EventKind.COMPLETED, EventKind.FAILED, EventKind.STOPPED})
# Kinds a rank may report itself over the channel (the supervisor records only these).
RANK_KINDS = frozenset(
    {
        EventKind.CHECKPOINT,
        EventKind.CHECKPOINT_FAILED,
        EventKind.CHECKPOINT_INVALID,
        EventKind.CHECKPOINT_SKIPPED,
        EventKind.CHECKPOINT_VERIFIED,
        EventKind.SCRIPT_SAVE,
        EventKind.SCRIPT_RESUME,
        EventKind.ROLLBACK_APPLIED,
        EventKind.HOLD_RELEASED,
        EventKind.PROFILE_CAPTURED,
        EventKind.PROFILE_FAILED,
        EventKind.REWARD_SOURCE,
        EventKind.TEACHER,
        EventKind.VLLM_FALLBACK,
        EventKind.ENGINE_RESYNC,
        EventKind.ENGINE_STALE,
        EventKind.GRADER_FAILED,
    }
)
# Findings the monitors raise live (one per monitor finding; diagnose matches them to its replay).
MONITOR_FINDING_KINDS = frozenset({EventKind.STRAGGLER, EventKind.ANOMALY})
FINDING_KINDS = frozenset(k for k, s in SPECS.items() if s.finding)
ALL_CLEAR = "resolved"  # the phase of an episode's last finding


def is_all_clear(finding: Any) -> bool:
    """An episode's all-clear (a finding event or a monitor's Finding of phase ``resolved``,
    severity info): it closes its episode's findings and is never acted on, counted or alerted on.
    The one place this rule is written (the reducer, the policy, the exporter, diagnose)."""
    phase = (
        finding.get("phase") if isinstance(finding, Mapping) else getattr(finding, "phase", None)
    )
    return phase == ALL_CLEAR


INCIDENT_KINDS = frozenset(k for k, s in SPECS.items() if s.severity)
SUMMARY_KINDS = frozenset(k for k, s in SPECS.items() if s.summary)


def kind_of(event: Mapping[str, Any]) -> EventKind | None:
    """The event's kind, or None for a kind this vocabulary does not know (read, never fatal)."""
    try:
        return EventKind(event.get("kind"))
    except ValueError:
        return None


def spec(kind: str) -> EventSpec | None:
    try:
        return SPECS[EventKind(kind)]
    except ValueError:
        return None


def missing_fields(event: Mapping[str, Any]) -> list[str]:
    """Required fields the event lacks (``["kind"]`` for an unknown kind)."""
    s = spec(str(event.get("kind")))
    if s is None:
        return ["kind"]
    return [f for f in ("ts", *s.required) if f not in event]


def next_state(state: str | None, event: Mapping[str, Any]) -> str | None:
    """The run state after ``event``: a launch always (re)starts the run, an end event ends it,
    incidents show until the next launch or end but never reopen an ended run."""
    s = spec(str(event.get("kind")))
    if s is None or s.state is None:
        return state
    if s.state is RunState.RUNNING or s.state in TERMINAL_STATES or state not in TERMINAL_STATES:
        return str(s.state)
    return state


@dataclass
class RunView:
    """What the events alone say about a run (:class:`Reducer`): read by ``ptops status``, the
    launcher, chaos, MLflow and the Prometheus exporter, so each rule is written here once."""

    state: str = RunState.NEW  # the latest attempt's end kind; running after a launch; new before
    event_state: str | None = None  # next_state folded over every event (exporters' view)
    state_events: int = 0  # events that carried a state (an exporter tells what came after them)
    attempt: int = 0  # the highest launched attempt
    restart_attempt: int = 0  # the highest attempt a restart event announced
    launches: int = 0
    restarts: int = 0
    restart_reasons: dict[str, int] = field(default_factory=dict)  # reason -> restarts
    end: dict[str, Any] | None = None  # the end event of the latest attempt (None while it runs)
    open_findings: list[dict[str, Any]] = field(default_factory=list)  # since the last launch
    counts: dict[str, int] = field(default_factory=dict)  # kind -> events, in first-seen order
    kind_ts: dict[str, float] = field(default_factory=dict)  # kind -> its latest ts
    monitor_findings: dict[str, int] = field(default_factory=dict)  # anomaly findings per monitor
    monitor_finding_ts: dict[str, float] = field(default_factory=dict)
    episode_monitors: dict[str, None] = field(default_factory=dict)  # that ever opened an episode
    stragglers: dict[int, int] = field(default_factory=dict)  # rank -> straggler findings
    straggler_ratio: dict[int, tuple[float, float]] = field(default_factory=dict)  # (ratio, ts)
    last_checkpoint: dict[str, Any] | None = None  # the latest ``checkpoint`` event
    # the open ``inbox_behind`` event: the supervisor judges hangs late (closed by
    # inbox_caught_up, a launch or the run's end)
    behind: dict[str, Any] | None = None
    first_launch_ts: float | None = None
    last_launch_ts: float | None = None
    first_ts: float | None = None
    last_ts: float | None = None

    @property
    def ended(self) -> bool:
        return self.end is not None

    @property
    def reason(self) -> str | None:
        return None if self.end is None else self.end.get("reason")

    def episode_open(self) -> dict[str, int]:
        """Monitor -> 1 while one of its finding episodes (a finding with a phase) is open in the
        current attempt, 0 once all-clear, ended or restarted; monitors that never opened one are
        absent."""
        live = (
            set()
            if self.ended
            else {f.get("monitor") for f in self.open_findings if f.get("phase") is not None}
        )
        return {m: int(m in live) for m in self.episode_monitors}


def _as_int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _ts(e: Mapping[str, Any]) -> float | None:
    ts = e.get("ts")
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
        return float(ts)
    return None


class Reducer:
    """:func:`reduce` kept open: a live exporter adds events one at a time and reads
    :attr:`view` at any moment (each event costs O(1) but for an all-clear, which scans the open
    findings)."""

    def __init__(self) -> None:
        self.view = RunView()

    def add(self, e: Mapping[str, Any]) -> None:
        if not isinstance(e, Mapping):
            return
        v = self.view
        kind = str(e.get("kind") or "unknown")
        v.counts[kind] = v.counts.get(kind, 0) + 1
        ts = _ts(e)
        if ts is not None:
            v.first_ts = ts if v.first_ts is None else min(v.first_ts, ts)
            v.last_ts = ts if v.last_ts is None else max(v.last_ts, ts)
            v.kind_ts[kind] = max(ts, v.kind_ts.get(kind, ts))
        s = spec(kind)
        if s is not None and s.state is not None:
            v.state_events += 1
        v.event_state = next_state(v.event_state, e)
        if kind == EventKind.LAUNCH:
            v.launches += 1
            v.attempt = max(v.attempt, _as_int(e.get("attempt")))
            v.end = None
            v.open_findings = []
            v.behind = None
            v.state = RunState.RUNNING
            if ts is not None:
                v.first_launch_ts = ts if v.first_launch_ts is None else min(v.first_launch_ts, ts)
                v.last_launch_ts = ts if v.last_launch_ts is None else max(v.last_launch_ts, ts)
        elif kind in END_KINDS:
            v.end = dict(e)
            v.behind = None
            v.state = kind
        elif kind == EventKind.INBOX_BEHIND:
            v.behind = dict(e)
        elif kind == EventKind.INBOX_CAUGHT_UP:
            v.behind = None
        elif kind == EventKind.RESTART:
            v.restarts += 1
            reason = str(e.get("reason") or "unknown")
            v.restart_reasons[reason] = v.restart_reasons.get(reason, 0) + 1
            v.restart_attempt = max(v.restart_attempt, _as_int(e.get("attempt")))
        elif kind == EventKind.CHECKPOINT:
            v.last_checkpoint = dict(e)
        elif kind == EventKind.STRAGGLER:
            self._straggler(e, ts)
        elif kind == EventKind.ANOMALY and not is_all_clear(e):
            m = str(e.get("monitor") or "unknown")
            v.monitor_findings[m] = v.monitor_findings.get(m, 0) + 1
            if ts is not None:
                v.monitor_finding_ts[m] = max(ts, v.monitor_finding_ts.get(m, ts))
            if e.get("phase") is not None:
                v.episode_monitors.setdefault(m, None)
        if kind in FINDING_KINDS and v.launches:
            if is_all_clear(e):
                v.open_findings = [
                    f
                    for f in v.open_findings
                    if not (
                        f.get("monitor") == e.get("monitor")
                        and f.get("episode") == e.get("episode")
                    )
                ]
            else:
                v.open_findings.append(dict(e))

    def _straggler(self, e: Mapping[str, Any], ts: float | None) -> None:
        try:
            rank = int(e.get("rank"))
        except (TypeError, ValueError):
            return
        v = self.view
        v.stragglers[rank] = v.stragglers.get(rank, 0) + 1
        ratio = e.get("ratio")
        if isinstance(ratio, (int, float)) and math.isfinite(ratio) and ts is not None:
            v.straggler_ratio[rank] = (float(ratio), ts)


def reduce(events: Iterable[Mapping[str, Any]]) -> RunView:
    """Fold events, in file order, into a :class:`RunView`. Pure: same events, same view.

    An end event counts only when no launch follows it (a resumed run is running again);
    findings are those of the latest attempt (since the latest launch).
    """
    r = Reducer()
    for e in events:
        r.add(e)
    return r.view
