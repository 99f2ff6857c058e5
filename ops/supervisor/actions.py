"""Findings -> actions: what the supervisor does with a monitor finding (``[monitors]`` policy).

Per monitor, ``[monitors.<name>] action`` (``MonitorsSection.action_for``):

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
- ``exclude_node`` (straggler): recorded only - the ``straggler`` event plus ``exclude_node
  {rank, host, acted: false}``. Training goes on: the launcher that would restart without that
  node (Slurm ``--exclude``) does not exist yet.

Pure parts (:class:`FindingPolicy`, :func:`plan_rollback`) take plain values, so the unit tests
drive them directly; :func:`on_finding`, :func:`attempt_env` and :func:`after_attempt` are the
supervisor's hooks (duck-typed on ``ops.supervisor.core.Supervisor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from ptops.ops.supervisor.policy import EXIT_NO_REQUEUE
from ptops.recipes.rollback import ENV as ENV_ROLLBACK
from ptops.recipes.rollback import RollbackInfo, skip_start

HALTING = ("stop", "rollback")  # actions that end the attempt


@dataclass(frozen=True)
class Decision:
    action: str  # alert | stop | rollback | exclude_node
    monitor: str
    step: int
    reason: str
    rank: int | None = None


def finding_reason(f: Any) -> str:
    return f"{f.monitor} at step {f.step}: {f.detail}"


@dataclass
class FindingPolicy:
    """The mapping finding -> action, plus the run's rollback history."""

    section: Any = None  # MonitorsSection (None = defaults)
    rollbacks: list[dict] = field(default_factory=list)  # earlier ``rollback`` events of the run

    def __post_init__(self) -> None:
        if self.section is None:
            from ptops.monitors.config import MonitorsSection

            self.section = MonitorsSection()

    @classmethod
    def from_events(cls, section: Any, events: Iterable[dict]) -> "FindingPolicy":
        return cls(section, [e for e in events if e.get("kind") == "rollback"])

    def decide(self, finding: Any) -> Decision:
        action = self.section.action_for(finding.monitor)
        if action == "exclude_node" and finding.monitor != "straggler":
            action = "alert"  # only a straggler names a node; the schema allows it nowhere else
        return Decision(action, finding.monitor, int(finding.step), finding_reason(finding), finding.rank)

    @property
    def max_rollbacks(self) -> int:
        return int(self.section.rollback.max_rollbacks)

    def rollback_allowed(self) -> bool:
        return len(self.rollbacks) < self.max_rollbacks

    def lr_factor(self) -> float:
        """Absolute LR factor after one more rollback (product of every rollback's lr_scale)."""
        f = 1.0
        for e in self.rollbacks:
            f *= float(e.get("lr_scale", 1.0) or 1.0)
        return f * float(self.section.rollback.lr_scale)

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


def plan_rollback(entries: Iterable[tuple[int, str, bool]], anomaly_step: int, policy: FindingPolicy,
                  reason: str) -> RollbackPlan:
    """Which checkpoint to roll back to: the newest good one strictly before ``anomaly_step``.

    ``entries``: (step, path, ok) of the checkpoints on disk. Every checkpoint at or after the
    anomaly step is to be quarantined, good or not (its state already holds the anomaly).
    """
    rows = sorted(entries, key=lambda e: e[0], reverse=True)
    quarantine = [path for step, path, _ in rows if step >= anomaly_step]
    target = next(((step, path) for step, path, ok in rows if ok and step < anomaly_step), None)
    to_step, to_path = target if target else (0, None)
    rb = policy.section.rollback
    info = RollbackInfo(
        from_step=int(anomaly_step),
        to_step=int(to_step),
        skip_batches=int(rb.skip_batches),
        skip_at_step=skip_start(anomaly_step, to_step, rb.skip_batches),
        lr_scale=float(rb.lr_scale),
        lr_factor=policy.lr_factor(),
        count=len(policy.rollbacks) + 1,
        reason=reason,
    )
    return RollbackPlan(int(anomaly_step), int(to_step), to_path, quarantine, info)


# ---------------------------------------------------------------- supervisor hooks


def _policy(sup: Any) -> FindingPolicy:
    pol = getattr(sup, "_finding_policy", None)
    if pol is None:
        pol = FindingPolicy.from_events(getattr(sup.recipe, "monitors", None), sup.run.read_events())
        sup._finding_policy = pol
    return pol


def on_finding(sup: Any, finding: Any) -> None:
    """After the finding's own event: act on it. The first halting decision of an attempt wins."""
    try:
        d = _policy(sup).decide(finding)
    except Exception as e:  # noqa: BLE001 - a policy bug must not stop the supervisor's channel
        sup.say(f"finding policy error ignored: {e}")
        return
    if d.action == "exclude_node":
        info = sup.ranks.get(finding.rank) if finding.rank is not None else None
        host = info.host if info is not None else None
        sup.event("exclude_node", attempt=sup.attempt, rank=finding.rank, host=host, step=d.step,
                  reason=d.reason, acted=False,
                  note="recorded only: no launcher can exclude a node yet (the Slurm launcher would pass --exclude)")
        sup.say(f"straggler rank {finding.rank} on {host}: exclude_node recorded (not acted on: no Slurm launcher yet)")
        return
    if d.action in HALTING and getattr(sup, "policy_action", None) is None:
        sup.policy_action = d
        sup.say(f"{d.monitor} finding at step {d.step} -> {d.action}")


def attempt_env(sup: Any) -> dict[str, str]:
    """Extra rank environment for the next attempt: the run's latest rollback, if any."""
    sup.policy_action = None
    env = _policy(sup).last_env()
    return {ENV_ROLLBACK: env} if env else {}


def end_attempt(sup: Any, attempt: int):
    """The attempt ends on a halting decision (the caller's ``finally`` tears the ranks down)."""
    from ptops.ops.supervisor.core import Outcome

    d = sup.policy_action
    return Outcome(d.action, d.reason, {"monitor": d.monitor, "step": d.step, "rank": d.rank, "attempt": attempt})


def _entries(sup: Any) -> list[tuple[int, str, bool]]:
    from ptops.ckpt import list_checkpoints

    try:
        return [(e.step, e.path, bool(e.ok)) for e in list_checkpoints(sup.run.checkpoints, deep=False)]
    except FileNotFoundError:
        return []


def after_attempt(sup: Any, outcome: Any) -> int | None:
    """``stop`` -> exit code; ``rollback`` -> None (run the next attempt) or an exit code when
    ``max_rollbacks`` is spent."""
    pol = _policy(sup)
    d = sup.policy_action
    sup.policy_action = None
    if outcome.kind == "stop" or not pol.rollback_allowed():
        if outcome.kind == "stop":
            reason = f"stopped by policy: {outcome.reason}"
        else:
            reason = (f"rollback refused: {len(pol.rollbacks)} rollbacks already "
                      f"(monitors.rollback.max_rollbacks={pol.max_rollbacks}); last: {outcome.reason}")
        sup.state = "failed"
        sup.reason = reason
        sup.event("failed", reason=reason, attempt=sup.attempt, exit_code=EXIT_NO_REQUEUE,
                  monitor=d.monitor if d else None, step=d.step if d else None)
        sup.say(f"giving up: {reason}")
        return EXIT_NO_REQUEUE
    from ptops.ckpt import quarantine, verify

    plan = plan_rollback(_entries(sup), d.step, pol, outcome.reason)
    why = f"after anomaly at step {d.step}"
    for path in plan.quarantine:
        try:
            dest = quarantine(path, why)
        except (OSError, FileNotFoundError) as e:
            sup.say(f"could not move {path} aside: {e}")
            dest = None
        sup.event("checkpoint_invalid", path=path, reason=why, moved_to=str(dest) if dest else None)
    if plan.to_path is not None and not verify(plan.to_path, deep=True).ok:
        # the shallow catalog said good, the hashes disagree: let the restart logic pick (and quarantine)
        sup.good = sup._good_checkpoint_for_restart()
        plan = plan_rollback([(int((sup.good or {}).get("step", 0)), (sup.good or {}).get("path"), True)]
                             if sup.good else [], d.step, pol, outcome.reason)
    else:
        sup.good = {"step": plan.to_step, "path": plan.to_path} if plan.to_path else None
    ev = sup.event("rollback", from_step=plan.from_step, to_step=plan.to_step, reason=outcome.reason,
                   monitor=d.monitor, attempt=sup.attempt, next_attempt=sup.attempt + 1, to_path=plan.to_path,
                   skip_batches=plan.info.skip_batches, skip_at_step=plan.info.skip_at_step,
                   lr_scale=plan.info.lr_scale, lr_factor=plan.info.lr_factor, count=plan.info.count)
    pol.rollbacks.append(ev if isinstance(ev, dict) else {
        "from_step": plan.from_step, "to_step": plan.to_step, "skip_batches": plan.info.skip_batches,
        "skip_at_step": plan.info.skip_at_step, "lr_scale": plan.info.lr_scale,
        "lr_factor": plan.info.lr_factor, "count": plan.info.count, "reason": outcome.reason})
    sup.state = "restarting"
    sup.reason = f"rollback: {outcome.reason}"
    lr = "" if math.isclose(plan.info.lr_factor, 1.0) else f", lr x{plan.info.lr_factor:g}"
    sup.say(f"rolling back from step {plan.from_step} to "
            + (f"checkpoint step {plan.to_step}" if plan.to_path else "scratch")
            + f" (skip {plan.info.skip_batches} batch(es) before step {plan.info.skip_at_step}{lr}): {outcome.reason}")
    sup.write_status(force=True)
    return None
