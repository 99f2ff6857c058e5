"""Hang detection: a pure function of the heartbeat stream (records in, findings out).

Records are dicts with ``kind`` and ``ts`` (seconds on the observer's clock, e.g.
the supervisor's ``time.monotonic()`` at receipt, so hosts' clocks never matter):

- ``{"kind": "beat", "rank": r, "step": n, "phase": P, "stage": "begin"|None, "section": S}``
  progress: the rank reached a new point. Phases: ``startup`` (``section``: ``import``,
  ``rendezvous``, ``build``, ``load``; before its first beat a rank is in section ``launch``),
  ``data`` (fetching the batch of step n), ``step`` (``stage="begin"``: the start of step n),
  ``checkpoint``, ``eval`` (a pause the engine declares), ``hold`` (a declared pause before
  step n, e.g. the ``hold`` fault);
- ``{"kind": "metrics", "rank": r, "step": n, "step_s": s}``: step n finished (progress);
- ``{"kind": "ping", "rank": r}``: liveness only (a thread of the rank is alive), no progress;
- ``{"kind": "exit", "rank": r, "code": c}``: the rank left on purpose; it is no longer watched.
  ``code`` 0 (it finished) puts the live ranks in the final shutdown's budget (``finishing``),
  for progress and for liveness: the job is ending, and a peer's teardown (a process group's
  destructor, in C with the GIL held: no pings; a logger's flush) may outlast a step's budget,
  most of all where no step is known to be the last (a user's script).

Why budgets are learned, not tuned: one fixed timeout is either too long for a 0.1 s step
or too short for a 20-minute checkpoint load. Each *section* (a startup sub-phase, the
first step of an attempt, a step, the data fetch, a checkpoint, an eval) has its own budget

    max(floor, multiplier x p99 of that section's durations observed in this run,
        seen_multiplier x the longest of them)

and, before the section has any history, a bounded first-occurrence budget (config). The p99
comes from a fixed log-scale histogram per section (:class:`Durations`: no allocation per record;
the estimate is the smallest sample of the bucket that holds the p99, so it never exceeds the
true p99 and ``multiplier x p99`` is an upper bound on the detection delay). Durations of earlier
attempts carry over (the supervisor hands ``learned`` to the next attempt's monitor), so an
attempt's start-up sub-phases are judged by what the first attempt took, in seconds rather than
the 600 s a single start-up timeout needed.

A rank is *stalled* when it made no progress for longer than its section's budget, counted
from its last progress. Exceptions that keep peers blocked by someone else from being blamed:

- a rank waiting in ``rendezvous`` is judged from the moment every live rank has reached it
  (a peer still importing is judged by its own import budget);
- a declared pause (``hold``, ``eval``, or ``save``: one rank's own save) of a live rank that keeps
  pinging pauses the job: its peers are not judged, and everyone's budgets restart when it ends.
  ``hold`` has no budget of its own (the holding side ends it); ``eval`` has its section budget,
  ``save`` the checkpoint's.

A rank that sends nothing at all, not even its liveness pings, for longer than
``max(step budget, ping_stale_s)`` is stalled in every phase but the start-up (a SIGSTOPped rank
in a save must not get the save's long budget; during start-up, imports of C extensions may hold
the GIL, so the start-up sections judge by progress only, with ``startup_ping_stale_s`` as the
liveness bound).

When any rank is stalled the attempt hangs, and the finding names the *silent*
ranks, the likely culprits rather than the peers blocked in a collective
waiting for them: ranks whose liveness pings stopped too (SIGSTOPped, stuck in C
holding the GIL), those of them that went silent first (within ``ping_stale_s`` of the
longest silence: a frozen node's ranks together, not a rank a late sender left quiet
for a few seconds, listed as ``also_quiet``); else the ranks furthest behind (e.g. still
in step n-1 while the others entered step n); else every rank.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

STARTUP_SECTIONS = ("launch", "import", "rendezvous", "build", "load")
# the seams inside an RL step (recipes/trl/engine.py, grader.py): a hang there is named by its seam.
# The engine's learn their own durations and are judged by min(the step's budget, their own: floor,
# multiplier x p99, seen_multiplier x longest), so a sync of 2 s in a 60 s step is hung after
# ~20 s, not 600 s. The reward call keeps the step's: its graders carry bounds of their own (the
# judge's 10 s a completion, the sandbox's timeouts) that a budget learned from fast calls would cut
# short, killing a rank for what the grader turns into no verdict
SEAMS = ("engine_sync", "engine_generate", "reward")
LEARNED_SEAMS = ("engine_sync", "engine_generate")
SECTIONS = (*STARTUP_SECTIONS, "first_step", "step", "data", "checkpoint", "eval", *LEARNED_SEAMS)
HOLD = "hold"  # the declared-pause phase (the hold fault): no budget of its own
EVAL = "eval"  # a pause the engine declares: a budget of its own, peers wait for it
# one rank's own save (a script's ``torch.save`` on rank 0 while the others wait in a barrier or
# their next collective): judged by the checkpoint budget, its peers wait for it as for an eval
SAVE = "save"
# a rank waiting for its inference engine to come back (a vLLM server the run's sidecar supervision
# restarts): a budget of its own (engine_wait_s), its peers wait in their next collective
ENGINE_WAIT = "engine_wait"
PAUSES = (HOLD, EVAL, SAVE, ENGINE_WAIT)


class HangConfig(BaseModel):
    """Hang budgets; the recipe nests this as ``[supervisor.hang]`` (defaults written here only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiplier: float = Field(
        10.0,
        gt=1,
        description="a section is hung after this many times its p99 duration in this run ...",
    )
    floor_s: float = Field(
        5.0, gt=0, description="... but never sooner than this (steps, data fetches)"
    )
    seen_multiplier: float = Field(
        2.0,
        ge=1,
        description="... and never below this many times the longest duration of that section "
        "this run has seen: a step that accumulates many micro-batches or holds an evaluation "
        "every k steps is rarer than the p99, and has shown what it needs",
    )
    window: int | None = Field(
        None,
        ge=1,
        description="older recipes: the step budget is also never below multiplier x the longest "
        "of the last "
        "`window` steps (unset: the run's p99 alone)",
    )
    startup_s: float = Field(
        600.0,
        gt=0,
        description="cap on each start-up section's first-occurrence budget (launch, import, ...)",
    )
    launch_s: float = Field(
        120.0, gt=0, description="first-occurrence budget: attempt start to a rank's hello"
    )
    import_s: float = Field(
        300.0, gt=0, description="first-occurrence budget: the engine's imports (torch, ...)"
    )
    rendezvous_s: float = Field(
        60.0,
        gt=0,
        description="first-occurrence budget: process group init, counted once every rank "
        "reached it",
    )
    build_s: float = Field(
        300.0, gt=0, description="first-occurrence budget: model / trainer build"
    )
    load_s: float = Field(
        600.0,
        gt=0,
        description="first-occurrence budget: checkpoint load until the first step begins",
    )
    first_step_s: float = Field(
        300.0,
        gt=0,
        description="first-occurrence budget: an attempt's first step (warm-up, compilation)",
    )
    startup_floor_s: float = Field(
        20.0,
        gt=0,
        description="floor of the learned start-up budgets (import, rendezvous, build, load, "
        "first step)",
    )
    engine_wait_s: float = Field(
        900.0,
        gt=0,
        description="how long a rank may wait for its inference engine to come back (a vLLM "
        "server restarted by the run's sidecar supervision) before the wait is a hang",
    )
    checkpoint_s: float = Field(
        600.0,
        gt=0,
        description="first-occurrence budget of a checkpoint save (and of the final save / "
        "shutdown, always)",
    )
    checkpoint_floor_s: float = Field(
        60.0, gt=0, description="floor of the learned checkpoint budget"
    )
    eval_s: float = Field(
        1800.0, gt=0, description="first-occurrence budget of a declared eval pause"
    )
    eval_floor_s: float = Field(60.0, gt=0, description="floor of the learned eval budget")
    ping_stale_s: float = Field(
        4.0,
        gt=0,
        description="a rank that sends nothing, not even its liveness pings (every "
        "supervisor.heartbeat_s), for "
        "max(this, the step budget) is unresponsive: named as the culprit, stacks from py-spy",
    )
    startup_ping_stale_s: float = Field(
        60.0,
        gt=0,
        description="the same during start-up (imports of C extensions can hold the GIL for "
        "seconds)",
    )
    total_steps: int | None = Field(
        None,
        exclude=True,
        description="the run's train.steps, filled in by the supervisor (not a recipe key)",
    )

    def first_budget(self, section: str) -> float:
        """Budget of a section the run has no duration of yet."""
        if section in STARTUP_SECTIONS or section == "first_step":
            return min(getattr(self, f"{section}_s"), self.startup_s)
        return {"checkpoint": self.checkpoint_s, "eval": self.eval_s}.get(section, self.floor_s)

    def floor(self, section: str) -> float:
        if section in STARTUP_SECTIONS or section == "first_step":
            return self.startup_floor_s
        return {"checkpoint": self.checkpoint_floor_s, "eval": self.eval_floor_s}.get(
            section, self.floor_s
        )


# ---------------------------------------------------------------- durations
_LO, _RATIO_BITS, _NB = 1e-4, 16, 540  # buckets: 1e-4 s * 2**(i/16), up to ~1.4e6 s


class Durations:
    """Durations of one section: a fixed log-scale histogram (no allocation per sample).

    ``quantile(q)`` is the smallest sample in the bucket holding the nearest-rank q-quantile:
    never above the true value, at most 4.4 % (one bucket) below it.
    """

    __slots__ = ("counts", "mins", "n", "longest", "_cache")

    def __init__(self) -> None:
        self.counts = [0] * _NB
        self.mins = [math.inf] * _NB
        self.n = 0
        self.longest = 0.0  # the longest sample (the budget never falls below a multiple of it)
        self._cache: dict[float, float] = {}

    def add(self, seconds: float) -> None:
        # 0 s is a real observation: arrival stamps are per socket read, so a short section's end
        # that arrives in the same read as its start measures 0 (dropping it left the next attempt
        # with no budget for that section but the 600 s first-occurrence one)
        if not seconds >= 0 or not math.isfinite(seconds):
            return
        seconds = max(seconds, _LO)
        i = min(_NB - 1, max(0, int(math.log2(seconds / _LO) * _RATIO_BITS)))
        self.counts[i] += 1
        if seconds < self.mins[i]:
            self.mins[i] = seconds
        if seconds > self.longest:
            self.longest = seconds
        self.n += 1
        if self._cache:
            self._cache.clear()

    def quantile(self, q: float = 0.99) -> float | None:
        if self.n == 0:
            return None
        hit = self._cache.get(q)
        if hit is not None:
            return hit
        need = max(1, math.ceil(q * self.n))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need:
                self._cache[q] = self.mins[i]
                return self.mins[i]
        return None  # unreachable

    def copy(self) -> "Durations":
        d = Durations()
        d.counts, d.mins, d.n, d.longest = list(self.counts), list(self.mins), self.n, self.longest
        return d


@dataclass
class Learned:
    """What the run has learned of each section's durations; carried from attempt to attempt."""

    sections: dict[str, Durations] = field(
        default_factory=lambda: {s: Durations() for s in SECTIONS}
    )

    def add(self, section: str, seconds: float) -> None:
        self.sections[section].add(seconds)

    def p99(self, section: str) -> float | None:
        return self.sections[section].quantile(0.99)

    def longest(self, section: str) -> float:
        return self.sections[section].longest

    def copy(self) -> "Learned":
        return Learned({s: d.copy() for s, d in self.sections.items()})

    def summary(self) -> dict[str, dict[str, float]]:
        """JSON-able: section -> {n, p99} for the sections seen (events, benchmarks)."""
        return {
            s: {"n": d.n, "p99": round(d.quantile(0.99) or 0.0, 4)}
            for s, d in self.sections.items()
            if d.n
        }


@dataclass(frozen=True)
class HangFinding:
    ranks: list[int]  # the silent ranks (likely culprits)
    stalled: list[int]  # every rank past its budget
    step: int  # the step the silent ranks are at
    silent_s: float  # how long the silent ranks made no progress
    phase: str
    timeout_s: float
    why: str  # "unresponsive" | "behind" (also: a pause past its budget, its peers waiting) | "all"
    section: str = (
        ""  # the budget that ran out (startup section, first_step, step, checkpoint, ...)
    )
    # > 0: judged while the supervisor was this far behind the clock, each rank at what its own
    # connection had had handled (a silent node found under a backlog)
    behind_s: float = 0.0
    # ranks also quiet past ping_stale_s but silent for less than the named ones: not named (see
    # ``HangMonitor._first_silent``), listed for the operator
    also_quiet: list[int] = field(default_factory=list)

    def as_event(self, attempt: int) -> dict:
        extra: dict = {"behind_s": round(self.behind_s, 3)} if self.behind_s > 0 else {}
        if self.also_quiet:
            extra["also_quiet"] = self.also_quiet
        return {
            "attempt": attempt,
            "ranks": self.ranks,
            "step": self.step,
            "silent_s": round(self.silent_s, 3),
            "phase": self.phase,
            "section": self.section,
            "timeout_s": round(self.timeout_s, 3),
            "stalled": self.stalled,
            "why": self.why,
            **extra,
        }


def _push(heap: list[tuple], ts: float, ranks: list[int]) -> None:
    """One deadline heap entry for ``ranks`` all stamped ``ts``: ``(ts, rank)`` for one, ``(ts,
    first, ranks)`` for several (a node's or a relay's step group: one push and one pop a group,
    not a rank; ``HangMonitor._oldest``)."""
    if len(ranks) == 1:
        heapq.heappush(heap, (ts, ranks[0]))
    elif ranks:
        heapq.heappush(heap, (ts, ranks[0], ranks))


# the sections whose duration is learned when they end (from ``since``; steps from ``step_s``)
_TIMED = frozenset(("checkpoint", "eval", "data", *STARTUP_SECTIONS[1:]))


def _timed(timed: tuple | None, rank: int) -> float | None:
    return timed[1] if timed is not None and timed[0] == rank else None


# a section without history yet is judged like this one (the first step is slower than the rest)
_FALLBACK = {"data": "step", "step": "first_step"}
_STAGE = {"startup": 0, "begin": 1, "end": 2, "checkpoint": 3, "after_checkpoint": 4}
# the liveness heap takes a rank's newer last_seen only when it moved this far: a ping a second per
# rank need not be a heap entry each (the key stays a lower bound, at most this much early)
SEEN_GRAIN = 0.5


@dataclass(slots=True)
class _Rank:
    """One rank's state; ranks of a cohort (``HangMonitor._cohorts``) share one object."""

    last_progress: float
    last_seen: float | None = None
    step: int = 0
    phase: str = "startup"
    section: str = "launch"
    # when the current section began: a timed one's (``_TIMED``), 0 in the others, where nothing
    # reads it (ranks that entered a step at different times are then of one state: a cohort)
    since: float = 0.0
    pos: tuple[int, int] = (-1, 0)  # in the launch section
    stepped: bool = False  # it ended a step this attempt (later ones are judged as steps)
    exited: bool = False
    seen_key: float | None = None  # the last_seen in the liveness heap (at most SEEN_GRAIN old)
    # how many ranks map to this object (``HangMonitor.ranks``): > 1 in a cohort; a rank's own
    # change first gives it a copy of its own (``HangMonitor._own``)
    refs: int = field(default=1, compare=False, repr=False)

    def alone(self) -> "_Rank":
        """A copy of its own (``refs`` 1): ``dataclasses.replace`` took 4 us, a rank of a relay
        each sample step (its whole records leave the cohort)."""
        return _Rank(
            self.last_progress, self.last_seen, self.step, self.phase, self.section, self.since,
            self.pos, self.stepped, self.exited, self.seen_key,
        )  # fmt: skip


# a group of ranks shares one state (a cohort) from this size on: a relay's step of 511 ranks is
# then one update, not 511; a node's 8 cost little one by one
COHORT_MIN = 16
# a group whose ranks' states differ (a cohort cannot form) is tried again after this many of its
# steps: the try is a walk over its ranks
COHORT_RETRY = 64


@dataclass
class HangMonitor:
    world_size: int
    start_ts: float
    config: HangConfig = field(default_factory=HangConfig)
    learned: Learned = field(
        default_factory=Learned
    )  # pass the previous attempt's to keep what it learned

    def __post_init__(self) -> None:
        self.ranks: dict[int, _Rank] = {r: self._new_rank() for r in range(self.world_size)}
        # start-up sections are judged by earlier attempts only: ranks of one attempt start at their
        # own pace (a peer 20 s slower to import on a loaded host is not hung)
        self.prior = self.learned.copy()
        w = self.config.window
        self._recent = (
            [0.0] * w if w else []
        )  # ring of the last `window` step times (older recipes)
        self._recent_i = 0
        self.resumed_at = (
            self.start_ts
        )  # the end of the last declared pause: budgets count from here
        self._rdv_entered: dict[int, float] = {}
        # the live ranks not yet in the rendezvous: while one is, the answer is None in O(1)
        self._rdv_waiting: set[int] = set(range(self.world_size))
        self._rdv_version = 0  # bumped when a rank enters the rendezvous, exits or appears
        self._rdv_memo: tuple[int, float | None] = (
            -1,
            None,
        )  # (version, _all_in_rendezvous()): O(1), not O(ranks)
        self._check_memo: dict | None = None  # section budgets during one check()
        # the deadlines' lower bounds (``_might_stall``): per section, (last_progress, rank) of
        # every rank that entered it, and (last_seen, rank); stale entries are skipped lazily
        self._progress: dict[str, list[tuple[float, int]]] = {
            "launch": [(self.start_ts, r) for r in range(self.world_size)]
        }
        self._seen: list[tuple[float, int]] = []
        # cohorts: first rank -> (its ranks, the one state they share, their set); valid while
        # that state's ``refs`` is their number (none left it: ``_own``, ``_form``)
        self._cohorts: dict[int, tuple[list[int], _Rank, frozenset]] = {}
        self._unformed: dict[int, int] = {}  # first rank -> groups to pass before trying again
        self.finished_ts: float | None = None  # a rank's clean exit: the job is ending
        self.full_checks = 0  # checks that walked every rank (the rest looked at the heaps only)
        # groups of ``COHORT_MIN`` ranks or more: [moved as a cohort, moved rank by rank]
        self.group_moves = [0, 0]

    def _new_rank(self) -> _Rank:
        return _Rank(last_progress=self.start_ts, since=self.start_ts)

    # ------------------------------------------------------------ input
    def observe(self, rec: dict) -> None:
        kind = rec.get("kind")
        rank = rec.get("rank")
        if rank is None:
            return
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[int(rank)] = self._new_rank()
            self._rdv_version += 1
            if int(rank) in self._rdv_entered:
                self._rdv_waiting.discard(int(rank))
            else:
                self._rdv_waiting.add(int(rank))
            heapq.heappush(self._progress.setdefault("launch", []), (st.last_progress, int(rank)))
        ts = float(rec["ts"])
        if st.refs > 1 and (kind != "ping" or st.last_seen is None or ts > st.last_seen):
            st = self._own(rank, st)
        self._saw(st, int(rank), ts)
        if kind == "ping":
            return
        if kind == "exit":
            st.exited = True
            self._rdv_version += 1
            self._rdv_waiting.discard(int(rank))
            if rec.get("code") == 0 and self.finished_ts is None:
                self.finished_ts = ts
            return
        step = int(rec.get("step", st.step) or 0)
        section = st.section
        if kind == "metrics":
            pos, phase = (step, _STAGE["end"]), "step"
            step_s = rec.get("step_s")
            if isinstance(step_s, (int, float)) and step_s > 0:
                if not st.stepped:
                    self.learned.add("first_step", float(step_s))
                else:
                    self._step_took(float(step_s))
            st.stepped = True
            new_section = "step"
        elif kind == "beat":
            phase = rec.get("phase", "step")
            if phase == "startup":
                new_section = rec.get("section") or "import"
                if new_section not in STARTUP_SECTIONS:
                    new_section = "import"
                pos = (
                    -1,
                    STARTUP_SECTIONS.index(new_section),
                )  # before any step; later sections ahead
            elif phase in ("checkpoint", SAVE):
                pos, new_section = (step, _STAGE["checkpoint"]), "checkpoint"
            elif phase in PAUSES:
                pos, new_section = (
                    (step - 1, _STAGE["end"]),
                    phase,
                )  # step n-1 done, step n not begun
            elif (
                phase == "data"
            ):  # the batch of step n; before the attempt's first step: part of it
                pos, new_section = (
                    (step - 1, _STAGE["end"]),
                    "data" if st.stepped else "first_step",
                )
            elif rec.get("stage") == "begin":
                pos = (step, _STAGE["begin"])
                new_section = "step" if st.stepped else "first_step"
            elif st.phase == "checkpoint":
                pos, new_section = (step, _STAGE["after_checkpoint"]), "step"
            else:
                pos, new_section = (step, _STAGE["end"]), "step"
        else:
            return
        # the section that ends here: learn its duration (steps learn from step_s, holds have none)
        if st.phase in LEARNED_SEAMS and phase != st.phase and st.section == "step":
            self.learned.add(st.phase, ts - st.last_progress)  # a seam began at its own beat
        if new_section != section or phase != st.phase:
            if section in _TIMED:
                begun = st.since
                if section == "rendezvous":
                    begun = max(begun, self._all_in_rendezvous() or begun)
                self.learned.add(
                    section, ts - max(begun, self.resumed_at if section != "eval" else begun)
                )
            elif section == "launch" and new_section != "launch":
                self.learned.add("launch", ts - self.start_ts)
            st.since = ts if new_section in _TIMED else 0.0
            if new_section == "rendezvous":
                self._rdv_entered[int(rank)] = ts
                self._rdv_waiting.discard(int(rank))
                self._rdv_version += 1
        if st.phase in PAUSES and phase not in PAUSES:
            self.resumed_at = max(self.resumed_at, ts)
        st.step, st.phase, st.pos, st.section = step, phase, pos, new_section
        st.last_progress = ts
        if phase != HOLD:  # a hold has no deadline
            heapq.heappush(self._progress.setdefault(new_section, []), (ts, int(rank)))

    def observe_steps(self, kind: str, done: list, ts: float) -> None:
        """``observe`` of one kind of step progress for each (rank, step, step_s) of ``done``, in
        order, all arrived at ``ts``: ``metrics`` (the step ended; ``step_s`` its duration) or
        ``begin`` (a ``step`` beat with ``stage="begin"``; ``step_s`` unused). The same effect as
        ``observe`` of each (tested against it). Why: a node's step group is one call, not eight,
        and a rank in the steady state (in a step, past its first) needs none of the general
        path's dict and branches (docs/scale.md, "The budget at 131,072 ranks")."""
        ranks = self.ranks
        heap = self._progress.get("step")
        end = kind == "metrics"
        stage = _STAGE["end" if end else "begin"]
        pos = (None, stage)  # one tuple for the ranks of a step (a group's are all of one)
        moved: list[int] = []  # the ranks stamped ``ts`` here: ONE heap entry (``_push``)
        seen: list[int] = []
        for rank, step, step_s in done:
            st = ranks.get(rank)
            if st is not None and st.refs > 1:
                st = self._own(rank, st)
            if (
                heap is None
                or st is None
                or st.section != "step"
                or st.phase != "step"
                or not st.stepped
            ):
                self.observe(
                    {"kind": "metrics", "rank": rank, "step": step, "step_s": step_s, "ts": ts}
                    if end
                    else {
                        "kind": "beat",
                        "rank": rank,
                        "step": step,
                        "phase": "step",
                        "stage": "begin",
                        "section": None,
                        "ts": ts,
                    }
                )
                heap = self._progress.get("step")
                continue
            last = st.last_seen  # ``_saw``, inline: its call was a sixth of this loop
            if last is None or ts > last:
                st.last_seen = ts
                if st.seen_key is None or ts - st.seen_key > SEEN_GRAIN:
                    st.seen_key = ts
                    seen.append(rank)
            if end:
                if isinstance(step_s, (int, float)) and step_s > 0:
                    self._step_took(float(step_s))
                st.stepped = True
            if step != pos[0]:
                pos = (step, stage)
            st.step, st.pos, st.last_progress = step, pos, ts
            moved.append(rank)
        _push(heap, ts, moved)
        _push(self._seen, ts, seen)

    def observe_ranks(
        self, kind: str, ranks: list[int], step: int, ts: float, timed: tuple | None = None
    ) -> None:
        """``observe_steps`` of ``ranks`` all at ``step``, without a step time but ``timed``'s
        ((rank, step_s): a summary's slowest). Ranks that share one state (a cohort: a relay's
        routine ranks, step after step) move as ONE update and one heap entry, not one a rank:
        the supervisor's work grows with relays, not ranks (issue 24; docs/scale.md). A group
        becomes a cohort once its ranks' states are equal (they moved together); any rank's own
        change gives it its own state again (``_own``). Its leader, whose record is its own and
        whose beat comes with the others', stands beside it (``lone``)."""
        c, lone = self._cohort(ranks)
        if c is not None and self._move_cohort(kind, c, step, ts, timed):
            self.group_moves[0] += 1
            if lone is not None:
                self.observe_steps(kind, [(lone, step, _timed(timed, lone))], ts)
            return
        self.observe_steps(kind, [(r, step, _timed(timed, r)) for r in ranks], ts)
        if len(ranks) >= COHORT_MIN:
            self.group_moves[1] += 1
            if c is None or lone is None:
                self._form(ranks)

    def _cohort(self, ranks: list[int]) -> tuple[tuple | None, int | None]:
        """The live cohort of ``ranks``, or of all but the first (then named: the leader)."""
        if len(ranks) < COHORT_MIN:
            return None, None
        c = self._cohorts.get(ranks[0])
        if c is not None and c[1].refs == len(c[0]) and (c[0] is ranks or c[0] == ranks):
            return c, None
        c = self._cohorts.get(ranks[1])
        if c is not None and c[1].refs == len(c[0]) and c[0] == ranks[1:]:
            return c, ranks[0]
        return None, None

    def _move_cohort(self, kind: str, c: tuple, step: int, ts: float, timed: tuple | None) -> bool:
        """``observe_steps``' steady-state body, once for a cohort's shared state; False (nothing
        done) when it is not in the steady state (its ranks then go one by one)."""
        members, st, mset = c
        heap = self._progress.get("step")
        if heap is None or st.section != "step" or st.phase != "step" or not st.stepped:
            return False
        end = kind == "metrics"
        last = st.last_seen
        if last is None or ts > last:
            st.last_seen = ts
            if st.seen_key is None or ts - st.seen_key > SEEN_GRAIN:
                st.seen_key = ts
                _push(self._seen, ts, members)
        if end:
            step_s = timed[1] if timed is not None and timed[0] in mset else None
            if isinstance(step_s, (int, float)) and step_s > 0:
                self._step_took(float(step_s))
            st.stepped = True
        st.step, st.pos, st.last_progress = step, (step, _STAGE["end" if end else "begin"]), ts
        _push(heap, ts, members)
        return True

    def _step_took(self, seconds: float) -> None:
        """A step's duration learned (and kept in the ``window`` ring of older recipes)."""
        self.learned.add("step", seconds)
        if self._recent:
            self._recent[self._recent_i % len(self._recent)] = seconds
            self._recent_i += 1

    def _form(self, ranks: list[int]) -> None:
        """Make ``ranks`` a cohort when their states are equal and steady (one walk over them;
        a group that cannot be one is tried again ``COHORT_RETRY`` groups later)."""
        key = ranks[0]
        wait = self._unformed.get(key, 0)
        if wait > 0:
            self._unformed[key] = wait - 1
            return
        sts = list(map(self.ranks.get, ranks))
        first = sts[0]
        if (
            first is None
            or first.section != "step"
            or first.phase != "step"
            or first.exited
            or sts.count(first) != len(sts)  # (equal but ``refs``: dataclass ``__eq__``)
            or len(set(ranks)) != len(ranks)
        ):
            self._unformed[key] = COHORT_RETRY
            return
        shared = first.alone()
        shared.refs = len(ranks)
        for old in sts:
            old.refs -= 1  # (a cohort it was of is no longer live)
        self.ranks.update(dict.fromkeys(ranks, shared))
        members = list(ranks)
        self._cohorts[key] = (members, shared, frozenset(members))
        self._unformed.pop(key, None)

    def _own(self, rank: int, st: _Rank) -> _Rank:
        """The rank's state to change alone: a copy of its own when it shares one (a cohort,
        which is then no longer live)."""
        st.refs -= 1
        own = self.ranks[rank] = st.alone()
        return own

    def _saw(self, st: _Rank, rank: int, ts: float) -> None:
        if st.last_seen is None or ts > st.last_seen:
            st.last_seen = ts
            if st.seen_key is None or ts - st.seen_key > SEEN_GRAIN:
                st.seen_key = ts
                heapq.heappush(self._seen, (ts, rank))

    def seen(self, rank: int, ts: float) -> None:
        """A ping without the dict: a node's liveness summary names many ranks at once."""
        st = self.ranks.get(rank)
        if st is None:
            self.observe({"kind": "ping", "rank": rank, "ts": ts})
        else:
            if st.refs > 1 and (st.last_seen is None or ts > st.last_seen):
                st = self._own(rank, st)
            self._saw(st, rank, ts)

    def _all_in_rendezvous(self) -> float | None:
        """When the last live rank reached the rendezvous (None while one is still before it).
        Remembered until a rank enters, exits or appears: every rank leaving the rendezvous and
        every check asks, which made start-up O(ranks^2) (8,192 ranks: ~50 s per check,
        bench/scale_load.py). None while a live rank is waited for, without a walk: nodes come
        in one by one, each a change, and a walk each was O(nodes x ranks) again (16,384 ranks:
        3.4 s of CPU in the start-up burst; 131,072: ~3 minutes)."""
        if self._rdv_waiting:
            return None
        version, value = self._rdv_memo
        if version == self._rdv_version:
            return value
        value = self._all_in_rendezvous_now()
        self._rdv_memo = (self._rdv_version, value)
        return value

    def _all_in_rendezvous_now(self) -> float | None:
        latest = None
        for r, st in self.ranks.items():
            if st.exited:
                continue
            t = self._rdv_entered.get(r)
            if t is None:
                return None
            latest = t if latest is None or t > latest else latest
        return latest

    # ------------------------------------------------------------ budgets
    def section_timeout(self, section: str, _fallback: bool = False) -> float:
        memo = self._check_memo
        if (
            memo is not None
        ):  # inside check(): nothing it depends on changes, so once per section, not per rank
            key = (section, _fallback)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = self._section_timeout(section, _fallback)
            return hit
        return self._section_timeout(section, _fallback)

    def _section_timeout(self, section: str, _fallback: bool = False) -> float:
        c = self.config
        # a start-up section is judged by earlier attempts; as a fallback (step 2 judged by the
        # first step) this attempt's durations count too
        startup = (section in STARTUP_SECTIONS or section == "first_step") and not _fallback
        known = self.prior if startup else self.learned
        p99 = known.p99(section)
        if p99 is None and section in LEARNED_SEAMS:  # no history yet: the step's budget
            return self.step_timeout()
        if p99 is None and section in _FALLBACK:  # no history yet: the slower section it follows
            return self.section_timeout(_FALLBACK[section], _fallback=True)
        if section == "step" and self._recent:
            recent = max(self._recent)
            p99 = recent if p99 is None or recent > p99 else p99
        if p99 is None:
            return c.first_budget(section)
        return max(c.floor(section), c.multiplier * p99, c.seen_multiplier * known.longest(section))

    def step_timeout(self) -> float:
        return self.section_timeout("step")

    def budget(self, rank: int) -> tuple[float, float, str]:
        """(deadline, timeout, phase name) of one rank."""
        d, t, phase, _ = self._budget(rank)
        return d, t, phase

    def _budget(self, rank: int) -> tuple[float, float, str, str]:
        c = self.config
        st = self.ranks[rank]
        if st.phase == HOLD:
            return math.inf, math.inf, HOLD, HOLD
        section = st.section
        since = max(st.last_progress, self.resumed_at)
        # the run's end: past its known last step, or a peer already left cleanly
        ending = self.finished_ts is not None or (
            c.total_steps is not None and st.step >= c.total_steps
        )
        if section in STARTUP_SECTIONS or section == "first_step":
            if section == "rendezvous":
                everyone = self._all_in_rendezvous()
                if everyone is None:  # a peer is still before the rendezvous: it is the one judged
                    return math.inf, math.inf, "startup", section
                since = max(since, everyone)
            elif section == "launch":
                since = max(self.start_ts, self.resumed_at)
            t = self.section_timeout(section)
            return since + t, t, "startup", section
        if section == "checkpoint":
            if ending:
                return (
                    since + c.checkpoint_s,
                    c.checkpoint_s,
                    "checkpoint",
                    "checkpoint",
                )  # the final save: never learned
            t = self.section_timeout("checkpoint")
            return since + t, t, "checkpoint", "checkpoint"
        if section == EVAL:
            t = self.section_timeout(EVAL)
            return st.last_progress + t, t, EVAL, EVAL
        if section == ENGINE_WAIT:
            t = c.engine_wait_s
            return st.last_progress + t, t, ENGINE_WAIT, ENGINE_WAIT
        if ending and (self.finished_ts is not None or st.pos[1] >= _STAGE["end"]):
            return since + c.checkpoint_s, c.checkpoint_s, "finishing", "finishing"
        if section == "data":
            t = self.section_timeout("data")
            return since + t, t, "data", "data"
        t = self.step_timeout()
        if st.phase in SEAMS:
            if st.phase in LEARNED_SEAMS:
                t = min(t, self.section_timeout(st.phase))
            return since + t, t, st.phase, "step"
        return since + t, t, "step", "step"

    def _stale_after(self, st: _Rank) -> float:
        if st.section in STARTUP_SECTIONS or st.section == "first_step":
            return max(self.config.startup_ping_stale_s, self.step_timeout())
        if self.finished_ts is not None:
            # a peer finished: this rank's teardown may ping nothing for longer than a step (a
            # process group's destructor in C holding the GIL: ~5 s on a loaded box)
            return max(self.step_timeout(), self.config.checkpoint_s)
        return max(self.step_timeout(), self.config.ping_stale_s)

    def _unresponsive_past_step_timeout(self, rank: int, now: float) -> bool:
        """A rank that sends nothing at all, not even pings: judged by the step budget in every
        phase but the start-up (a stopped rank inside a checkpoint save must not get the long save
        budget)."""
        st = self.ranks[rank]
        if st.last_seen is None:
            return False
        return now - st.last_seen > self._stale_after(st)

    # ------------------------------------------------------------ deadlines
    def _lowest_timeout(self, section: str) -> float:
        """A lower bound of the timeout ``_budget`` gives any rank in ``section``: the deadline
        is ``since + timeout`` with ``since`` never before the rank's last progress."""
        c = self.config
        if section in STARTUP_SECTIONS or section == "first_step":
            return self.section_timeout(section)
        if section == EVAL:
            return self.section_timeout(EVAL)
        if section == "checkpoint":  # the final save: checkpoint_s
            return min(c.checkpoint_s, self.section_timeout("checkpoint"))
        t = self.section_timeout("data") if section == "data" else self.step_timeout()
        if section == "step":  # a rank in a seam: the seam's own budget when it is shorter
            t = min([t, *(self.section_timeout(seam) for seam in LEARNED_SEAMS)])
        return min(c.checkpoint_s, t)  # past the last step: "finishing"

    def _oldest(self, heap: list[tuple], valid, stamp: str) -> float | None:
        """The smallest key of ``heap`` still true of its rank, or of one of its group's ranks
        (``_push``): stale entries popped, a group cut down to its ranks still at the key (each
        rank's ``stamp`` looked at first, so a group that moved on costs no call a rank)."""
        while heap:
            e = heap[0]
            key = e[0]
            if len(e) == 2:
                if valid(key, e[1]):
                    return key
                heapq.heappop(heap)
                continue
            c = self._cohorts.get(e[1])
            if c is not None and c[0] is e[2] and c[1].refs == len(e[2]):
                if valid(key, e[1]):  # one state: what is true of one is true of all
                    return key
                heapq.heappop(heap)
                continue
            ranks = self.ranks
            if stamp == "last_progress":
                live = [r for r in e[2] if ranks[r].last_progress == key and valid(key, r)]
            else:
                live = [r for r in e[2] if ranks[r].seen_key == key and valid(key, r)]
            if live and len(live) == len(e[2]):
                return key
            if live:
                heapq.heapreplace(heap, (key, live[0], live))
                return key
            heapq.heappop(heap)
        return None

    def _might_stall(self, now: float) -> bool:
        """Whether any rank's deadline, or its liveness bound, may have passed: what a check walks
        every rank for otherwise. Each section's oldest progress plus the least timeout any rank
        in it can have; the oldest liveness stamp plus the least staleness bound. O(sections)
        plus the stale entries popped (each pushed once), where the walk was O(ranks): 131,072
        ranks checked every 0.1 s (issue 24)."""
        ranks, limit = self.ranks, 4 * len(self.ranks) + 1024
        for section, heap in self._progress.items():
            if len(heap) > limit:  # one rank long in a section while the rest move on: compact
                heap[:] = [
                    (st.last_progress, r) for r, st in ranks.items()
                    if st.section == section and st.phase != HOLD and not st.exited
                ]  # fmt: skip
                heapq.heapify(heap)

            def current(key: float, r: int, section: str = section) -> bool:
                st = ranks[r]
                return (
                    not st.exited and st.section == section and st.phase != HOLD
                    and st.last_progress == key
                )  # fmt: skip

            oldest = self._oldest(heap, current, "last_progress")
            if oldest is not None and now > oldest + self._lowest_timeout(section):
                return True
        if len(self._seen) > limit:
            self._seen[:] = [
                (st.seen_key, r) for r, st in ranks.items()
                if st.seen_key is not None and not st.exited
            ]  # fmt: skip
            heapq.heapify(self._seen)
        oldest = self._oldest(
            self._seen, lambda key, r: not ranks[r].exited and ranks[r].seen_key == key, "seen_key"
        )
        if oldest is None:
            return False
        c = self.config
        stale = max(self.step_timeout(), min(c.startup_ping_stale_s, c.ping_stale_s))
        return now - oldest > stale

    # ------------------------------------------------------------ output
    def check(self, now: float, judge: Callable[[int], float] | None = None) -> HangFinding | None:
        """The hang, if any, judged at ``now``; with ``judge``, each rank at ``min(now,
        judge(rank))``: the time up to which everything that rank sent has been seen (a
        supervisor behind on some connections judges their ranks at what it has read, the
        others at the clock)."""
        self._check_memo = {}
        try:
            if not self._might_stall(now):
                return None
            self.full_checks += 1
            return self._check(now, judge)
        finally:
            self._check_memo = None

    def _check(self, now: float, judge: Callable[[int], float] | None = None) -> HangFinding | None:
        c = self.config
        ranks = self.ranks
        live = [r for r, st in sorted(ranks.items()) if not st.exited]
        at = dict.fromkeys(live, now) if judge is None else {r: min(now, judge(r)) for r in live}
        # (a state, the time it is judged at) -> (pausing, unresponsive, past its budget, silent
        # past its step budget): the ranks of a cohort share one state, so one answer (131,072
        # ranks: the walk took 1.3 s, which the silent rank's finding waited for)
        memo: dict[tuple, tuple] = {}

        def facts(r: int) -> tuple:
            st, t = ranks[r], at[r]
            f = memo.get((id(st), t))
            if f is None:
                quiet = st.last_seen is None or t - st.last_seen > c.ping_stale_s
                f = memo[(id(st), t)] = (
                    st.phase in PAUSES and not quiet,
                    quiet,
                    t > self._budget(r)[0],
                    self._unresponsive_past_step_timeout(r, t),
                )
            return f

        if judge is None:  # all judged at ``now``: the states' answers, then each rank's (in C)
            states = list(map(ranks.__getitem__, live))
            first = dict(zip(map(id, reversed(states)), reversed(live)))  # a rank of each state
            answer = {k: facts(r) for k, r in first.items()}
            fs = list(map(answer.__getitem__, map(id, states)))
        else:
            fs = [facts(r) for r in live]
        # a declared pause of a live rank pauses the job: its peers block on it by design
        pausing = [r for r, f in zip(live, fs) if f[0]]
        held = set(pausing)
        stalled = [
            r for r, f in zip(live, fs) if ((not pausing or r in held) and f[2]) or f[3]
        ]  # fmt: skip
        if not stalled:
            return None

        quiet = [r for r, f in zip(live, fs) if f[1]]
        also_quiet: list[int] = []
        if quiet and len(quiet) < len(live):
            culprits, also_quiet = self._first_silent(quiet, stalled, at)
            why = "unresponsive"
        elif pausing and held.issuperset(stalled):  # a declared pause outran its own budget
            culprits, why = stalled, "behind"
        else:
            lowest = min(self.ranks[r].pos for r in live)
            behind = [r for r in live if self.ranks[r].pos == lowest]
            if len(behind) < len(live):
                culprits, why = behind, "behind"
            else:
                culprits, why = live, "all"
        first = min(culprits, key=lambda r: self.ranks[r].last_progress)
        judged = next((r for r in culprits if r in stalled), stalled[0])
        deadline, timeout, phase, section = self._budget(judged)
        by_silence = (pausing and judged not in pausing) or at[judged] <= deadline
        if by_silence:  # stalled by the unresponsive rule
            timeout, phase = self._stale_after(self.ranks[judged]), f"unresponsive in {phase}"
        return HangFinding(
            ranks=culprits,
            stalled=stalled,
            step=min(self.ranks[r].step for r in culprits),
            silent_s=at[first] - self.ranks[first].last_progress,
            phase=phase,
            timeout_s=timeout,
            why=why,
            section=section,
            also_quiet=also_quiet,
        )

    def _first_silent(
        self, quiet: list[int], stalled: list[int], at: dict[int, float]
    ) -> tuple[list[int], list[int]]:
        """The quiet ranks that went silent first (within ``ping_stale_s`` of the longest silence
        among the stalled ones), and the rest. A frozen node's ranks stop together, their last pings
        at most a heartbeat apart; a rank quiet for a few seconds when another's budget ran out (a
        late sender, a loaded host) has not been silent as long, and naming it would blame its
        node too (a Slurm strike needs every named rank on one node)."""

        def silence(r: int) -> float:
            seen = self.ranks[r].last_seen
            return at[r] - (self.start_ts if seen is None else seen)

        stalled_set = set(stalled)
        longest = max(silence(r) for r in ([r for r in quiet if r in stalled_set] or quiet))
        first = longest - self.config.ping_stale_s
        named = [r for r in quiet if silence(r) >= first]
        return named, [r for r in quiet if silence(r) < first]
