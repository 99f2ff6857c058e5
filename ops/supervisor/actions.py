"""Findings -> effects: carries out what :mod:`ptops.ops.supervisor.policy` decided for a monitor
finding.

Per monitor, ``[monitors.<name>] action`` (``MonitorsSection.action_for``; the table of
effects is ``policy.FINDING_EFFECTS``):

- ``alert``: record the finding (``anomaly`` / ``straggler`` event, as always) and keep training.
- ``stop``: tear the attempt down, ``failed {reason}``, exit 3 (do not requeue: the finding is
  about the run's numbers or data, and rerunning the same recipe with the same seed and data
  walks into the same finding; a person must look - ``ptops diagnose``).
- ``rollback``: tear the attempt down (the rollback wins over the crash that a NaN usually
  causes a moment later: the finding reached the supervisor first over the channel, and no
  ``crash``/``restart`` is recorded for that attempt), move every checkpoint at or after the
  anomaly step aside (``ptops.ckpt.quarantine``, never deleted; ``checkpoint_invalid {path,
  reason: "after anomaly at step S"}``), restart from the newest good checkpoint before the
  anomaly step (or from scratch), ``rollback {from_step, to_step, reason}``, and tell the ranks
  through ``PTOPS_ROLLBACK`` to skip ``rollback.skip_batches`` batches and to scale the learning
  rate by ``rollback.lr_scale`` (contract: :mod:`ptops.recipes.rollback`). The
  ``rollback.max_rollbacks + 1``-th rollback of a run becomes ``failed``, exit 3.
- ``exclude_node`` (straggler): the ``straggler`` event plus ``exclude_node {rank, host, acted}``.
  Training goes on. A local launch records it only (``acted: false``); a ``--slurm`` launch sets
  :attr:`FindingActions.exclude_node` (``ops/slurm/inside.py``): a strike against the node, which
  is replaced by a spare from the next attempt once it has ``[slurm] node_strikes``.
- silent data corruption (``sdc``): its rollback is exact (no batch skipped, the LR as it was:
  ``policy.EXACT_ROLLBACK``). A rank caught again in a later attempt (``policy.persistent_sdc``)
  is a bad device: ``exclude_node`` as above, then a rollback when the launcher acted (a spare
  takes the node's place) or ``stop`` when it cannot (a local launch would restart onto the same
  device).

A plain ``ptops launch`` builds :class:`FindingActions` with ``record_only``: findings are
events, nothing more.

:class:`FindingActions` holds no reference to the supervisor: it writes events to the run
directory, speaks through ``say``, and hands back a :class:`Verdict` the supervisor applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ptops.ckpt import list_checkpoints, quarantine, verify
from ptops.monitors.config import MonitorsSection
from ptops.ops.runrecord.events import EventKind, RunState
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.supervisor.outcome import Outcome
from ptops.ops.supervisor.policy import (
    EXACT_ROLLBACK,
    EXIT_NO_REQUEUE,
    FindingDecision,
    FindingPolicy,
    persistent_sdc,
    plan_rollback,
)
from ptops.recipes.rollback import ENV as ENV_ROLLBACK


@dataclass(frozen=True)
class Verdict:
    """After a halting finding: exit with ``exit_code``, or (None) run the next attempt from
    ``good``."""

    state: str
    reason: str
    exit_code: int | None = None
    good: dict[str, Any] | None = None


class FindingActions:
    def __init__(
        self,
        section: MonitorsSection | None,
        run: RunDir,
        say: Callable[[str], None],
        record_only: bool = False,
    ):
        self.run = run
        self.say = say
        self.policy = FindingPolicy.from_events(section, run.read_events(), record_only)
        self.pending: FindingDecision | None = None  # the halting decision of the live attempt
        # (host, reason) -> what was done, or None: the launch backend's way to exclude a node
        # (Slurm)
        self.exclude_node: Callable[[str, str], str | None] | None = None

    def on_finding(self, finding: Any, attempt: int, host_of: Callable[[int], str | None]) -> None:
        """After the finding's own event: act on it. The first halting decision of an attempt
        wins (silent data corruption outranks the others: it is their cause)."""
        d = self.policy.decide(finding)
        if d.effect.record == "exclude_node":
            host = host_of(finding.rank) if finding.rank is not None else None
            note = (
                self.exclude_node(host, d.reason)
                if self.exclude_node is not None and host
                else None
            )
            self.run.event(
                EventKind.EXCLUDE_NODE,
                attempt=attempt,
                rank=finding.rank,
                host=host,
                step=d.step,
                reason=d.reason,
                acted=note is not None,
                note=note
                or "recorded only: a local launch cannot exclude a node (a --slurm launch acts "
                "on it)",
            )
            self.say(
                f"{'straggler' if d.monitor == 'straggler' else d.monitor} rank {finding.rank} on "
                f"{host}: exclude_node "
                + (
                    f"acted on: {note}"
                    if note
                    else "recorded (a local launch cannot exclude a node)"
                )
            )
            if persistent_sdc(finding):
                # a bad device: roll back onto the spare that replaces it, or stop (the same device)
                d = FindingDecision(
                    "rollback" if note else "stop", d.monitor, d.step, d.reason, d.rank
                )
        # the first halting decision of an attempt wins, but corruption outranks what it causes
        # (a loss spike or NaN from a flipped weight, reported by another rank a moment earlier)
        if d.effect.halts and (
            self.pending is None
            or (d.monitor in EXACT_ROLLBACK and self.pending.monitor not in EXACT_ROLLBACK)
        ):
            self.pending = d
            self.say(f"{d.monitor} finding at step {d.step} -> {d.action}")

    def attempt_env(self) -> dict[str, str]:
        """Extra rank environment for the next attempt (the run's latest rollback, if any); clears
        ``pending``."""
        self.pending = None
        env = self.policy.last_env()
        return {ENV_ROLLBACK: env} if env else {}

    def end_attempt(self, attempt: int) -> Outcome:
        """The attempt ends on the pending halting decision (the caller tears the ranks down)."""
        d = self.pending
        assert d is not None
        return Outcome(
            d.action,
            d.reason,
            {"monitor": d.monitor, "step": d.step, "rank": d.rank, "attempt": attempt},
        )

    def _entries(self) -> list[tuple[int, str, bool]]:
        try:
            return [
                (e.step, e.path, bool(e.ok))
                for e in list_checkpoints(self.run.checkpoints, deep=False)
            ]
        except FileNotFoundError:
            return []

    def after_attempt(
        self,
        outcome: Outcome,
        attempt: int,
        restart_checkpoint: Callable[[], dict[str, Any] | None],
    ) -> Verdict:
        """``stop`` -> an exit code; ``rollback`` -> the checkpoint to restart from, or an exit code
        when ``max_rollbacks`` is spent. ``restart_checkpoint``: the supervisor's deep pick (it
        quarantines newer bad ones), used when the shallow catalog and the hashes disagree."""
        pol = self.policy
        d = self.pending
        self.pending = None
        if outcome.kind == "stop" or not pol.rollback_allowed():
            if outcome.kind == "stop":
                reason = f"stopped by policy: {outcome.reason}"
            else:
                reason = (
                    f"rollback refused: {len(pol.rollbacks)} rollbacks already "
                    f"(monitors.rollback.max_rollbacks={pol.max_rollbacks}); last: {outcome.reason}"
                )
            self.run.event(
                EventKind.FAILED,
                reason=reason,
                attempt=attempt,
                exit_code=EXIT_NO_REQUEUE,
                monitor=d.monitor if d else None,
                step=d.step if d else None,
            )
            self.say(f"giving up: {reason}")
            return Verdict(RunState.FAILED, reason, exit_code=EXIT_NO_REQUEUE)
        exact = d.monitor in EXACT_ROLLBACK
        plan = plan_rollback(self._entries(), d.step, pol, outcome.reason, exact)
        why = f"after anomaly at step {d.step}"
        for path in plan.quarantine:
            try:
                dest = quarantine(path, why)
            except (OSError, FileNotFoundError) as e:
                self.say(f"could not move {path} aside: {e}")
                dest = None
            self.run.event(
                EventKind.CHECKPOINT_INVALID,
                path=path,
                reason=why,
                moved_to=str(dest) if dest else None,
            )
        if plan.to_path is not None and not verify(plan.to_path, deep=True).ok:
            # the shallow catalog said good, the hashes disagree: let the restart logic pick (and
            # quarantine)
            good = restart_checkpoint()
            plan = plan_rollback(
                [(int((good or {}).get("step", 0)), (good or {}).get("path"), True)]
                if good
                else [],
                d.step,
                pol,
                outcome.reason,
                exact,
            )
        else:
            good = {"step": plan.to_step, "path": plan.to_path} if plan.to_path else None
        ev = self.run.event(
            EventKind.ROLLBACK,
            from_step=plan.from_step,
            to_step=plan.to_step,
            reason=outcome.reason,
            monitor=d.monitor,
            attempt=attempt,
            next_attempt=attempt + 1,
            to_path=plan.to_path,
            skip_batches=plan.info.skip_batches,
            skip_at_step=plan.info.skip_at_step,
            lr_scale=plan.info.lr_scale,
            lr_factor=plan.info.lr_factor,
            count=plan.info.count,
        )
        pol.rollbacks.append(ev)
        lr = "" if math.isclose(plan.info.lr_factor, 1.0) else f", lr x{plan.info.lr_factor:g}"
        self.say(
            f"rolling back from step {plan.from_step} to "
            + (f"checkpoint step {plan.to_step}" if plan.to_path else "scratch")
            + f" (skip {plan.info.skip_batches} batch(es) before step "
            f"{plan.info.skip_at_step}{lr}): {outcome.reason}"
        )
        return Verdict(RunState.RESTARTING, f"rollback: {outcome.reason}", good=good)
