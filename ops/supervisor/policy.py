"""The supervisor's decisions as data: failed attempt -> restart or stop; finding -> action.

Two policies, both pure (the caller passes the clock and the checkpoint steps; nothing
here sleeps, reads files or starts processes), so the tests drive them directly and a
restarted supervisor rebuilds their history from ``events.jsonl``:

- :class:`RestartPolicy`: a failed attempt (crash, hang, early exit) -> restart after a
  backoff, or stop. Its settings are the recipe's ``[supervisor.restart]``
  (:class:`ptops.recipes.schema.RestartConfig`, defaults written there once). The
  strategy names come from Erlang/OTP: ``permanent`` children are restarted within the
  restart intensity (``ptops launch --supervise``); ``temporary`` ones never are (a plain
  ``ptops launch``: same watch, same records, no restart).
- :class:`FindingPolicy` and :data:`FINDING_EFFECTS`: a monitor finding (NaN, loss spike,
  straggler, RL) -> ``alert | stop | rollback | exclude_node``, per monitor
  (``[monitors.<name>] action``); :func:`plan_rollback` says where a rollback goes (exactly,
  without skipping data or scaling the LR, for silent data corruption: :data:`EXACT_ROLLBACK`).
  A persistent ``sdc`` finding (the same rank caught in two attempts) becomes ``exclude_node``;
  a contained one (corrupt gradients outvoted before the optimizer) is only recorded.
  ``ptops.ops.supervisor.actions`` carries the decisions out. A rollback is not a
  failure for the restart policy: it neither counts toward ``max_restarts`` nor the
  storm / no-progress rules (``monitors.rollback.max_rollbacks`` bounds it).

Exit codes: one table, ``ptops.ops.supervisor.exitcodes`` (documented in ``docs/exit-codes.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from ptops.monitors.config import MonitorsSection
from ptops.ops.runrecord.events import EventKind, is_all_clear
from ptops.ops.supervisor import exitcodes
from ptops.recipes.rollback import RollbackInfo, skip_start
from ptops.recipes.schema import RestartConfig

# names kept for callers; the values and their meaning live in ``exitcodes.TABLE``
EXIT_DONE = exitcodes.COMPLETED
EXIT_FAILED = exitcodes.FAILED_MAY_REQUEUE
EXIT_BAD_INPUT = exitcodes.BAD_INPUT
EXIT_NO_REQUEUE = exitcodes.NO_PROGRESS
EXIT_MISCONFIGURED = exitcodes.MISCONFIGURED
EXIT_RESUBMITTED = exitcodes.RESUBMITTED


@dataclass(frozen=True)
class Failure:
    ts: float  # wall clock (time.time()) of the failure
    # the newest saved state when the attempt started, and when it failed: a good checkpoint's
    # step, or the step of a script's own save (``script_save``)
    start_step: int
    good_step: int
    reason: str = ""
    fatal: str = ""  # why no restart can help (an ImportError before the first step): stop at once
    reached: int = 0  # the highest step the attempt reached
    # the error and the step it ended at ("ValueError: ... at step 12"), when a rank said why: the
    # same one twice in a row is a deterministic failure
    signature: str = ""


def progressed(history: list[Failure], i: int) -> bool:
    """Whether failed attempt ``i`` got the run further: a newer saved state than it started
    from, or a step no earlier attempt reached (a script that keeps no state ptops sees)."""
    f = history[i]
    return f.good_step > f.start_step or f.reached > max(
        (g.reached for g in history[:i]), default=0
    )


# Errors a rank raises before its first step that the next attempt would raise again the same way:
# the code or the environment is broken, not the run (no checkpoint, node or retry changes them).
FATAL_STARTUP_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError")


# errors no restart fixes at any step: the engine served stale weights after a re-sync (a restart
# loads the same weights into the same engine the same way)
FATAL_ERRORS = {
    "EngineStaleWeights": "the vLLM engine kept serving stale weights after a re-sync: a restart "
    "would sync the same way (runbooks/EngineStaleWeights.md)",
}


def fatal_startup_error(error: str | None, began_step: bool) -> str:
    """Why a restart cannot help, or "" (the rank's goodbye error is ``"Type: message"``)."""
    kind = (error or "").split(":", 1)[0].strip()
    if kind in FATAL_ERRORS:
        return FATAL_ERRORS[kind]
    if began_step or kind not in FATAL_STARTUP_ERRORS:
        return ""
    return (
        f"{kind} before the first step: a restart would fail the same way (fix the "
        "environment or code, then rerun)"
    )


# errors of the environment (the rendezvous, the network, a timeout): the same on every rank, but a
# restart may well not meet them again
_TRANSIENT = ("Dist", "Timeout", "Connection", "Network", "Broken")


def same_error_everywhere(errors: list[str | None], began_step: bool) -> str:
    """Why a restart cannot help when every rank raised the same error before its first step (the
    script's code or its data is wrong, as a typo is), or ""."""
    first = errors[0] if errors else None
    kind = (first or "").split(":", 1)[0].strip()
    if began_step or not first or any(e != first for e in errors):
        return ""
    if any(word in kind for word in _TRANSIENT):
        return ""
    return (
        f"every rank raised the same error before its first step ({kind}): a restart would fail "
        "the same way (fix the code or its data, then rerun)"
    )


@dataclass(frozen=True)
class Decision:
    action: str  # "restart" | "stop"
    reason: str
    delay_s: float = 0.0
    exit_code: int = 0


Strategy = Literal["permanent", "temporary"]


@dataclass(frozen=True)
class RestartSpec:
    """When a failed attempt is restarted, as one value (Erlang/OTP's child spec: restart type,
    intensity within a period, and here a backoff). Built once from the recipe's
    ``[supervisor.restart]`` (``RestartConfig``: keys and defaults live there) and the launch's
    strategy; :meth:`RestartPolicy.decide` reads only this. The state machine's ``restart`` and
    ``gave_up`` rows (``ops/supervisor/states.py``) are its two answers. Bounds kept elsewhere, on
    purpose: rollbacks (``[monitors.rollback] max_rollbacks``: a finding, not a failure) and node
    strikes (``[slurm] node_strikes``)."""

    strategy: Strategy  # permanent: restarted within the bounds below; temporary: never
    max_restarts: int  # restarts in the whole run, across supervisors (then exit 1)
    storm_restarts: int  # this many failures within storm_window_s: a restart storm (exit 3)
    storm_window_s: float
    no_progress_attempts: int  # failed attempts in a row without progress (then exit 3)
    backoff_s: float  # the delay after the first attempt without progress, doubled each one more
    backoff_max_s: float

    @classmethod
    def of(cls, config: RestartConfig, strategy: Strategy = "permanent") -> "RestartSpec":
        return cls(
            strategy=strategy,
            max_restarts=config.max_restarts,
            storm_restarts=config.storm_restarts,
            storm_window_s=config.storm_window_min * 60,
            no_progress_attempts=config.no_progress_attempts,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
        )

    def delay_s(self, streak: int) -> float:
        """The backoff after ``streak`` failed attempts in a row without progress: none after an
        attempt that made progress (waiting only lengthens the outage), then ``backoff_s``,
        doubling, capped at ``backoff_max_s``."""
        return 0.0 if streak == 0 else min(self.backoff_max_s, self.backoff_s * (2 ** (streak - 1)))


@dataclass
class RestartPolicy:
    config: RestartConfig = field(default_factory=RestartConfig)
    history: list[Failure] = field(default_factory=list)
    strategy: Strategy = "permanent"
    spec: RestartSpec = field(init=False)  # ``config`` and ``strategy`` as one value, read once

    def __post_init__(self) -> None:
        self.spec = RestartSpec.of(self.config, self.strategy)

    def no_progress_streak(self) -> int:
        n = 0
        for i in reversed(range(len(self.history))):
            if progressed(self.history, i):
                break
            n += 1
        return n

    def decide(self, failure: Failure) -> Decision:
        """Record ``failure`` and say what to do next."""
        c = self.spec
        self.history.append(failure)
        if c.strategy == "temporary":
            return Decision(
                "stop",
                f"{failure.reason} (plain launch: no restart; --supervise restarts)",
                exit_code=EXIT_FAILED,
            )
        if failure.fatal:
            return Decision(
                "stop", f"{failure.reason}; {failure.fatal}", exit_code=EXIT_MISCONFIGURED
            )
        before = self.history[-2] if len(self.history) > 1 else None
        if failure.signature and before is not None and before.signature == failure.signature:
            return Decision(
                "stop",
                f"the same failure twice in a row, a restart would fail the same way: "
                f"{failure.signature}; last: {failure.reason}",
                exit_code=EXIT_NO_REQUEUE,
            )
        restarts_so_far = len(self.history) - 1
        in_window = [f for f in self.history if failure.ts - f.ts <= c.storm_window_s]
        if len(in_window) >= c.storm_restarts:
            return Decision(
                "stop",
                f"restart storm: {len(in_window)} failures within {c.storm_window_s / 60:g} min "
                f"(supervisor.restart.storm_restarts={c.storm_restarts}); last: {failure.reason}",
                exit_code=EXIT_NO_REQUEUE,
            )
        streak = self.no_progress_streak()
        if streak >= c.no_progress_attempts:
            return Decision(
                "stop",
                f"no progress: {streak} attempts in a row failed without a newer good checkpoint "
                f"than step {failure.good_step} "
                f"(supervisor.restart.no_progress_attempts={c.no_progress_attempts}); "
                f"last: {failure.reason}",
                exit_code=EXIT_NO_REQUEUE,
            )
        if restarts_so_far >= c.max_restarts:
            return Decision(
                "stop",
                f"gave up after {restarts_so_far} restarts "
                f"(supervisor.restart.max_restarts={c.max_restarts}); "
                f"last: {failure.reason}",
                exit_code=EXIT_FAILED,
            )
        return Decision("restart", failure.reason, delay_s=c.delay_s(streak))

    @classmethod
    def from_events(
        cls, config: RestartConfig, events: list[dict], strategy: Strategy = "permanent"
    ) -> "RestartPolicy":
        """Rebuild the history from earlier ``restart`` events (a supervisor that adopts a run)."""
        history = []
        for e in events:
            if e.get("kind") == EventKind.RESTART:
                history.append(
                    Failure(
                        ts=float(e.get("ts", 0)),
                        start_step=int(e.get("prev_from_step", 0) or 0),
                        good_step=int(e.get("progress_step", e.get("from_step", 0)) or 0),
                        reason=str(e.get("reason", "")),
                        reached=int(e.get("reached", 0) or 0),
                        signature=str(e.get("signature", "") or ""),
                    )
                )
        return cls(config, history, strategy)


# ---------------------------------------------------------------- findings -> actions


@dataclass(frozen=True)
class Effect:
    """What the supervisor does for one ``[monitors]`` action (the finding's own event is always
    written)."""

    # the attempt ends (torn down), then :func:`actions.FindingActions.after_attempt` decides
    halts: bool
    record: str | None = None  # an extra event kind to write


FINDING_EFFECTS: dict[str, Effect] = {
    "alert": Effect(halts=False),
    "stop": Effect(
        halts=True
    ),  # failed, exit 3: rerunning the same recipe walks into the same finding
    "rollback": Effect(halts=True),  # back to the newest good checkpoint before the finding's step
    "exclude_node": Effect(
        halts=False, record="exclude_node"
    ),  # recorded only: no launcher excludes nodes yet
}
HALTING = tuple(a for a, e in FINDING_EFFECTS.items() if e.halts)


@dataclass(frozen=True)
class FindingDecision:
    action: str  # a key of FINDING_EFFECTS
    monitor: str
    step: int
    reason: str
    rank: int | None = None

    @property
    def effect(self) -> Effect:
        return FINDING_EFFECTS[self.action]


# Monitors whose rollback replays the same data at the same LR: the fault was the hardware's, not
# the data's or the schedule's, so the run must end exactly as an uninterrupted one would.
EXACT_ROLLBACK = ("sdc",)


def persistent_sdc(f: Any) -> bool:
    """A rank caught corrupting its state in more than one attempt (``monitors/sdc.py``: value =
    attempts that caught it): a bad device, not a one-off upset."""
    return (
        getattr(f, "monitor", None) == "sdc"
        and getattr(f, "rank", None) is not None
        and (getattr(f, "value", None) or 0) > 1
    )


def contained_sdc(f: Any) -> bool:
    """Corrupt gradients caught by a recheck and outvoted before the optimizer
    (``monitors/sdc.py``): the weights never saw them, so nothing is rolled back."""
    return getattr(f, "monitor", None) == "sdc" and str(getattr(f, "detail", "")).startswith(
        "recompute transient"
    )


def finding_reason(f: Any) -> str:
    return f"{f.monitor} at step {f.step}: {f.detail}"


@dataclass
class FindingPolicy:
    """The mapping finding -> action, plus the run's rollback history.

    ``record_only`` (a plain launch): every finding is an ``alert`` - recorded, never acted on.
    """

    section: MonitorsSection = field(default_factory=MonitorsSection)
    rollbacks: list[dict] = field(default_factory=list)  # earlier ``rollback`` events of the run
    record_only: bool = False

    @classmethod
    def from_events(
        cls, section: MonitorsSection | None, events: Iterable[dict], record_only: bool = False
    ) -> "FindingPolicy":
        return cls(
            section or MonitorsSection(),
            [e for e in events if e.get("kind") == EventKind.ROLLBACK],
            record_only,
        )

    def decide(self, finding: Any) -> FindingDecision:
        action = "alert" if self.record_only else self.section.action_for(finding.monitor)
        if is_all_clear(finding) or contained_sdc(finding):
            action = "alert"  # recorded, never acted on
        if action == "exclude_node" and finding.monitor != "straggler":
            action = "alert"  # only a straggler names a node; the schema allows it nowhere else
        if action != "alert" and persistent_sdc(finding):
            action = "exclude_node"  # its node is struck (FindingActions decides what follows)
        if action not in FINDING_EFFECTS:
            action = "alert"
        return FindingDecision(
            action, finding.monitor, int(finding.step), finding_reason(finding), finding.rank
        )

    @property
    def max_rollbacks(self) -> int:
        return int(self.section.rollback.max_rollbacks)

    def rollback_allowed(self) -> bool:
        return len(self.rollbacks) < self.max_rollbacks

    def lr_factor(self, scale: float | None = None) -> float:
        """Absolute LR factor after one more rollback (product of every rollback's lr_scale);
        ``scale``: this rollback's, instead of ``rollback.lr_scale``."""
        f = 1.0
        for e in self.rollbacks:
            f *= float(e.get("lr_scale", 1.0) or 1.0)
        return f * float(self.section.rollback.lr_scale if scale is None else scale)

    def last_env(self) -> str | None:
        """``PTOPS_ROLLBACK`` for the next attempt: the latest rollback of the run, if any."""
        if not self.rollbacks:
            return None
        try:
            return RollbackInfo.from_dict(self.rollbacks[-1]).to_env()
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class RollbackPlan:
    from_step: int
    to_step: int  # 0 = from scratch
    to_path: str | None
    quarantine: list[str]  # checkpoints at or after the anomaly step
    info: RollbackInfo


def plan_rollback(
    entries: Iterable[tuple[int, str, bool]],
    anomaly_step: int,
    policy: FindingPolicy,
    reason: str,
    exact: bool = False,
) -> RollbackPlan:
    """Which checkpoint to roll back to: the newest good one strictly before ``anomaly_step``.

    ``entries``: (step, path, ok) of the checkpoints on disk. Every checkpoint at or after the
    anomaly step is to be quarantined, good or not (its state already holds the anomaly).
    ``exact`` (:data:`EXACT_ROLLBACK`): no batch skipped, the LR not scaled again.
    """
    rows = sorted(entries, key=lambda e: e[0], reverse=True)
    quarantine = [path for step, path, _ in rows if step >= anomaly_step]
    target = next(((step, path) for step, path, ok in rows if ok and step < anomaly_step), None)
    to_step, to_path = target if target else (0, None)
    rb = policy.section.rollback
    skip = 0 if exact else int(rb.skip_batches)
    scale = 1.0 if exact else float(rb.lr_scale)
    info = RollbackInfo(
        from_step=int(anomaly_step),
        to_step=int(to_step),
        skip_batches=skip,
        skip_at_step=skip_start(anomaly_step, to_step, skip),
        lr_scale=scale,
        lr_factor=policy.lr_factor(scale),
        count=len(policy.rollbacks) + 1,
        reason=reason,
    )
    return RollbackPlan(int(anomaly_step), int(to_step), to_path, quarantine, info)
