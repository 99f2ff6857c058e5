"""Hang detection: a pure function of the heartbeat stream (records in, findings out).

Records are dicts with ``kind`` and ``ts`` (seconds on the observer's clock, e.g.
the supervisor's ``time.monotonic()`` at receipt, so hosts' clocks never matter):

- ``{"kind": "beat", "rank": r, "step": n, "phase": "startup"|"step"|"checkpoint"|"hold", "stage": "begin"|None}``
  progress: the rank reached a new point (``stage="begin"``: the start of step n; ``phase="hold"``:
  a declared pause before step n, e.g. the ``hold`` fault);
- ``{"kind": "metrics", "rank": r, "step": n, "step_s": s}``: step n finished (progress);
- ``{"kind": "ping", "rank": r}``: liveness only (a thread of the rank is alive), no progress;
- ``{"kind": "exit", "rank": r}``: the rank left on purpose; it is no longer watched.

A rank is *stalled* when it made no progress for longer than the budget of the
phase it is in:

- before its first finished step of the attempt: ``startup_s`` from the attempt start;
- during a checkpoint save, or after the final step (saving, shutting down): ``checkpoint_s``;
- otherwise ``max(floor_s, multiplier * median(last `window` step times))``.

A declared pause (phase ``hold``: the rank stopped on purpose before a step,
outside any collective) is no hang while the paused rank keeps pinging: it has
no progress budget, its peers waiting for it are not judged either, and the
budgets of everyone restart when the pause ends. The pause's own bound is the
pausing side's business (the ``hold`` fault ends by itself); a paused rank that
stops pinging is judged by the unresponsive rule below, startup or not.

A rank that sends nothing at all (not even its liveness pings) for longer than
that step timeout (and ``ping_stale_s``) is stalled in every phase but startup: a SIGSTOPped rank in
the middle of a checkpoint save must not get the save's long budget.

When any rank is stalled the attempt hangs, and the finding names the *silent*
ranks, the likely culprits rather than the peers blocked in a collective
waiting for them: ranks whose liveness pings stopped too (SIGSTOPped, stuck in C
holding the GIL); else the ranks furthest behind (e.g. still in step n-1 while
the others entered step n); else every rank.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class HangConfig(BaseModel):
    """Hang budgets; the recipe nests this as ``[supervisor.hang]`` (defaults written here only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiplier: float = Field(10.0, gt=1, description="a step is hung after this many times the recent median step time ...")
    floor_s: float = Field(60.0, gt=0, description="... but never sooner than this")
    window: int = Field(20, ge=1, description="recent steps whose median sets the step timeout")
    startup_s: float = Field(600.0, gt=0, description="budget from launch to each rank's first finished step")
    checkpoint_s: float = Field(
        600.0, gt=0, description="budget for one checkpoint save (and for the shutdown after the final step)"
    )
    ping_stale_s: float = Field(
        10.0, gt=0,
        description="a rank that sends nothing, not even its liveness pings, for this long is unresponsive "
        "(named as the culprit of a hang; its stacks come from py-spy, not the channel)",
    )
    total_steps: int | None = Field(
        None, exclude=True, description="the run's train.steps, filled in by the supervisor (not a recipe key)"
    )


@dataclass(frozen=True)
class HangFinding:
    ranks: list[int]  # the silent ranks (likely culprits)
    stalled: list[int]  # every rank past its budget
    step: int  # the step the silent ranks are at
    silent_s: float  # how long the silent ranks made no progress
    phase: str
    timeout_s: float
    why: str  # "unresponsive" | "behind" | "all"

    def as_event(self, attempt: int) -> dict:
        return {
            "attempt": attempt,
            "ranks": self.ranks,
            "step": self.step,
            "silent_s": round(self.silent_s, 3),
            "phase": self.phase,
            "timeout_s": round(self.timeout_s, 3),
            "stalled": self.stalled,
            "why": self.why,
        }


_STAGE = {"startup": 0, "begin": 1, "end": 2, "checkpoint": 3, "after_checkpoint": 4}
HOLD = "hold"  # the declared-pause phase


@dataclass
class _Rank:
    last_progress: float
    last_seen: float | None = None
    step: int = 0
    phase: str = "startup"
    pos: tuple[int, int] = (0, 0)
    steps_done: int = 0
    exited: bool = False


@dataclass
class HangMonitor:
    world_size: int
    start_ts: float
    config: HangConfig = field(default_factory=HangConfig)

    def __post_init__(self) -> None:
        self.ranks: dict[int, _Rank] = {r: _Rank(last_progress=self.start_ts) for r in range(self.world_size)}
        self.step_times: deque[float] = deque(maxlen=max(1, self.config.window))
        self.resumed_at = self.start_ts  # the end of the last declared pause: budgets count from here

    # ------------------------------------------------------------ input
    def observe(self, rec: dict) -> None:
        kind = rec.get("kind")
        rank = rec.get("rank")
        if rank is None:
            return
        st = self.ranks.setdefault(int(rank), _Rank(last_progress=self.start_ts))
        ts = float(rec["ts"])
        st.last_seen = ts if st.last_seen is None else max(st.last_seen, ts)
        if kind == "ping":
            return
        if kind == "exit":
            st.exited = True
            return
        step = int(rec.get("step", st.step) or 0)
        if kind == "metrics":
            pos, phase = (step, _STAGE["end"]), "step"
            step_s = rec.get("step_s")
            if isinstance(step_s, (int, float)) and step_s > 0:
                self.step_times.append(float(step_s))
            st.steps_done += 1
        elif kind == "beat":
            phase = rec.get("phase", "step")
            if phase == "startup":
                pos = (0, _STAGE["startup"])
            elif phase == "checkpoint":
                pos = (step, _STAGE["checkpoint"])
            elif phase == HOLD:
                pos = (step - 1, _STAGE["end"])  # step n-1 done, step n not begun
            elif rec.get("stage") == "begin":
                pos = (step, _STAGE["begin"])
            elif st.phase == "checkpoint":
                pos = (step, _STAGE["after_checkpoint"])
            else:
                pos = (step, _STAGE["end"])
        else:
            return
        if st.phase == HOLD and phase != HOLD:
            self.resumed_at = max(self.resumed_at, ts)
        st.step, st.phase, st.pos = step, phase, pos
        st.last_progress = ts

    # ------------------------------------------------------------ budgets
    def step_timeout(self) -> float:
        c = self.config
        if not self.step_times:
            return c.floor_s
        return max(c.floor_s, c.multiplier * statistics.median(self.step_times))

    def budget(self, rank: int) -> tuple[float, float, str]:
        """(deadline, timeout, phase name) of one rank."""
        c = self.config
        st = self.ranks[rank]
        if st.phase == HOLD:
            return float("inf"), float("inf"), HOLD
        if st.steps_done == 0:
            return max(self.start_ts, self.resumed_at) + c.startup_s, c.startup_s, "startup"
        since = max(st.last_progress, self.resumed_at)
        if st.phase == "checkpoint":
            return since + c.checkpoint_s, c.checkpoint_s, "checkpoint"
        if c.total_steps is not None and st.step >= c.total_steps and st.pos[1] >= _STAGE["end"]:
            return since + c.checkpoint_s, c.checkpoint_s, "finishing"
        t = self.step_timeout()
        return since + t, t, "step"

    def _unresponsive_past_step_timeout(self, rank: int, now: float) -> bool:
        """A rank that sends nothing at all, not even pings, is judged by the step timeout in every phase
        but startup (a stopped rank inside a checkpoint save must not get the long save budget)."""
        st = self.ranks[rank]
        if (st.steps_done == 0 and st.phase != HOLD) or st.last_seen is None:
            return False
        return now - st.last_seen > max(self.step_timeout(), self.config.ping_stale_s)

    # ------------------------------------------------------------ output
    def check(self, now: float) -> HangFinding | None:
        c = self.config

        def unresponsive(r: int) -> bool:
            seen = self.ranks[r].last_seen
            return seen is None or now - seen > c.ping_stale_s

        live = [r for r, st in sorted(self.ranks.items()) if not st.exited]
        # a declared pause of a live rank pauses the job: its peers block on it by design
        paused = any(self.ranks[r].phase == HOLD and not unresponsive(r) for r in live)
        stalled = [
            r for r in live
            if (not paused and now > self.budget(r)[0]) or self._unresponsive_past_step_timeout(r, now)
        ]  # fmt: skip
        if not stalled:
            return None

        quiet = [r for r in live if unresponsive(r)]
        if quiet and len(quiet) < len(live):
            culprits, why = quiet, "unresponsive"
        else:
            lowest = min(self.ranks[r].pos for r in live)
            behind = [r for r in live if self.ranks[r].pos == lowest]
            if len(behind) < len(live):
                culprits, why = behind, "behind"
            else:
                culprits, why = live, "all"
        first = min(culprits, key=lambda r: self.ranks[r].last_progress)
        judged = next((r for r in culprits if r in stalled), stalled[0])
        _, timeout, phase = self.budget(judged)
        if paused or now <= self.budget(judged)[0]:  # stalled by the unresponsive rule, not its phase budget
            timeout, phase = self.step_timeout(), f"unresponsive in {phase}"
        return HangFinding(
            ranks=culprits,
            stalled=stalled,
            step=min(self.ranks[r].step for r in culprits),
            silent_s=now - self.ranks[first].last_progress,
            phase=phase,
            timeout_s=timeout,
            why=why,
        )
