"""The supervisor: a run's attempts under watch, and what happens between them.

Why it is split: each part answers one question a person asks at 03:00.

- ``core`` (this file): the run loop - adopt or start a run, run attempts, and after
  each one restart (``policy.RestartPolicy``), roll back / stop (``actions``), or end;
  status and events; the process-wide cleanup in ``run_all``.
- ``attempt``: one torchrun, watched until it completes, crashes, hangs or is stopped
  (-> :class:`~ptops.ops.supervisor.outcome.Outcome`); ``blame``: who failed first (pure).
- ``messages``: the channel's messages, dispatched through a table.
- ``hangs``: stacks of every rank at a hang; ``stop``: Ctrl-C / SIGTERM.
- ``monitorfeed``: the pure metric monitors live; ``actions``: what their findings do.

One attempt = one torchrun (``launcher.rank_command``) under this machine's node agent
(``launcher.node_agent_command``: a local run is a one-node run), plus the channel's
address and token in the environment. The loop reads the channel, writes
``metrics.jsonl``, ``events.jsonl`` and ``status.json``, and ends an attempt on:

- completion (torchrun exit 0 and every step recorded) -> ``completed``;
- a crash (a rank left without saying goodbye, or torchrun exited non-zero)
  -> ``crash {attempt, rank, exit_code}``, restart by policy;
- a hang (monitors.hang) -> stacks of every rank, gathered by its node agent, into
  ``stacks/attempt-K/node-NAME.txt``, ``hang {attempt, ranks, step, silent_s}``,
  teardown, restart by policy;
- SIGINT / SIGTERM -> save request to the ranks (if their engine supports it),
  teardown, ``stopped``, exit 130 / 143.

Restart strategy (Erlang/OTP names): ``permanent`` (``ptops launch --supervise``)
restarts by policy; ``temporary`` (a plain ``ptops launch``) never restarts - a crash or
hang ends the run ``failed``, exit 1 - and its monitors only record their findings.
Everything else (records, stacks, summary) is the same for both.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from ptops import envnames
from ptops.ckpt import resume_point
from ptops.faultinject.spec import Fault
from ptops.monitors.hang import HangMonitor, Learned
from ptops.ops.rank.channel import write_info
from ptops.ops.runrecord.events import TERMINAL_STATES, EventKind, RunState
from ptops.ops.runrecord.lock import acquire, release
from ptops.ops.runrecord.metrics import MetricsWriter
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.runrecord.status import read_status_file, write_status
from ptops.ops.supervisor import exitcodes, health, launcher, monitorfeed, procs, states
from ptops.ops.supervisor.actions import FindingActions
from ptops.ops.supervisor.attempt import AttemptMixin, completes_on_exit
from ptops.ops.supervisor.blame import Blame
from ptops.ops.supervisor.channel import ChannelServer
from ptops.ops.supervisor.hangs import HangMixin
from ptops.ops.supervisor.messages import MessagesMixin, RankInfo
from ptops.ops.supervisor.outcome import Outcome
from ptops.ops.supervisor.policy import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_MISCONFIGURED,
    HALTING,
    Failure,
    RestartPolicy,
    Strategy,
)
from ptops.ops.supervisor.reached import Reached
from ptops.ops.supervisor.stop import StopMixin
from ptops.ops.supervisor.warmpool import WarmPool
from ptops.recipes.schema import Recipe

__all__ = ["Outcome", "RankInfo", "Supervisor"]


class Supervisor(AttemptMixin, MessagesMixin, HangMixin, StopMixin):
    # a transition outside ``states.TRANSITIONS`` raises instead of a line and on (tests/conftest.py
    # sets it for the supervisors the test suite runs in its own process)
    strict_transitions = False

    def __init__(
        self,
        recipe: Recipe,
        run: RunDir,
        faults: list[Fault],
        progress=None,
        out=None,
        strategy: Strategy = "permanent",
    ):
        self.recipe = recipe
        self.run = run
        self.cfg = recipe.supervisor
        self.faults = faults
        self.progress = progress
        self.out = out or sys.stderr
        # the open inbox_behind episode (attempt.py, judge_time): since, max_lag_s, max_queued
        self.inbox_behind: dict | None = None
        # node -> (boot id, kernel log record) where its last health check stopped reading XIDs
        self.xid_marks: dict[str, tuple[str, int]] = {}
        self.strategy = strategy
        self.stop_signal: int | None = None
        self._signals = 0
        self.attempt = 0
        self.state: RunState = states.INITIAL  # changed only by ``transition`` (states.py)
        self.transitions: deque[dict[str, Any]] = deque(maxlen=states.HISTORY_LEN)
        self.step = 0
        self.ranks: dict[int, RankInfo] = {}
        self.ranks_changed = 0  # bumped at each hello and EOF: status.json's list (``_ranks_json``)
        self._ranks_held: tuple | None = None
        self._rank_lists: dict[int, tuple] = {}  # ``current_ranks``' memo
        self.server: ChannelServer | None = None
        self.proc = None
        self.monitor: HangMonitor | None = None
        self.learned = Learned()  # hang sections' durations, kept across attempts
        self.reached = Reached()  # a script's own saves and resumes (no checkpoint of ptops)
        self.misconfigured: dict[str, Any] | None = None
        self.node_peers: dict[
            str, Any
        ] = {}  # node name -> its agent's channel peer (multi-node attempts)
        self.node_stacks: dict[
            int, dict
        ] = {}  # rank -> stacks its node agent took (py-spy on that node)
        self.stop_acks: dict[int, dict] = {}
        self.blame = Blame()
        self.unknown_messages: dict[
            str, int
        ] = {}  # "role:type" -> count of messages no handler takes
        self.profiling: dict[str, Any] | None = (
            None  # the `ptops profile` request in flight (messages._on_profile)
        )
        self.ckpt_started: dict[int, float] = {}
        self.last_status = 0.0
        self.host = socket.gethostname()
        self.good: dict[str, Any] | None = None
        self.reason = ""
        self.world = recipe.launch.nproc
        self.t_start = time.monotonic()
        # a monitor config that cannot be built is a RecipeError here (the CLI exits 2 before
        # anything starts)
        self.feed = monitorfeed.MonitorFeed(
            monitorfeed.build(recipe.monitors, str(run.recipe_toml))
        )
        # held open: metrics.jsonl takes a line per rank per step; rotated past metrics_rotate_mb
        self.metrics_out = MetricsWriter(
            run.path,
            rotate_bytes=int(self.cfg.metrics_rotate_mb * 1024 * 1024),
            # node_summaries: the agents sampled; the file holds what arrives
            detail_every=1 if self.cfg.node_summaries else self.cfg.metrics_rank_detail_every,
        )
        self.findings = FindingActions(
            recipe.monitors, run, self.say, record_only=not self.supervised
        )
        # warm spare ranks for restarts (a plain launch never restarts: no pool)
        wanted = self.cfg.restart.warm_pool_wanted(recipe.launch.nproc, os.cpu_count())
        self.warm = WarmPool(recipe, run) if wanted and self.supervised else None
        if os.environ.get(envnames.STANDING_POOL):
            # `ptops warm`: every attempt, the first too, when a pool of this engine fits this
            # launch now; else the run's own pool (or none) as without it, and the log says why
            standing = WarmPool(recipe, run, standing=os.environ[envnames.STANDING_POOL])
            fits = standing.source(0, lambda: True)
            if fits["ranks_from"] == "warm":
                self.warm = standing
            else:
                self.say(f"standing warm pool not used ({fits['cold_why']}): {fits['cold_detail']}")
        self.no_warm_why = (  # the launch event's cold_detail when there is no pool
            ""
            if self.warm is not None
            else "a plain launch never restarts"
            if not self.supervised
            else f"warm_spare={self.cfg.restart.warm_spare!r} ({os.cpu_count()} cores, "
            "launch.nproc "
            f"{recipe.launch.nproc}; auto wants 2 x nproc + 2)"
        )

    @property
    def supervised(self) -> bool:
        """True when failed attempts are restarted (``--supervise``); a plain launch only
        watches."""
        return self.strategy == "permanent"

    def rank_host(self, rank: int | None) -> str | None:
        info = self.ranks.get(rank) if rank is not None else None
        return info.host if info is not None else None

    def feed_monitors(self, rec: dict[str, Any], like: Any = None) -> None:
        findings, errors = self.feed.feed(rec, like)
        self._monitored(findings, [(name, e, rec) for name, e in errors])

    def feed_monitors_group(self, recs: list, likes: list) -> None:
        """A node's step group (``MonitorFeed.feed_group``)."""
        self._monitored(*self.feed.feed_group(recs, likes))

    def _monitored(self, findings: list, errors: list) -> None:
        """Events (and the policy's actions) for the monitors' findings; a monitor's first error
        (name, exception, the record it raised on) said once."""
        for name, e, rec in errors:
            self.event(
                EventKind.MONITOR_ERROR,
                attempt=self.attempt,
                monitor=name,
                step=rec.get("step"),
                rank=rec.get("rank"),
                error=f"{type(e).__name__}: {e}",
            )
            self.say(
                f"monitor {name} raised on a record ({type(e).__name__}: {e}); the other "
                "monitors go on"
            )
        for f in findings:
            ev = f.to_event()
            kind = ev.pop("kind", EventKind.ANOMALY)
            host = self.rank_host(f.rank) if kind == EventKind.ANOMALY else None
            if host:  # where the rank ran: diagnose names it after the attempt's ranks are gone
                ev["host"] = host
            self.event(kind, attempt=self.attempt, **ev)
            self.findings.on_finding(f, self.attempt, self.rank_host)  # [monitors] policy

    # ------------------------------------------------------------ output
    def say(self, msg: str) -> None:
        live = getattr(self.progress, "live", False)
        self.out.write(("\r\033[K" if live else "") + f"ptops: {msg}\n")
        self.out.flush()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self.run.event(kind, **fields)

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_status < 1.0:
            return
        self.last_status = now
        write_status(
            self.run,
            {
                "state": self.state,
                "step": self.step,
                "total_steps": self.recipe.train.steps,
                "attempt": self.attempt,
                "supervisor_pid": os.getpid(),
                "supervisor_host": self.host,
                "torchrun_pid": self.proc.pid if self.proc is not None else None,
                "last_good_checkpoint": self.good,
                "channel": self.server.address(self.cfg.channel_advertise) if self.server else None,
                "reason": self.reason or None,
                "updated": time.time(),
            },
            {"ranks": self._ranks_json(force)},
        )

    def transition(self, to: RunState, why: str) -> None:
        """The one way to change ``self.state``: ``why`` names a row of ``states.TRANSITIONS``
        that leaves the current state for ``to``. One outside the table is said in one line and
        taken (a bookkeeping error never ends a run), or raised when ``strict_transitions``. Kept in
        ``transitions`` and ``supervisor/transitions.jsonl``; status.json is written by the caller,
        as before."""
        source = self.state
        if to == source:
            return  # not a transition (attempt 1's launch, repeated checkpoint beats)
        ok = states.allowed(source, to, why)
        if not ok:
            line = f"state {source} -> {to} ({why}): not in the table (ops/supervisor/states.py)"
            if self.strict_transitions:
                raise states.TransitionError(line)
            self.say(line)
        self.state = to
        rec = {
            "ts": round(time.time(), 3),
            "pid": os.getpid(),
            "attempt": self.attempt,
            "from": str(source),
            "to": str(to),
            "why": why,
            "ok": ok,
        }
        self.transitions.append(rec)
        try:  # the history across the run's supervisors; a full disk must not stop the run
            folder = self.run.path / "supervisor"
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(
                folder / "transitions.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
            )
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError:
            pass

    def _ranks_json(self, force: bool = False) -> str:
        """The live ranks as status.json lists them, encoded again only after a hello or an EOF
        (``ranks_changed``): a sort and an encoding of every rank once a second was ~40 ms of the
        main thread at 16,384 ranks and ~0.3 s at 131,072 (docs/scale.md). While ranks keep
        coming (a start-up burst: a hello at a time), at most one encoding in 20 times its own
        cost, unless ``force`` (the last hello, a state change): at 131,072 ranks the list is then
        up to ~6 s behind during the burst, not re-encoded every second of it."""
        held = self._ranks_held
        if held is None or held[0] is not self.ranks or held[1] != self.ranks_changed:
            now = time.monotonic()
            if held is not None and held[0] is self.ranks and not force and now < held[3]:
                return held[2]
            text = json.dumps(
                [
                    {"rank": r.rank, "pid": r.pid, "host": r.host}
                    for r in sorted(self.ranks.values(), key=lambda r: r.rank)
                    if r.gone_ts is None
                ]
            )
            took = time.monotonic() - now
            held = self._ranks_held = (self.ranks, self.ranks_changed, text, now + 20 * took)
        return held[2]

    # ------------------------------------------------------------ entry
    def run_all(self, lock_fd: int | None = None) -> int:
        """Run to the end; returns the exit code. Takes the run directory's lock unless given its
        fd."""
        if lock_fd is None:
            lock_fd = acquire(self.run.path)  # LockedError -> the caller exits 2
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                return self._run_locked()
            except (
                Exception
            ) as e:  # a bug here must still leave a truthful run directory and no processes
                traceback.print_exc()
                self.transition(RunState.FAILED, "supervisor_error")
                self.reason = f"supervisor error: {type(e).__name__}: {e}"
                self.event(
                    EventKind.FAILED,
                    reason=self.reason,
                    attempt=self.attempt,
                    exit_code=EXIT_FAILED,
                )
                return EXIT_FAILED
        finally:
            try:
                if self.warm is not None:
                    self.warm.stop()
                if self.proc is not None and self.proc.poll() is None:
                    procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
                left = procs.run_processes(self.run.path)
                if left:
                    procs.teardown(None, self.run.path, left, grace_s=0)
            finally:
                if self.server is not None:
                    self.server.close()
                self.metrics_out.close()
                self.write_status(force=True)
                for s, h in old.items():
                    signal.signal(s, h)
                release(lock_fd)

    def _run_locked(self) -> int:
        prev = read_status_file(self.run)
        self.attempt = self.run.last_attempt()
        if prev.get("state") is not None and prev.get("state") not in TERMINAL_STATES:
            self.event(
                EventKind.ADOPT,
                previous_supervisor_pid=prev.get("supervisor_pid"),
                last_attempt=self.attempt,
            )
            self.say(
                f"adopting {self.run.path} (previous supervisor pid {prev.get('supervisor_pid')} "
                "is gone)"
            )
        orphans = procs.run_processes(self.run.path)
        if orphans:
            procs.teardown(None, self.run.path, orphans, grace_s=2)
            self.event(EventKind.ORPHANS_KILLED, pids=orphans)
            self.say(f"killed {len(orphans)} leftover process(es) of this run: {orphans}")
        # verified once, here (hashes: flipped bytes keep sizes, and a run whose final checkpoint
        # went bad must redo its last steps); the ranks get the choice (PTOPS_RESUME_FROM)
        self.good = self._good_checkpoint_for_restart()
        done = launcher.completed_step(self.run)
        if prev.get("state") == RunState.COMPLETED and completes_on_exit(self.recipe):
            self.transition(RunState.COMPLETED, "already_complete")
            self.step = done
            self.say("already complete (its script exited 0 on every rank); nothing to do")
            return EXIT_DONE
        if (
            done >= self.recipe.train.steps
            and self.good
            and self.good["step"] >= self.recipe.train.steps
        ):
            self.transition(RunState.COMPLETED, "already_complete")
            self.step = done
            self.say(
                f"already complete (step {done}, checkpoint {self.good['path']}); nothing to do"
            )
            return EXIT_DONE
        self.server = ChannelServer(self.cfg.channel_host, self.cfg.channel_port)
        address = self.server.address(self.cfg.channel_advertise)
        write_info(
            self.run.path / "supervisor" / "channel.json", address, self.server.token, os.getpid()
        )
        earlier = self.run.read_events()
        policy = RestartPolicy.from_events(self.cfg.restart, earlier, self.strategy)
        self.reached = Reached.from_events(earlier)
        while True:
            self.attempt += 1
            self.reached.new_attempt()
            start_step = max((self.good or {}).get("step", 0), self.reached.saved_step)
            unhealthy = self.health_gate(self.attempt)
            if unhealthy is not None:
                return unhealthy
            outcome = self.run_attempt(self.attempt)
            early = self.after_outcome(outcome)
            if (
                early is not None
            ):  # the launch backend ends this supervisor (Slurm: requeued, resubmitted)
                return early
            if outcome.kind == "completed":
                self.transition(RunState.COMPLETED, "completed")
                self.event(EventKind.COMPLETED, step=self.step, attempt=self.attempt)
                return EXIT_DONE
            if outcome.kind in HALTING:  # a monitor finding's stop / rollback
                verdict = self.findings.after_attempt(
                    outcome, self.attempt, self._good_checkpoint_for_restart
                )
                self.transition(
                    verdict.state,
                    "finding_rollback" if verdict.state == RunState.RESTARTING else "finding_stop",
                )
                self.reason = verdict.reason
                if verdict.exit_code is not None:
                    return verdict.exit_code
                self.good = verdict.good
                self.write_status(force=True)
                continue
            if outcome.kind == "misconfigured":  # a restart would form the same wrong world again
                self.transition(RunState.FAILED, "misconfigured")
                self.reason = outcome.reason
                self.event(
                    EventKind.FAILED,
                    reason=outcome.reason,
                    attempt=self.attempt,
                    exit_code=EXIT_MISCONFIGURED,
                )
                self.say(f"giving up: {outcome.reason}")
                return EXIT_MISCONFIGURED
            if outcome.kind == "interrupted":
                sig = self.stop_signal or signal.SIGTERM
                self.transition(RunState.STOPPED, "interrupted")
                self.reason = f"interrupted by {signal.Signals(sig).name}"
                self.event(
                    EventKind.STOPPED,
                    attempt=self.attempt,
                    signal=int(sig),
                    step=self.step,
                    reason=self.reason,
                )
                return exitcodes.stopped(int(sig))
            # a plain launch never restarts: its checkpoints stay as they are for the next launch
            if self.supervised:
                self.good = self._good_checkpoint_for_restart()
            good_step = (self.good or {}).get("step", 0)
            failure = Failure(
                ts=time.time(),
                start_step=start_step,
                good_step=max(good_step, self.reached.saved_step),
                reason=outcome.reason,
                fatal=outcome.detail.get("fatal", ""),
                reached=self.step,
                signature=outcome.detail.get("signature", ""),
            )
            decision = policy.decide(failure)
            if decision.action == "stop":
                self.transition(RunState.FAILED, "gave_up")
                self.reason = decision.reason
                # a fatal error (at import, the same on every rank): the user's traceback with it
                info = self.ranks.get(outcome.detail.get("rank"))
                tb = (info.traceback or "") if info and outcome.detail.get("fatal") else ""
                self.event(
                    EventKind.FAILED,
                    reason=decision.reason,
                    attempt=self.attempt,
                    exit_code=decision.exit_code,
                    **({"traceback": tb} if tb else {}),
                )
                self.say(f"giving up: {decision.reason}" + (f"\n{tb}" if tb else ""))
                return decision.exit_code
            self.transition(RunState.RESTARTING, "restart")
            self.reason = outcome.reason
            self.event(
                EventKind.RESTART,
                attempt=self.attempt + 1,
                from_step=good_step,
                prev_from_step=start_step,
                reason=outcome.reason,
                delay_s=decision.delay_s,
                reached=failure.reached,
                **({"progress_step": failure.good_step} if failure.good_step != good_step else {}),
                **({"signature": failure.signature} if failure.signature else {}),
            )
            self.say(
                f"restarting (attempt {self.attempt + 1}) {self.reached.restart_phrase(good_step)} "
                f"in {decision.delay_s:g} s: {outcome.reason}"
            )
            self.write_status(force=True)
            deadline = time.monotonic() + decision.delay_s
            while time.monotonic() < deadline:
                if self.stop_signal is not None:
                    sig = self.stop_signal
                    self.transition(RunState.STOPPED, "stopped_in_backoff")
                    self.event(
                        EventKind.STOPPED,
                        attempt=self.attempt,
                        signal=int(sig),
                        step=self.step,
                        reason="interrupted during restart backoff",
                    )
                    return exitcodes.stopped(int(sig))
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def rendezvous_addresses(self) -> list[tuple[str, int]]:
        """What the attempt's ranks dial for their rendezvous (local: torchrun on this host)."""
        return [("127.0.0.1", self.recipe.launch.master_port or 29500)]

    def health_gate(self, attempt: int) -> int | None:
        """The checks before an attempt (``ops/supervisor/health.py``) on every node the attempt
        may use: one ``health_check`` event; what a failure does is the backend's
        (:meth:`unhealthy`)."""
        cfg = self.cfg.health
        if not cfg.enabled:
            return None
        ctx = health.Context(
            ckpt_dir=self.run.checkpoints,
            min_free_mb=cfg.min_free_mb,
            newest_ckpt=Path(self.good["path"]) if self.good and self.good.get("path") else None,
            rendezvous=self.rendezvous_addresses(),
            timeout_s=cfg.rendezvous_timeout_s,
            expected_gpus=self.recipe.slurm.gpus_per_node or None,
            nproc=self.recipe.launch.nproc,
            max_clock_skew_s=cfg.max_clock_skew_s,
        )
        by_node = self.check_nodes(attempt, ctx, list(cfg.skip))
        checks = [
            {**r.to_dict(), "node": node} for node, results in by_node.items() for r in results
        ]
        failed = {
            node: [r.name for r in results if r.ok is False] for node, results in by_node.items()
        }
        failed = {node: names for node, names in failed.items() if names}
        self.event(
            EventKind.HEALTH_CHECK,
            attempt=attempt,
            ok=not failed,
            checks=checks,
            failed=sorted({n for names in failed.values() for n in names}),
            nodes=sorted(by_node),
            failed_nodes=failed,
        )
        if not failed:
            return None
        why = {
            node: "; ".join(f"{r.name}: {r.detail}" for r in by_node[node] if r.ok is False)
            for node in failed
        }
        return self.unhealthy(attempt, why)

    def check_nodes(
        self, attempt: int, ctx: health.Context, skip: list[str]
    ) -> dict[str, list[health.Result]]:
        """Each node's results (local: this one, in this process)."""
        host = socket.gethostname()
        ctx.xid_mark = self.xid_marks.get(host)
        results = health.run_checks(ctx, skip)
        if ctx.xid_seen is not None:
            self.xid_marks[host] = ctx.xid_seen
        return {host: results}

    def unhealthy(self, attempt: int, why: dict[str, str]) -> int | None:
        """Nodes failed their checks (``why``: node -> what failed). Local: the run ends before any
        rank starts (exit 1: the node is at fault, not the job)."""
        self.transition(RunState.FAILED, "unhealthy")
        self.reason = "health check failed before attempt {}: {}".format(
            attempt, "; ".join(why.values())
        )
        self.event(EventKind.FAILED, reason=self.reason, attempt=attempt, exit_code=EXIT_FAILED)
        self.say(f"giving up: {self.reason}")
        return EXIT_FAILED

    def after_outcome(self, outcome: Outcome) -> int | None:
        """The launch backend's say after each attempt (Slurm: node strikes, spares, preemption);
        an exit code ends the run loop here. Local runs: nothing."""
        return None

    def _good_checkpoint_for_restart(self) -> dict[str, Any] | None:
        """Where the next attempt resumes: ``ptops.ckpt.resume_point`` (deep check; newer bad ones
        quarantined and reported); the ranks take it from PTOPS_RESUME_FROM without verifying
        again."""

        def report(**invalid: Any) -> None:
            self.event(EventKind.CHECKPOINT_INVALID, **invalid)
            self.say(
                f"checkpoint {invalid['path']} is not good ({invalid['reason']}); moved to "
                f"{invalid['moved_to']}"
            )

        entry = resume_point(
            self.run.checkpoints,
            deep=True,
            on_invalid=report,
            world_size=self.world,
            trust_env=False,
        )
        return None if entry is None else entry.ref()
