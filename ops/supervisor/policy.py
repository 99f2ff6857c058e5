"""Restart policy: a failed attempt (crash, hang, early exit) -> restart after a backoff, or stop.

Monitor findings (NaN, loss spike, straggler, RL) are a separate policy, per monitor
(``[monitors.<name>] action``): ``ptops.ops.supervisor.actions``. A rollback is not a
failure here: it neither counts toward ``max_restarts`` nor the storm / no-progress rules
(``monitors.rollback.max_rollbacks`` bounds it).

Pure: the caller passes the clock and the checkpoint steps; nothing here
sleeps, reads files or starts processes, so the tests drive it directly and a
restarted supervisor rebuilds the history from ``events.jsonl``.

Exit codes of a supervised ``ptops launch`` (also what schedulers should act on):

====  =====================================================================
0     done: every step trained, final checkpoint written
1     failed: gave up (``max_restarts`` exhausted, or an unrecoverable error);
      a requeue may help (e.g. on other nodes)
2     bad input (recipe, ``--set``, ``--fault``, run directory locked by another supervisor)
3     do not requeue: restart storm, or restarts stopped making progress;
      a monitor finding whose ``[monitors]`` action is ``stop``; a rollback
      refused because ``monitors.rollback.max_rollbacks`` were spent;
      rerunning the same thing will fail the same way, a person must look
130   interrupted by SIGINT (Ctrl-C)
143   interrupted by SIGTERM (e.g. preemption)
====  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_REQUEUE = 3
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


@dataclass(frozen=True)
class PolicyConfig:
    max_restarts: int = 10  # restarts in the whole run (across supervisors)
    backoff_s: float = 1.0  # first delay; doubles with each attempt that made no progress
    backoff_max_s: float = 60.0
    storm_restarts: int = 5  # this many failures ...
    storm_window_s: float = 600.0  # ... within this window: a storm (exit 3)
    no_progress_attempts: int = 3  # K attempts in a row without a newer good checkpoint (exit 3)


@dataclass(frozen=True)
class Failure:
    ts: float  # wall clock (time.time()) of the failure
    start_step: int  # good checkpoint step the attempt started from
    good_step: int  # good checkpoint step when it failed
    reason: str = ""

    @property
    def progressed(self) -> bool:
        return self.good_step > self.start_step


@dataclass(frozen=True)
class Decision:
    action: str  # "restart" | "stop"
    reason: str
    delay_s: float = 0.0
    exit_code: int = 0


@dataclass
class RestartPolicy:
    config: PolicyConfig = field(default_factory=PolicyConfig)
    history: list[Failure] = field(default_factory=list)

    def no_progress_streak(self) -> int:
        n = 0
        for f in reversed(self.history):
            if f.progressed:
                break
            n += 1
        return n

    def decide(self, failure: Failure) -> Decision:
        """Record ``failure`` and say what to do next."""
        c = self.config
        self.history.append(failure)
        restarts_so_far = len(self.history) - 1
        in_window = [f for f in self.history if failure.ts - f.ts <= c.storm_window_s]
        if len(in_window) >= c.storm_restarts:
            return Decision(
                "stop",
                f"restart storm: {len(in_window)} failures within {c.storm_window_s / 60:g} min "
                f"(supervisor.storm_restarts={c.storm_restarts}); last: {failure.reason}",
                exit_code=EXIT_NO_REQUEUE,
            )
        streak = self.no_progress_streak()
        if streak >= c.no_progress_attempts:
            return Decision(
                "stop",
                f"no progress: {streak} attempts in a row failed without a newer good checkpoint "
                f"than step {failure.good_step} (supervisor.no_progress_attempts={c.no_progress_attempts}); "
                f"last: {failure.reason}",
                exit_code=EXIT_NO_REQUEUE,
            )
        if restarts_so_far >= c.max_restarts:
            return Decision(
                "stop",
                f"gave up after {restarts_so_far} restarts (supervisor.max_restarts={c.max_restarts}); "
                f"last: {failure.reason}",
                exit_code=EXIT_FAILED,
            )
        delay = min(c.backoff_max_s, c.backoff_s * (2**streak))
        return Decision("restart", failure.reason, delay_s=delay)

    @classmethod
    def from_events(cls, config: PolicyConfig, events: list[dict]) -> "RestartPolicy":
        """Rebuild the history from earlier ``restart`` events (a supervisor that adopts a run)."""
        history = []
        for e in events:
            if e.get("kind") == "restart":
                history.append(
                    Failure(
                        ts=float(e.get("ts", 0)),
                        start_step=int(e.get("prev_from_step", 0) or 0),
                        good_step=int(e.get("from_step", 0) or 0),
                        reason=str(e.get("reason", "")),
                    )
                )
        return cls(config, history)
