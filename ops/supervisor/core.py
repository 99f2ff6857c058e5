"""The supervisor loop: attempts of a run under watch, restarts by policy.

One attempt = one torchrun started exactly as ``launcher.run_plain`` starts it
(``launcher.rank_command``), plus the channel's address and token in the
environment. The loop reads the channel, writes ``metrics.jsonl``,
``events.jsonl`` and ``status.json``, and ends an attempt on:

- completion (torchrun exit 0 and every step recorded) -> ``completed``;
- a crash (a rank left without saying goodbye, or torchrun exited non-zero)
  -> ``crash {attempt, rank, exit_code}``, restart by policy;
- a hang (monitors.hang) -> stacks of every rank into
  ``stacks/attempt-K/rank-R.txt``, ``hang {attempt, ranks, step, silent_s}``,
  teardown, restart by policy;
- SIGINT / SIGTERM -> save request to the ranks (if their engine supports it),
  teardown, ``stopped``, exit 130 / 143.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptops.faultinject.spec import Fault, FaultSpecError, format_spec
from ptops.faultinject.spec import parse as parse_fault
from ptops.faultinject.spec import to_env as faults_to_env
from ptops.monitors.hang import HangConfig, HangMonitor
from ptops.ops.supervisor import launcher
from ptops.ops.rank.channel import ENV_ADDRESS, ENV_TOKEN, write_info
from ptops.ops.supervisor.channel import ChannelServer, Peer
from ptops.ops.supervisor.policy import (
    EXIT_DONE,
    EXIT_FAILED,
    Failure,
    PolicyConfig,
    RestartPolicy,
)
from ptops.recipes.schema import Recipe
from ptops.ops.runrecord.rundir import RunDir, append_jsonl
from ptops.ops.runrecord.status import last_good_checkpoint, read_status_file, write_status
from ptops.ops.supervisor import actions, procs, stacks
from ptops.ops.supervisor.lock import acquire, release

_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.M)


# A rank's error goodbye and the EOF of the peer whose death caused it race by milliseconds.
KILLED_PEER_RACE_S = 0.25

# Event kinds a rank may report itself (the run directory records them as they come).
RANK_EVENT_KINDS = frozenset({"checkpoint", "checkpoint_saved", "checkpoint_failed", "checkpoint_committed",
                              "checkpoint_invalid", "rollback_applied", "hold_released"})


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    peer: Peer | None = None
    exit_code: int | None = None  # from the rank's goodbye
    error: str | None = None
    gone_ts: float | None = None  # EOF (monotonic)


@dataclass
class Outcome:
    kind: str  # completed | crash | hang | early_exit | interrupted
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    def __init__(self, recipe: Recipe, run: RunDir, faults: list[Fault], progress=None, out=None):
        self.recipe = recipe
        self.run = run
        self.cfg = recipe.supervisor
        self.faults = faults
        self.progress = progress
        self.out = out or sys.stderr
        self.stop_signal: int | None = None
        self._signals = 0
        self.attempt = 0
        self.state = "starting"
        self.step = 0
        self.ranks: dict[int, RankInfo] = {}
        self.server: ChannelServer | None = None
        self.proc = None
        self.monitor: HangMonitor | None = None
        self.stacks_replies: dict[int, dict] = {}
        self.stop_acks: dict[int, dict] = {}
        self.first_bad: tuple[int, int | None, str] | None = None  # (rank, exit_code, how)
        self._first_bad_ts = 0.0
        self.ckpt_started: dict[int, float] = {}
        self.last_status = 0.0
        self.host = socket.gethostname()
        self.good: dict[str, Any] | None = None
        self.reason = ""
        self.world = recipe.launch.nproc
        self.t_start = time.monotonic()
        self.monitors = self._build_monitors()
        self.policy_action = None  # a halting [monitors] decision for the live attempt (actions.py)

    def _build_monitors(self) -> list:
        """The pure metric monitors (ptops.monitors), alert-only here: findings become events."""
        try:
            from ptops.monitors import build_monitors
        except ImportError:
            return []
        try:
            return list(build_monitors(getattr(self.recipe, "monitors", None)))
        except Exception:
            return []

    def _feed_monitors(self, rec: dict[str, Any]) -> None:
        for m in self.monitors:
            try:
                findings = m.feed(rec)
            except Exception:
                continue
            for f in findings or ():
                ev = f.to_event()
                kind = ev.pop("kind", "anomaly")
                self.event(kind, attempt=self.attempt, **ev)
                actions.on_finding(self, f)  # [monitors] policy: alert | stop | rollback | exclude_node

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
                "ranks": [
                    {"rank": r.rank, "pid": r.pid, "host": r.host}
                    for r in sorted(self.ranks.values(), key=lambda r: r.rank)
                    if r.gone_ts is None
                ],
                "last_good_checkpoint": self.good,
                "channel": self.server.address(self.cfg.channel_advertise) if self.server else None,
                "reason": self.reason or None,
                "updated": time.time(),
            },
        )

    # ------------------------------------------------------------ signals
    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        if self.stop_signal is None:
            self.stop_signal = signum

    # ------------------------------------------------------------ entry
    def run_all(self, lock_fd: int | None = None) -> int:
        """Run to the end; returns the exit code. Takes the run directory's lock unless given its fd."""
        if lock_fd is None:
            lock_fd = acquire(self.run.path)  # LockedError -> the caller exits 2
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                return self._run_locked()
            except Exception as e:  # a bug here must still leave a truthful run directory and no processes
                import traceback

                traceback.print_exc()
                self.state = "failed"
                self.reason = f"supervisor error: {type(e).__name__}: {e}"
                self.event("failed", reason=self.reason, attempt=self.attempt, exit_code=EXIT_FAILED)
                return EXIT_FAILED
        finally:
            try:
                if self.proc is not None and self.proc.poll() is None:
                    procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
                left = procs.run_processes(self.run.path)
                if left:
                    procs.teardown(None, self.run.path, left, grace_s=0)
            finally:
                if self.server is not None:
                    self.server.close()
                self.write_status(force=True)
                for s, h in old.items():
                    signal.signal(s, h)
                release(lock_fd)

    def _run_locked(self) -> int:
        prev = read_status_file(self.run)
        self.attempt = self.run.last_attempt()
        if prev.get("state") not in (None, "completed", "failed", "stopped"):
            self.event("adopt", previous_supervisor_pid=prev.get("supervisor_pid"), last_attempt=self.attempt)
            self.say(f"adopting {self.run.path} (previous supervisor pid {prev.get('supervisor_pid')} is gone)")
        orphans = procs.run_processes(self.run.path)
        if orphans:
            procs.teardown(None, self.run.path, orphans, grace_s=2)
            self.event("orphans_killed", pids=orphans)
            self.say(f"killed {len(orphans)} leftover process(es) of this run: {orphans}")
        self.good = last_good_checkpoint(self.run, deep=False)
        done = launcher.completed_step(self.run)
        if done >= self.recipe.train.steps:
            # finished only if the final checkpoint still verifies (hashes): flipped bytes keep
            # sizes, and a run whose final checkpoint went bad must redo its last steps
            self.good = last_good_checkpoint(self.run, deep=True)
        if done >= self.recipe.train.steps and self.good and self.good["step"] >= self.recipe.train.steps:
            self.state = "completed"
            self.step = done
            self.say(f"already complete (step {done}, checkpoint {self.good['path']}); nothing to do")
            return EXIT_DONE
        self.server = ChannelServer(self.cfg.channel_host, self.cfg.channel_port)
        address = self.server.address(self.cfg.channel_advertise)
        write_info(self.run.path / "supervisor" / "channel.json", address, self.server.token, os.getpid())
        c = self.cfg
        policy = RestartPolicy.from_events(
            PolicyConfig(
                max_restarts=c.max_restarts,
                backoff_s=c.backoff_s,
                backoff_max_s=c.backoff_max_s,
                storm_restarts=c.storm_restarts,
                storm_window_s=c.storm_window_min * 60,
                no_progress_attempts=c.no_progress_attempts,
            ),
            self.run.read_events(),
        )
        while True:
            self.attempt += 1
            start_step = (self.good or {}).get("step", 0)
            outcome = self.run_attempt(self.attempt)
            if outcome.kind == "completed":
                self.state = "completed"
                self.event("completed", step=self.step, attempt=self.attempt)
                return EXIT_DONE
            if outcome.kind in actions.HALTING:  # a monitor finding's stop / rollback
                code = actions.after_attempt(self, outcome)
                if code is not None:
                    return code
                continue
            if outcome.kind == "interrupted":
                sig = self.stop_signal or signal.SIGTERM
                self.state = "stopped"
                self.reason = f"interrupted by {signal.Signals(sig).name}"
                self.event("stopped", attempt=self.attempt, signal=int(sig), step=self.step, reason=self.reason)
                return 128 + int(sig)
            self.good = self._good_checkpoint_for_restart()
            good_step = (self.good or {}).get("step", 0)
            decision = policy.decide(
                Failure(ts=time.time(), start_step=start_step, good_step=good_step, reason=outcome.reason)
            )
            if decision.action == "stop":
                self.state = "failed"
                self.reason = decision.reason
                self.event("failed", reason=decision.reason, attempt=self.attempt, exit_code=decision.exit_code)
                self.say(f"giving up: {decision.reason}")
                return decision.exit_code
            self.state = "restarting"
            self.reason = outcome.reason
            self.event(
                "restart",
                attempt=self.attempt + 1,
                from_step=good_step,
                prev_from_step=start_step,
                reason=outcome.reason,
                delay_s=decision.delay_s,
            )
            self.say(
                f"restarting (attempt {self.attempt + 1}) from "
                + (f"checkpoint step {good_step}" if good_step else "scratch")
                + f" in {decision.delay_s:g} s: {outcome.reason}"
            )
            self.write_status(force=True)
            deadline = time.monotonic() + decision.delay_s
            while time.monotonic() < deadline:
                if self.stop_signal is not None:
                    sig = self.stop_signal
                    self.state = "stopped"
                    self.event("stopped", attempt=self.attempt, signal=int(sig), step=self.step, reason="interrupted during restart backoff")
                    return 128 + int(sig)
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _good_checkpoint_for_restart(self) -> dict[str, Any] | None:
        """Newest good checkpoint (deep check); newer bad ones are quarantined so the engine skips them."""
        good = last_good_checkpoint(self.run, deep=True)
        try:
            from ptops.ckpt import list_checkpoints, quarantine  # type: ignore[attr-defined]
        except ImportError:
            return good
        try:
            for entry in list_checkpoints(self.run.checkpoints, deep=False):
                if not entry.ok and entry.step > (good or {}).get("step", -1):
                    dest = quarantine(entry.path, entry.reason)
                    self.event("checkpoint_invalid", path=entry.path, reason=entry.reason, moved_to=str(dest))
                    self.say(f"checkpoint {entry.path} is not good ({entry.reason}); moved to {dest}")
        except (OSError, FileNotFoundError):
            pass
        except Exception as e:  # the catalog is someone else's code: never let it stop a restart
            self.say(f"checkpoint catalog error ignored: {e}")
        return good

    # ------------------------------------------------------------ one attempt
    def _rank_pids(self) -> list[int]:
        return [r.pid for r in self.ranks.values()]

    def run_attempt(self, attempt: int) -> Outcome:
        self.ranks = {}
        self.stacks_replies = {}
        self.stop_acks = {}
        self.first_bad = None
        self.ckpt_started = {}
        self.run.logs(attempt).mkdir(parents=True, exist_ok=True)
        stack_dir = self.run.path / "stacks" / f"attempt-{attempt}"
        extra = {
            ENV_ADDRESS: self.server.address(self.cfg.channel_advertise),
            ENV_TOKEN: self.server.token,
            "PTOPS_SUPERVISOR_PID": str(os.getpid()),
            "PTOPS_HEARTBEAT_S": str(self.cfg.heartbeat_s),
        }
        if self.faults:
            extra["PTOPS_FAULTS"] = faults_to_env(self.faults)
        extra.update(actions.attempt_env(self))  # PTOPS_ROLLBACK after a rollback
        for key, value in (
            ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
            ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
            ("TORCH_FR_DUMP_TEMP_FILE", str(stack_dir / "flight_recorder_rank_")),
        ):
            if key not in os.environ:
                extra[key] = value
        cmd = launcher.rank_command(self.recipe, self.run, attempt, extra_env=extra)
        from_step = (self.good or {}).get("step", 0)
        self.step = from_step  # the engine resumes there; steps after it are redone
        self.event(
            "launch",
            attempt=attempt,
            supervised=True,
            nproc=self.recipe.launch.nproc,
            from_step=from_step,
            supervisor_pid=os.getpid(),
            faults=[str(f) for f in self.faults if f.attempt in (0, attempt)],
        )
        t0 = time.monotonic()
        self.monitor = HangMonitor(
            self.world,
            t0,
            HangConfig(
                multiplier=self.cfg.hang_multiplier,
                floor_s=self.cfg.hang_floor_s,
                window=self.cfg.hang_window,
                startup_s=self.cfg.startup_timeout_s,
                checkpoint_s=self.cfg.checkpoint_timeout_s,
                ping_stale_s=self.cfg.unresponsive_s,
                total_steps=self.recipe.train.steps,
            ),
        )
        self.state = "starting"
        self.proc = procs.spawn(cmd.argv, cmd.env, self.run.logs(attempt) / "torchrun.log")
        self.write_status(force=True)
        bad_since: float | None = None
        try:
            while True:
                self.pump(0.2)
                if self.stop_signal is not None:
                    self.graceful_stop()
                    return Outcome("interrupted", f"signal {self.stop_signal}")
                if self.policy_action is not None:  # wins over the crash a NaN causes right after
                    return actions.end_attempt(self, attempt)
                rc = self.proc.poll()
                if rc is not None:
                    self.pump(0.3, drain=True)
                    if self.policy_action is not None:
                        return actions.end_attempt(self, attempt)
                    return self._after_exit(rc, attempt)
                if self.first_bad is not None:
                    # torchrun notices within its monitor interval and stops the others; give it a moment
                    bad_since = bad_since or time.monotonic()
                    if time.monotonic() - bad_since > self.cfg.kill_timeout_s:
                        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=self.cfg.kill_timeout_s)
                        return self._after_exit(self.proc.returncode if self.proc.returncode is not None else -9, attempt)
                    continue
                finding = self.monitor.check(time.monotonic())
                if finding is not None:
                    return self.on_hang(finding, attempt, stack_dir)
                self.write_status()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
            else:
                left = procs.run_processes(self.run.path)
                if left:
                    procs.teardown(None, self.run.path, left, grace_s=0)

    def _after_exit(self, rc: int, attempt: int) -> Outcome:
        self.step = max(self.step, launcher.completed_step(self.run))
        if rc == 0 and self.step >= self.recipe.train.steps:
            return Outcome("completed")
        if rc == 0:
            reason = f"torchrun exited 0 at step {self.step} of {self.recipe.train.steps}"
            self.event("early_exit", attempt=attempt, step=self.step)
            self.say(reason)
            return Outcome("early_exit", reason)
        rank, code, how = self._root_cause(attempt)
        host = self.ranks[rank].host if rank in self.ranks else self.host
        self.event("crash", attempt=attempt, rank=rank, exit_code=code, step=self.step, host=host, how=how)
        err = self.ranks[rank].error if rank in self.ranks else None
        desc = f"rank {rank} exited {code}" + (f" ({err})" if err else "") + f" at step {self.step}"
        self.say(f"crash: {desc}; logs: {self.run.rank_log(attempt, rank) if rank is not None else self.run.logs(attempt)}")
        return Outcome("crash", f"crash: {desc}", {"rank": rank, "exit_code": code})

    def _note_bad(self, rank: int, code: int | None, how: str, ts: float) -> None:
        """Keep the first failure, except that a rank killed outright (no goodbye) right
        after a peer's error goodbye is the likelier cause: the peer's error is usually
        "connection closed by peer", raised within milliseconds of the kill."""
        if self.first_bad is None:
            self.first_bad, self._first_bad_ts = (rank, code, how), ts
        elif self.first_bad[2] == "goodbye" and code is None and ts - self._first_bad_ts <= KILLED_PEER_RACE_S:
            self.first_bad = (rank, code, how)

    def _root_cause(self, attempt: int) -> tuple[int | None, int | None, str]:
        """Which rank failed first.

        The channel sees it first: a rank killed outright closes its socket at once,
        while its peers only fail later inside a collective. torchrun's "Root Cause"
        is a fallback only: it picks the earliest *error file*, which a SIGKILLed rank
        never writes, so it blames the survivor that raised (seen with crash faults).
        Among torchrun's failures, a rank that torchrun itself did not SIGTERM wins.
        """
        try:
            text = (self.run.logs(attempt) / "torchrun.log").read_text(errors="replace")
        except OSError:
            text = ""
        failures = [(int(m.group(1)), int(m.group(2))) for m in _FAILURE.finditer(text)]
        if self.first_bad is not None:
            rank, code, how = self.first_bad
            if code is None:
                code = dict(failures).get(rank)
            return rank, code, how
        for rank, code in failures:
            if code != -signal.SIGTERM:
                return rank, code, "torchrun"
        if failures:
            return failures[0][0], failures[0][1], "torchrun"
        return None, self.proc.returncode if self.proc else None, "torchrun exit code"

    # ------------------------------------------------------------ the channel
    def pump(self, timeout: float, drain: bool = False) -> None:
        """Handle channel messages for up to ``timeout`` seconds (``drain``: until quiet)."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                peer, msg, ts = self.server.inbox.get(timeout=left)
            except queue.Empty:
                return
            self.handle(peer, msg, ts)
            if self.stop_signal is not None and not drain:
                return

    def handle(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        t = msg.get("t")
        if peer.role == "control":
            if t == "inject":
                self._inject(peer, msg)
            elif t == "status":
                self.server.send(peer, {"ok": True, "state": self.state, "attempt": self.attempt, "step": self.step})
            return
        hello = peer.hello
        if int(hello.get("attempt", -1)) != self.attempt:
            return  # a straggler from an earlier attempt
        rank = peer.rank
        if rank is None:
            return
        mon = self.monitor
        if t == "_hello":
            self.ranks[rank] = RankInfo(rank, int(hello.get("pid", 0)), str(hello.get("host", "?")), peer)
            mon.observe({"kind": "beat", "rank": rank, "step": 0, "phase": "startup", "ts": ts})
            if self.state == "starting" and len(self.ranks) >= self.world:
                self.state = "running"
            self.write_status(force=len(self.ranks) >= self.world)
        elif t == "beat":
            phase = msg.get("phase", "step")
            step = int(msg.get("step", 0))
            mon.observe({"kind": "beat", "rank": rank, "step": step, "phase": phase, "stage": msg.get("stage"), "ts": ts})
            if rank == 0:
                self._checkpoint_beat(phase, step, ts)
        elif t == "ping":
            mon.observe({"kind": "ping", "rank": rank, "ts": ts})
        elif t == "metrics":
            rec = msg.get("rec") or {}
            append_jsonl(self.run.metrics, rec)
            self._feed_monitors(rec)
            mon.observe({"kind": "metrics", "rank": rank, "step": rec.get("step", 0), "step_s": rec.get("step_s"), "ts": ts})
            if rank == 0:
                self.step = int(rec.get("step", self.step))
                if self.state == "starting":
                    self.state = "running"
                if self.progress is not None:
                    self.progress.update(rec)
        elif t == "fault":
            fields = {k: msg.get(k) for k in ("fault", "rank", "step", "attempt")}
            self.event("fault_injected", **fields)
            self.say(f"fault injected: {fields['fault']} on rank {fields['rank']} at step {fields['step']}")
        elif t == "fault_armed":
            pass
        elif t == "event":
            kind = str(msg.get("kind") or "")
            if kind in RANK_EVENT_KINDS:
                fields = msg.get("fields") or {}
                self.event(kind, **fields)
                if kind == "checkpoint" and fields.get("path"):
                    # the engine's own event, sent after its commit: the one source of ``checkpoint``
                    self.good = {"step": int(fields.get("step", 0)), "path": str(fields["path"])}
        elif t == "stacks":
            self.stacks_replies[rank] = msg
        elif t == "stop_ack":
            self.stop_acks[rank] = msg
        elif t == "exit":
            info = self.ranks.get(rank)
            code = int(msg.get("code", 0))
            if info is not None:
                info.exit_code, info.error = code, msg.get("error")
            mon.observe({"kind": "exit", "rank": rank, "ts": ts})
            if code != 0:
                self._note_bad(rank, code, "goodbye", ts)
        elif t == "_eof":
            info = self.ranks.get(rank)
            if info is not None:
                info.gone_ts = ts
                if info.exit_code is None:
                    mon.observe({"kind": "exit", "rank": rank, "ts": ts})
                    self._note_bad(rank, None, "channel closed without goodbye", ts)

    def _checkpoint_beat(self, phase: str, step: int, ts: float) -> None:
        """State only (``checkpointing`` while rank 0 is in a save's blocking part). The
        ``checkpoint`` event itself comes from the engine after its commit (``probe.event``),
        so there is one source, supervised or not, and a failed save never looks saved."""
        if phase == "checkpoint":
            self.ckpt_started.setdefault(step, ts)
            self.state = "checkpointing"
        elif step in self.ckpt_started:
            self.ckpt_started.pop(step)
            self.state = "running"

    def _inject(self, peer: Peer, msg: dict[str, Any]) -> None:
        try:
            fault = parse_fault(str(msg.get("spec", "")))
        except FaultSpecError as e:
            self.server.send(peer, {"ok": False, "error": str(e)})
            return
        if self.state not in ("starting", "running", "checkpointing"):
            self.server.send(peer, {"ok": False, "error": f"no live attempt to inject into (state {self.state})"})
            return
        fault = Fault(fault.kind, fault.step, fault.rank, self.attempt, fault.params, fault.text)
        sent = []
        for info in self.ranks.values():
            if info.peer is not None and info.gone_ts is None:
                if self.server.send(info.peer, {"cmd": "fault", "fault": fault.to_dict()}):
                    sent.append(info.rank)
        self.event("inject", fault=format_spec(fault), attempt=self.attempt, ranks=sorted(sent))
        self.server.send(peer, {"ok": True, "attempt": self.attempt, "ranks": sorted(sent), "fault": str(fault)})

    # ------------------------------------------------------------ hang
    def on_hang(self, finding, attempt: int, stack_dir: Path) -> Outcome:
        self.state = "collecting_stacks"
        self.write_status(force=True)
        self.say(
            f"hang: rank(s) {finding.ranks} made no progress for {finding.silent_s:.1f} s "
            f"(timeout {finding.timeout_s:.1f} s, {finding.phase}, step {finding.step}); collecting stacks"
        )
        t0 = time.monotonic()
        notes = self.collect_stacks(stack_dir)
        ev = finding.as_event(attempt)
        ev["stacks"] = str(stack_dir)
        ev["stack_sources"] = notes
        ev["stacks_s"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
        ev["teardown_s"] = round(time.monotonic() - t1, 2)
        self.event("hang", **ev)
        self.step = max(self.step, launcher.completed_step(self.run))
        return Outcome("hang", f"hang: rank(s) {finding.ranks} silent {finding.silent_s:.0f} s at step {finding.step}", ev)

    def collect_stacks(self, stack_dir: Path) -> dict[str, str]:
        """Every rank's stacks into ``stack_dir/rank-R.txt``; returns rank -> how it was obtained."""
        stack_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(stack_dir, 0o700)
        self.stacks_replies = {}
        asked = []
        now = time.monotonic()
        for info in self.ranks.values():
            seen = self.monitor.ranks.get(info.rank).last_seen if self.monitor and info.rank in self.monitor.ranks else None
            if seen is not None and now - seen > self.cfg.unresponsive_s:
                continue  # not even pinging (stopped, or stuck in C holding the GIL): go straight to py-spy
            if info.peer is not None and info.gone_ts is None and self.server.send(info.peer, {"cmd": "stacks", "id": info.rank}):
                asked.append(info.rank)
        deadline = time.monotonic() + self.cfg.stack_timeout_s
        while time.monotonic() < deadline and not all(r in self.stacks_replies for r in asked):
            self.pump(0.1)
        notes: dict[str, str] = {}
        for rank in range(self.world):
            path = stack_dir / f"rank-{rank}.txt"
            reply = self.stacks_replies.get(rank)
            if reply is not None:
                stacks.write_private(path, f"# source: channel (the rank's own dump)\n{reply.get('text', '')}")
                notes[str(rank)] = "channel"
                fr = reply.get("flight_recorder_b64")
                if fr:
                    stacks.write_private(stack_dir / f"rank-{rank}.flight_recorder", base64.b64decode(fr))
                continue
            info = self.ranks.get(rank)
            if info is None:
                stacks.write_private(path, "# no stack: this rank never connected to the supervisor\n")
                notes[str(rank)] = "never connected"
                continue
            if info.host not in (self.host, "localhost") or not procs.alive(info.pid):
                stacks.write_private(path, f"# no stack: rank unreachable (pid {info.pid} on {info.host})\n")
                notes[str(rank)] = "unreachable"
                continue
            text, note = stacks.with_py_spy(info.pid)
            if text is None:
                text2, note2 = stacks.with_faulthandler(info.pid, self.run.logs(self.attempt) / f"rank-{rank}.stacks")
                note = f"{note}; {note2}"
                text = text2
            stacks.write_private(path, f"# source: {note}\n{text or ''}")
            notes[str(rank)] = note
        for fr in stack_dir.parent.glob(f"attempt-{self.attempt}/flight_recorder_rank_*"):
            notes.setdefault("flight_recorder", str(fr))
        return notes

    # ------------------------------------------------------------ stop
    def graceful_stop(self) -> None:
        """Ctrl-C / SIGTERM: ask ranks to save (if they can), then stop everything."""
        self.state = "stopping"
        self.write_status(force=True)
        name = signal.Signals(self.stop_signal).name
        live = [i for i in self.ranks.values() if i.peer is not None and i.gone_ts is None]
        for info in live:
            self.server.send(info.peer, {"cmd": "stop", "reason": name})
        deadline = time.monotonic() + min(2.0, self.cfg.grace_s)
        while time.monotonic() < deadline and len(self.stop_acks) < len(live) and self._signals < 2:
            self.pump(0.1, drain=True)
        supported = bool(self.stop_acks) and all(a.get("supported") for a in self.stop_acks.values())
        if supported and self.cfg.grace_s > 0:
            self.say(f"{name}: asking the ranks to checkpoint (up to {self.cfg.grace_s:g} s; again to stop now)")
            deadline = time.monotonic() + self.cfg.grace_s
            while time.monotonic() < deadline and self.proc.poll() is None and self._signals < 2:
                self.pump(0.1, drain=True)
        else:
            self.say(f"{name}: the engine cannot checkpoint on request; stopping (last good checkpoint: {(self.good or {}).get('step', 'none')})")
        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=min(self.cfg.kill_timeout_s, 5.0))
        self.pump(0.2, drain=True)
        self.step = max(self.step, launcher.completed_step(self.run))
