"""One attempt: start torchrun with the channel's address, watch it, and say how it ended.

Why a part of its own: this is the lifecycle of a single torchrun (env, spawn, the
watch loop, teardown in ``finally``) and its verdict as an :class:`Outcome`; the run
loop in ``core`` only decides what to do with that verdict. Who failed first is
:mod:`ptops.ops.supervisor.blame` (pure).

Used as a mixin of :class:`ptops.ops.supervisor.core.Supervisor`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time

from ptops import envnames
from ptops.faultinject.spec import to_env as faults_to_env
from ptops.monitors.hang import HangMonitor
from ptops.ops.rank.channel import ENV_ADDRESS, ENV_TOKEN, SUMMARY_ENV
from ptops.ops.rank.probe import flight_recorder_env
from ptops.ops.runrecord.events import EventKind, RunState
from ptops.ops.supervisor import launcher, procs
from ptops.ops.supervisor.blame import WORKER_FAILED, Blame, root_cause
from ptops.ops.supervisor.outcome import Outcome
from ptops.ops.supervisor.policy import fatal_startup_error, same_error_everywhere

CHECK_S = 0.1  # the attempt loop's cadence: channel messages, then exits, findings and hangs
# a hang check that finds nothing looks at deadlines only (``HangMonitor._might_stall``); it walks
# every rank (8,192 ranks: 30-70 ms) only when a deadline may have passed. A check may take at most
# this share of the loop, else the handlers fall behind (bench/scale_load.py).
CHECK_SHARE = 0.1
# A backlog older than this (messages received, not handled yet) is said once per episode: hangs
# are judged at the oldest unhandled arrival meanwhile (``judge_time``), so a rank whose ping waits
# in the inbox is never silent; detection waits for the backlog instead.
INBOX_LAG_S = 1.0
FREEZE_S = 10.0  # ``_Frozen``: what became long-lived since is frozen this often


class _Frozen:
    """The attempt's long-lived objects (per rank: a peer, a ``RankInfo``, each monitor's state:
    millions at 131,072 ranks) kept out of the cyclic collector's full passes (``gc.freeze``,
    O(1)) as the rank table grows and every ``FREEZE_S`` after, and given back to it when the
    attempt ends (``gc.unfreeze``: what the attempt dropped is collected then). Why: a full pass
    walked them all, 0.4-1.2 s at 131,072 ranks and ~15 times a minute, pauses in which no message
    is handled (the silent rank found that much later; bench/scale_load.py ``gc_full_*``).
    Reference counting frees a frozen object as usual; only garbage in cycles waits for the
    attempt's end, and the supervisor makes next to none (the bench's ``gc_collected``)."""

    def __init__(self) -> None:
        self.ranks = 0
        self.at = 0.0

    def tick(self, ranks: int, now: float) -> None:
        if ranks > self.ranks or now - self.at >= FREEZE_S:
            gc.freeze()
            self.ranks, self.at = ranks, now

    def end(self) -> None:
        if self.at:
            gc.unfreeze()
            self.ranks, self.at = 0, 0.0


class AttemptMixin:
    def _rank_pids(self) -> list[int]:
        return [r.pid for r in self.ranks.values()]

    def run_attempt(self, attempt: int) -> Outcome:
        self.ranks = {}
        self.stop_acks = {}
        self.blame = Blame()
        self.ckpt_started = {}
        self.misconfigured = None
        self.run.logs(attempt).mkdir(parents=True, exist_ok=True)
        stack_dir = self.run.path / "stacks" / f"attempt-{attempt}"
        extra = {
            ENV_ADDRESS: self.server.address(self.cfg.channel_advertise),
            ENV_TOKEN: self.server.token,
            envnames.SUPERVISOR_PID: str(os.getpid()),
            envnames.HEARTBEAT_S: str(self.cfg.heartbeat_s),
        }
        if self.faults:
            extra[envnames.FAULTS] = faults_to_env(self.faults)
        extra.update(self.findings.attempt_env())  # PTOPS_ROLLBACK after a rollback
        extra[envnames.RESUME_FROM] = (self.good or {}).get(
            "path"
        ) or ""  # verified by the supervisor: the ranks do not again
        # the names the ranks' torch reads, no deprecated one (gloo records too: hang analysis)
        extra.update(flight_recorder_env(str(stack_dir / "flight_recorder_rank_")))
        extra.update(self.summary_env())
        # attempt_command may say warm
        self.ranks_from = {
            "ranks_from": "cold",
            "cold_why": "no_pool",
            "cold_detail": self.no_warm_why,
        }
        cmd = self.attempt_command(attempt, extra)
        from_step = (self.good or {}).get("step", 0)
        self.step = from_step  # the engine resumes there; steps after it are redone
        self.event(
            EventKind.LAUNCH,
            attempt=attempt,
            supervised=self.supervised,
            nproc=self.recipe.launch.nproc,
            from_step=from_step,
            supervisor_pid=os.getpid(),
            faults=[str(f) for f in self.faults if f.attempt in (0, attempt)],
            warm_pool=self.warm is not None,
            **self.ranks_from,
            **self.launch_fields(attempt),
        )
        t0 = time.monotonic()
        self.monitor = HangMonitor(
            self.world,
            t0,
            # a script decides its own length: no step is "the last" (its final save is judged as
            # any save)
            self.cfg.hang.model_copy(
                update={
                    "total_steps": None
                    if completes_on_exit(self.recipe)
                    else self.recipe.train.steps
                }
            ),
            # section durations of the earlier attempts: start-up judged in seconds
            learned=self.learned,
        )
        self.transition(RunState.STARTING, "launch")
        self.proc = procs.spawn(cmd.argv, cmd.env, self.run.logs(attempt) / "torchrun.log")
        if self.warm is not None and self.warm.wanted:
            # imports alongside this attempt's ranks: ready for a crash soon after they train
            self.warm.start()
        self.write_status(force=True)
        bad_since: float | None = None
        next_check = 0.0
        frozen = _Frozen()
        try:
            while True:
                self.pump(CHECK_S)
                frozen.tick(len(self.ranks), time.monotonic())
                if self.stop_signal is not None:
                    self.graceful_stop()
                    return Outcome("interrupted", f"signal {self.stop_signal}")
                if self.misconfigured is not None:
                    return self.on_misconfigured(attempt)
                if (
                    self.findings.pending is not None
                ):  # wins over the crash a NaN causes right after
                    return self.findings.end_attempt(attempt)
                rc = self.proc.poll()
                if rc is not None:
                    self.pump(0.3, drain=True)
                    if self.findings.pending is not None:
                        return self.findings.end_attempt(attempt)
                    return self._after_exit(rc, attempt)
                if self.blame.first is not None:
                    # torchrun notices within its monitor interval and stops the others; give it a
                    # moment
                    bad_since = bad_since or time.monotonic()
                    code = self._torchrun_exit_code(attempt, self.blame.first.rank)
                    if code is None:
                        code = self.unreaped_exit_code(self.blame.first.rank)
                    if code is not None:
                        # torchrun has logged (or the kernel holds) the first bad rank's exit code,
                        # all the crash event needs; torchrun's own shutdown (stopping the others,
                        # its summary) takes seconds more
                        if self.blame.first.exit_code is None:
                            self.blame.first = dataclasses.replace(self.blame.first, exit_code=code)
                        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
                        rc = self.proc.returncode
                        return self._after_exit(rc if rc not in (None, 0) else 1, attempt)
                    if time.monotonic() - bad_since > self.cfg.kill_timeout_s:
                        procs.teardown(
                            self.proc,
                            self.run.path,
                            self._rank_pids(),
                            grace_s=self.cfg.kill_timeout_s,
                        )
                        return self._after_exit(
                            self.proc.returncode if self.proc.returncode is not None else -9,
                            attempt,
                        )
                    continue
                # one cadence ahead: a budget that runs out before the next check is declared now,
                # so a finding is never later than its budget (at most CHECK_S earlier) while checks
                # cost under CHECK_SHARE of CHECK_S; later by at most the stretched cadence when
                # they cost more
                now = time.monotonic()
                if now < next_check:
                    self.write_status()
                    continue
                judge = self.judge_time(now)
                finding = self.monitor.check(judge + CHECK_S)
                if finding is None and self.inbox_behind:
                    # behind: a rank silent on a connection that is read and handled to about the
                    # clock is silent for sure (a frozen node); a stall among ranks whose progress
                    # may be queued waits for the rule above
                    silent = self.monitor.check(now + CHECK_S, self.rank_judge(now, judge))
                    if silent is not None and silent.why == "unresponsive":
                        finding = dataclasses.replace(silent, behind_s=now - judge)
                next_check = now + (time.monotonic() - now) / CHECK_SHARE
                if finding is not None:
                    finding = dataclasses.replace(
                        finding, silent_s=max(0.0, finding.silent_s - CHECK_S)
                    )
                    return self.on_hang(finding, attempt, stack_dir)
                self.write_status()
        finally:
            frozen.end()
            self.attempt_cleanup(attempt)
            if self.proc is not None and self.proc.poll() is None:
                procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
            else:
                left = procs.run_processes(self.run.path)
                if left:
                    procs.teardown(None, self.run.path, left, grace_s=0)
            # last: an event write that fails (a full disk) must not skip the teardown above
            self.inbox_caught_up(time.monotonic(), "attempt_ended")

    def rank_judge(self, now: float, floor: float):
        """Per rank, the time up to which the hang check may judge it while the supervisor is
        behind (``inbox_behind``): its connection's ``conn_read_until``, one cadence ahead as the
        check is; ``floor`` (``judge_time``) for a rank without a connection yet. Why: under a
        backlog the global rule held every judgment at the oldest queued message, so a frozen
        node was found the backlog's age late (16,384 ranks: 74-118 s on a 40 s budget), though
        nothing it sent could be in the queue."""
        server, ranks = self.server, self.ranks

        def judge(rank: int) -> float:
            info = ranks.get(rank)
            if info is None or info.peer is None or server is None:
                return floor + CHECK_S
            return server.conn_read_until(info.peer, now) + CHECK_S

        return judge

    def judge_time(self, now: float) -> float:
        """When the hang check may judge up to: ``now``, or, with messages received but not yet
        handled, the oldest one's arrival (the monitor has seen everything before it, nothing
        after), or, when the channel thread is behind reading its sockets, the last time it had
        read everything (``ChannelServer.read_until``). A lag over ``INBOX_LAG_S`` is recorded
        once per episode (``inbox_behind``)."""
        if self.server is None:
            return now
        oldest = min(
            x
            for x in (self.server.oldest_unhandled(), self.server.read_until(), now)
            if x is not None
        )
        lag = max(0.0, now - oldest)
        ep = self.inbox_behind
        if lag > INBOX_LAG_S and not ep:
            queued = self.server.inbox.qsize()
            self.inbox_behind = {"since": now, "max_lag_s": lag, "max_queued": queued}
            self.event(
                EventKind.INBOX_BEHIND, attempt=self.attempt, lag_s=round(lag, 3), queued=queued
            )
            self.say(
                f"the channel is {lag:.1f} s behind ({queued} messages queued): hang checks "
                "judge at what has been read until it catches up"
            )
        elif ep and lag < INBOX_LAG_S / 2:
            self.inbox_caught_up(now)
        elif ep:
            ep["max_lag_s"] = max(ep["max_lag_s"], lag)
            ep["max_queued"] = max(ep["max_queued"], self.server.inbox.qsize())
        return now - lag

    def inbox_caught_up(self, now: float, why: str = "drained") -> None:
        """Close an open ``inbox_behind`` episode with how long it lasted and its worst lag: the
        exporter's ``ptops_supervisor_behind`` (and the SupervisorBehind alert) clears on it.
        ``why``: drained, or the attempt ended while behind."""
        ep, self.inbox_behind = self.inbox_behind, None
        if not ep:
            return
        behind_s = max(0.0, now - ep["since"])
        self.event(
            EventKind.INBOX_CAUGHT_UP,
            attempt=self.attempt,
            behind_s=round(behind_s, 3),
            max_lag_s=round(ep["max_lag_s"], 3),
            max_queued=ep["max_queued"],
            why=why,
        )
        if why == "drained":
            self.say(
                f"the channel caught up after {behind_s:.1f} s behind (worst lag "
                f"{ep['max_lag_s']:.1f} s): hang checks judge at the clock again"
            )

    # ---------------------------------------------- launch backend hooks (ops/slurm overrides them)
    def summary_env(self) -> dict[str, str]:
        """``node_summaries``: what the node agents may sum up (``ops/rank/channel.py``): every
        K-th step whole, and the keys the shared monitors read (a rank differing in one goes
        whole); nothing when off."""
        if not self.cfg.node_summaries:
            return {}
        read = self.feed.read_keys()
        every = self.cfg.metrics_rank_detail_every
        return {
            SUMMARY_ENV: json.dumps(
                {"every": every, "read": sorted(read) if read is not None else None}
            )
        }

    def attempt_command(self, attempt: int, extra: dict[str, str]) -> launcher.RankCommand:
        """The process that runs one attempt's ranks: this machine's node agent (a one-node run:
        the path of every node of a Slurm run, ``ops/node/agent.py``) around local torchrun, or
        around the warm pool's launcher once the pool is up (a restart); ``srun`` + node agents in
        Slurm."""
        cmd = self._launcher_command(attempt, extra)
        log = self.run.logs(attempt) / "torchrun.log"
        return launcher.node_agent_command(cmd, self.recipe.launch.nproc, log)

    def _launcher_command(self, attempt: int, extra: dict[str, str]) -> launcher.RankCommand:
        cmd = launcher.rank_command(self.recipe, self.run, attempt, extra_env=extra)
        if self.warm is None:
            return cmd
        # a pool still importing is waited for: a cold start would compete with it for the same
        # cores
        self.ranks_from = self.warm.source(
            self.cfg.hang.import_s, lambda: self.stop_signal is not None
        )
        if self.ranks_from["ranks_from"] == "warm":
            # only a warm attempt names the pool: a cold attempt's ranks (torchrun) must not hand
            # off to a pool that became ready meanwhile, or the launch event would say cold for
            # ranks forked warm
            warm_cmd = launcher.RankCommand(cmd.argv, {**cmd.env, **self.warm.env()})
            return self.warm.launch_command(warm_cmd, self.recipe.launch.nproc)
        return cmd

    def unreaped_exit_code(self, rank: int) -> int | None:
        """A dead rank's exit code before torchrun reaps it (``procs.zombie_exit_code``): the rank
        is a child of this machine's torchrun. Slurm: ranks live on other nodes, their pids mean
        nothing here."""
        info = self.ranks.get(rank)
        return procs.zombie_exit_code(info.pid) if info is not None and info.pid > 0 else None

    def launch_fields(self, attempt: int) -> dict:
        """Extra fields of the ``launch`` event (Slurm: the attempt's nodes)."""
        return {}

    def attempt_cleanup(self, attempt: int) -> None:
        """Before the attempt's processes are torn down (Slurm: tell every node agent to kill its
        ranks)."""

    def on_misconfigured(self, attempt: int) -> Outcome:
        ev = self.misconfigured
        self.say(f"misconfigured: {ev['reason']}")
        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
        self.event(EventKind.MISCONFIGURED, **ev)
        return Outcome("misconfigured", f"misconfigured: {ev['reason']}", ev)

    def _after_exit(self, rc: int, attempt: int) -> Outcome:
        self.step = max(self.step, launcher.completed_step(self.run))
        if rc == 0 and (self.step >= self.recipe.train.steps or completes_on_exit(self.recipe)):
            return Outcome("completed")
        if rc == 0:
            reason = f"torchrun exited 0 at step {self.step} of {self.recipe.train.steps}"
            self.event(EventKind.EARLY_EXIT, attempt=attempt, step=self.step)
            self.say(reason)
            return Outcome("early_exit", reason)
        rank, code, how = self._root_cause(attempt)
        # its node agent's or relay's link closed first: the failure is that host's (a relay's
        # death ends its 64 nodes' ranks at once; which of them came first is no one's fault)
        link = self.blame.link_of(rank)
        host = link or self.rank_host(rank) or self.host
        self.event(
            EventKind.CRASH,
            attempt=attempt,
            rank=rank,
            exit_code=code,
            step=self.step,
            host=host,
            how=how,
            **({"link_closed": link} if link else {}),
        )
        err = self.ranks[rank].error if rank in self.ranks else None
        desc = f"rank {rank} exited {code}" + (f" ({err})" if err else "") + f" at step {self.step}"
        if link:
            desc += f" (the link of node {link}'s agent or relay closed first)"
        self.say(
            f"crash: {desc}; logs: "
            f"{self.run.rank_log(attempt, rank) if rank is not None else self.run.logs(attempt)}"
        )
        info = self.ranks.get(rank) if rank is not None else None
        began = info is None or self.rank_step(info) > 0
        everyone = [i.error for _, i in sorted(self.ranks.items())]
        fatal = fatal_startup_error(err, began_step=began) or same_error_everywhere(
            everyone if len(everyone) == self.world else [None],
            began_step=began or any(self.rank_step(i) > 0 for i in self.ranks.values()),
        )
        detail = {
            "rank": rank,
            "exit_code": code,
            "fatal": fatal,
            "link": link,
            "signature": f"{err} at step {self.step}" if err else "",
        }
        return Outcome("crash", f"crash: {desc}", detail)

    def _torchrun_exit_code(self, attempt: int, rank: int) -> int | None:
        """The exit code torchrun logged for ``rank`` as soon as it saw it fail (``failed (exitcode:
        N) local_rank: R``; one node per torchrun here, so the local rank is the rank), else
        None."""
        try:
            text = (self.run.logs(attempt) / "torchrun.log").read_text(errors="replace")
        except OSError:
            return None
        for m in WORKER_FAILED.finditer(text):
            if int(m.group(2)) == rank:
                return int(m.group(1))
        return None

    def _root_cause(self, attempt: int) -> tuple[int | None, int | None, str]:
        """Which rank failed first (:func:`ptops.ops.supervisor.blame.root_cause`)."""
        try:
            text = (self.run.logs(attempt) / "torchrun.log").read_text(errors="replace")
        except OSError:
            text = ""
        return root_cause(
            self.blame.first,
            text,
            self.proc.returncode if self.proc else None,
            self.blame.displaced,
        )


def completes_on_exit(recipe) -> bool:
    """An engine whose ranks decide the run's length (a user's script): exit 0 everywhere is
    completion."""
    from ptops.recipes.engines import get

    return get(recipe.engine).complete_on_exit
