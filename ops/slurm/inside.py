"""The supervisor of a Slurm job's batch step: ``python -m ptops.ops.slurm.inside RUN_DIR [--fault
SPEC]...``.

It is the ordinary :class:`~ptops.ops.supervisor.core.Supervisor` (same records, monitors, hang
detection, restart policy) with the launch hooks filled in for Slurm:

- an attempt is one ``srun`` step over the attempt's nodes starting one node agent per node
  (``ops/node/agent.py``); the agents relay the ranks over one connection each, so the
  supervisor's channel listens on all addresses and advertises this node's address;
- a crash or hang whose ranks were all on one node is a strike against that node
  (``node_blamed``); at ``[slurm] node_strikes`` it is replaced by a spare node of the allocation
  (``node_replaced``), and with no spare left the job is resubmitted with ``--exclude`` of every
  blamed node (``slurm_requeue {how: resubmit}``) and this one ends with exit 5 (resubmitted: do
  not requeue this one);
- before each attempt every node of the allocation, spares included, runs the health checks in one
  ``srun`` step (``ops/node/health.py``; the clock measured against this supervisor's): a node that
  fails is out at once (``node_blamed`` at the strike limit) and a spare that passed takes its
  place (``node_replaced``); with none left the job is resubmitted without it (exit 5); when every
  node fails the same way the fault is the job's (its shared storage, say), and the run ends
  (exit 1) as a local one does;
- Slurm's warning signal (``--signal=B:USR1@S``) asks every rank to save at the next step boundary
  (the same all-agree stop request as Ctrl-C: ``ops/supervisor/stop.py``; held ranks are released),
  waits at most ``[slurm] preempt_grace_s``, then ``scontrol requeue`` (``preempted``,
  ``slurm_requeue {how: requeue}``); the requeued job adopts the run directory and resumes from
  that save. Attempt numbers continue from the run's events (``SLURM_RESTART_COUNT`` is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ptops import envnames
from ptops.faultinject.spec import FaultSpecError
from ptops.faultinject.spec import parse as parse_fault
from ptops.ops.rank.channel import new_token
from ptops.ops.runrecord.events import EventKind, RunState
from ptops.ops.runrecord.lock import LockedError, acquire
from ptops.ops.runrecord.rundir import RunDir
from ptops.ops.slurm import commands
from ptops.ops.slurm.sbatch import SCRIPT_NAME, world
from ptops.ops.supervisor import health, launcher
from ptops.ops.supervisor.core import Supervisor
from ptops.ops.supervisor.outcome import Outcome
from ptops.ops.supervisor.policy import EXIT_DONE, EXIT_RESUBMITTED
from ptops.recipes.schema import from_json


def _address_of_this_node() -> str:
    """What the other nodes dial: this node's address (its name may not resolve everywhere)."""
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class SlurmSupervisor(Supervisor):
    def __init__(self, recipe, run: RunDir, faults, allocation: list[str], job_id: str, **kw):
        super().__init__(recipe, run, faults, strategy="permanent", **kw)
        self.slurm = recipe.slurm
        self.job_id = job_id
        self.n_nodes, self.per_node, _ = world(recipe)
        self.world = self.n_nodes * self.per_node
        # the agents of other nodes must reach the channel: listen on all addresses
        # (token-authenticated)
        self.cfg = self.cfg.model_copy(
            update={
                "channel_host": "0.0.0.0",
                "channel_advertise": self.cfg.channel_advertise or _address_of_this_node(),
            }
        )
        self.strikes: dict[str, int] = {}
        for e in run.read_events():  # strikes survive a requeue: a bad node stays bad
            if e.get("kind") == EventKind.NODE_BLAMED:
                self.strikes[str(e["node"])] = int(e.get("strikes", 1))
        bad = {n for n, k in self.strikes.items() if k >= self.slurm.node_strikes}
        usable = [n for n in allocation if n not in bad]
        self.allocation = allocation
        self.active = usable[: self.n_nodes]
        self.spares = usable[self.n_nodes :]
        self.preempting = False
        self.stop_extra: dict = {}
        self.findings.exclude_node = self._exclude_straggler
        # the ranks run on other nodes, started by their node agents (no warm pool there yet)
        self.warm = None
        self.no_warm_why = (
            "no warm pool under Slurm: each node agent starts its ranks through torchrun"
        )

    # ------------------------------------------------------------ the attempt as an srun step
    def attempt_command(self, attempt: int, extra: dict[str, str]) -> launcher.RankCommand:
        base = launcher.rank_command(self.recipe, self.run, attempt, extra_env=extra)
        n = len(self.active)
        port = self.recipe.launch.master_port or random.randint(20000, 39999)
        base.env.update(
            {
                envnames.NODE_NPROC: str(self.per_node),
                envnames.NODE_NNODES: str(n),
                envnames.NODE_MASTER: self.active[0],
                envnames.NODE_PORT: str(port),
                envnames.NODE_LOG_DIR: str(self.run.logs(attempt).resolve()),
                envnames.NODE_UPSTREAM_TIMEOUT_S: str(self.slurm.upstream_timeout_s),
            }
        )
        if self.slurm.relay_every and n > 1:  # relays: the first node of each group (agent.py)
            base.env[envnames.RELAYS] = json.dumps(
                {"every": self.slurm.relay_every, "port": port + 1, "nodes": list(self.active)}
            )
        argv = [
            "srun", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={','.join(self.active)}", f"--job-name=ptops-attempt-{attempt}",
            "--kill-on-bad-exit=0", "--export=ALL", "--mem=0",
            sys.executable, "-P", "-m", "ptops.ops.node.agent",
        ]  # fmt: skip
        return launcher.RankCommand(argv, base.env)

    def unreaped_exit_code(self, rank: int) -> int | None:
        # the rank's pid is on its node, not here: wait for torchrun's line in the srun output
        return None

    def rendezvous_addresses(self) -> list[tuple[str, int]]:
        """The attempt's first node: every node's torchrun dials it (static rendezvous)."""
        return [(self.active[0], self.recipe.launch.master_port or 29500)] if self.active else []

    # ------------------------------------------------------------ health checks on every node
    def check_nodes(
        self, attempt: int, ctx: health.Context, skip: list[str]
    ) -> dict[str, list[health.Result]]:
        """One ``srun`` step over the attempt's nodes and the spares (``ops/node/health.py``);
        each writes its report into the run directory; a node without one failed ``report``."""
        nodes = self.active + self.spares
        out = self.run.path / "supervisor" / "health" / f"attempt-{attempt}"
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.json"):  # a requeued job checks its attempt again
            old.unlink()
        offsets = {
            str(f.params["node"]): float(f.params.get("offset_s", 0.0))
            for f in self.faults
            if f.kind == "clock-skew" and f.attempt in (0, attempt)
        }
        token = new_token()
        timeout = self.cfg.health.node_timeout_s
        with health.ClockServer(token) as clock:
            ctx.clock = (self.cfg.channel_advertise or _address_of_this_node(), clock.port)
            env = {
                **launcher.rank_command(self.recipe, self.run, attempt).env,
                envnames.HEALTH: json.dumps(
                    {**ctx.to_dict(), "out": str(out.resolve()), "skip": skip,
                     "clock_offsets": offsets, "xid_marks": self.xid_marks}
                ),
                envnames.HEALTH_TOKEN: token,
            }  # fmt: skip
            argv = [
                "srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
                "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
                f"--job-name=ptops-health-{attempt}", "--kill-on-bad-exit=0", "--export=ALL",
                "--mem=0", sys.executable, "-P", "-m", "ptops.ops.node.health",
            ]  # fmt: skip
            try:
                proc = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=timeout
                )
                tail = (proc.stdout + proc.stderr).strip()[-300:]
            except subprocess.TimeoutExpired:
                tail = f"the check step did not end within {timeout:g} s"
            except OSError as e:
                tail = f"srun: {e}"
        by_node: dict[str, list[health.Result]] = {}
        for node in nodes:
            try:
                report = json.loads((out / f"{node}.json").read_text())
                results = [health.Result.from_report(r) for r in report["results"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                miss = f"no report from {node} ({type(e).__name__}); the step said: {tail}"
                by_node[node] = [health.Result("report", False, miss)]
                continue
            by_node[node] = results
            seen = report.get("xid_seen")
            if isinstance(seen, list) and len(seen) == 2 and isinstance(seen[1], int):
                self.xid_marks[node] = (str(seen[0]), seen[1])
            for text in report.get("injected") or []:
                self.event(
                    EventKind.FAULT_INJECTED, fault=str(text)[:200], rank=None, step=None,
                    attempt=attempt, node=node,
                )  # fmt: skip
        return by_node

    def unhealthy(self, attempt: int, why: dict[str, str]) -> int | None:
        """Failing nodes are out at once; a spare that passed takes an active node's place. Every
        node failing is the job's fault (shared storage, the rendezvous), not a node's: exit 1."""
        checked = self.active + self.spares
        if set(why) >= set(checked):
            return super().unhealthy(attempt, why)
        self.spares = [n for n in self.spares if n not in why]
        # the failing spares are struck first, so a resubmit excludes them too
        for node in sorted(why, key=lambda n: n in self.active):
            if self._strike(node, [], f"health check: {why[node]}", at_once=True):
                code = self._resubmit_without(node)
                return code if code is not None else super().unhealthy(attempt, why)
        return None

    def launch_fields(self, attempt: int) -> dict:
        return {"nodes": list(self.active), "spares": list(self.spares), "job_id": self.job_id}

    def attempt_cleanup(self, attempt: int) -> None:
        """Every node agent of the attempt kills its ranks (those behind a cut link do so on their
        own once the supervisor's keepalives stop reaching them)."""
        agents = [p for p in self.node_peers.values() if int(p.hello.get("attempt", -1)) == attempt]
        for p in agents:
            if not p.hello.get("gone_ts"):
                self.server.send(p, {"cmd": "kill"})
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(not p.hello.get("gone_ts") for p in agents):
            self.pump(0.1, drain=True)

    # ------------------------------------------------------------ between attempts
    def after_outcome(self, outcome: Outcome) -> int | None:
        if outcome.kind == "interrupted" and self.preempting:
            return self._requeue_after_preemption()
        if outcome.kind in ("crash", "hang") and self.supervised:
            return self._blame_node(outcome)
        return None

    def _exclude_straggler(self, node: str, reason: str) -> str | None:
        """A straggler monitor's ``exclude_node``: a strike; at the limit a spare takes the node's
        place from the next attempt (training goes on meanwhile; no restart just for this)."""
        if node not in self.active:
            return None
        before = list(self.active)
        self._strike(
            node, [r.rank for r in self.ranks.values() if r.host == node], f"straggler: {reason}"
        )
        if self.active != before:
            return (
                f"strike {self.strikes[node]}; replaced by spare "
                f"{self.active[before.index(node)]} from the next attempt"
            )
        return f"strike {self.strikes[node]} of {self.slurm.node_strikes} against {node}"

    def _strike(self, node: str, ranks: list, reason: str, at_once: bool = False) -> bool:
        """One strike (``at_once``: straight to the limit, a failed health check); at the limit an
        active node is swapped for a spare. True when the limit is reached and no spare is left
        (the caller resubmits without it)."""
        limit = self.slurm.node_strikes
        self.strikes[node] = max(self.strikes.get(node, 0) + 1, limit if at_once else 0)
        self.event(
            EventKind.NODE_BLAMED,
            attempt=self.attempt,
            node=node,
            strikes=self.strikes[node],
            reason=reason,
            ranks=sorted(r for r in ranks if r is not None),
            limit=limit,
        )
        self.say(f"node {node}: strike {self.strikes[node]} of {limit} ({reason[:80]})")
        if self.strikes[node] < limit or node not in self.active:
            return False  # below the limit, or a spare (its caller took it out of the pool)
        if self.spares:
            spare = self.spares.pop(0)
            self.active[self.active.index(node)] = spare
            self.event(
                EventKind.NODE_REPLACED,
                attempt=self.attempt,
                node=node,
                by=spare,
                spares_left=len(self.spares),
            )
            self.say(
                f"node {node} replaced by spare {spare} from the next attempt "
                f"({len(self.spares)} spare(s) left)"
            )
            return False
        return True

    def _blame_node(self, outcome: Outcome) -> int | None:
        ranks = (
            outcome.detail.get("ranks") if outcome.kind == "hang" else [outcome.detail.get("rank")]
        )
        if outcome.kind == "crash" and outcome.detail.get("link"):  # its agent's or relay's host
            hosts = {outcome.detail["link"]}
        else:
            hosts = {self.rank_host(r) for r in (ranks or []) if r is not None}
        hosts.discard(None)
        if len(hosts) != 1:
            return (
                None  # no rank, or ranks on several nodes: not a node's fault as far as we can tell
            )
        node = hosts.pop()
        if node not in self.active:
            return None
        if not self._strike(node, list(ranks or []), outcome.reason):
            return None
        return self._resubmit_without(node)

    def _resubmit_without(self, node: str) -> int | None:
        bad = sorted(
            {n for n, k in self.strikes.items() if k >= self.slurm.node_strikes}
            | set(self.slurm.exclude)
        )
        script = self.run.path / "slurm" / SCRIPT_NAME
        try:
            new = commands.submit(str(script), [f"--exclude={','.join(bad)}"])
        except commands.SlurmError as e:
            self.say(
                f"node {node} is blamed and no spare is left, but resubmitting failed: {e}; "
                "restarting in place"
            )
            return None
        self.event(
            EventKind.SLURM_REQUEUE,
            job_id=self.job_id,
            new_job_id=new,
            how="resubmit",
            exclude=bad,
            reason=f"node {node} blamed {self.strikes[node]} time(s) and no spare node left",
        )
        self.say(
            f"no spare node left: resubmitted as job {new} without {','.join(bad)}; this job "
            "ends (exit 5)"
        )
        self.transition(RunState.RESTARTING, "resubmitted")
        self.reason = f"resubmitted as Slurm job {new} without {','.join(bad)}"
        self.write_status(force=True)
        return EXIT_RESUBMITTED

    def _requeue_after_preemption(self) -> int | None:
        saved = (self.good or {}).get("step")
        self.good = self._good_checkpoint_for_restart()
        self.event(
            EventKind.PREEMPTED,
            attempt=self.attempt,
            signal="USR1",
            step=self.step,
            saved_step=(self.good or {}).get("step"),
        )
        try:
            commands.requeue(self.job_id)
        except commands.SlurmError as e:
            self.say(f"preempted, but scontrol requeue failed: {e}")
            return None  # the run ends stopped; rerunning the launch resumes it
        self.event(
            EventKind.SLURM_REQUEUE,
            job_id=self.job_id,
            how="requeue",
            reason=f"warning signal: saved at step {(self.good or {}).get('step', saved)}",
        )
        self.say(
            f"preempted: saved at step {(self.good or {}).get('step')}, job {self.job_id} requeued"
        )
        self.transition(RunState.RESTARTING, "requeued")
        self.reason = "requeued after the Slurm warning signal"
        self.write_status(force=True)
        return EXIT_DONE  # nothing for the scheduler to do: the job is already requeued

    # ------------------------------------------------------------ signals
    def _on_usr1(self, signum, _frame) -> None:
        """Slurm's warning: save at the next step boundary (all ranks agree), then requeue."""
        self.preempting = True
        self.stop_extra = {"release_holds": True, "why": "preempt"}
        self.cfg = self.cfg.model_copy(update={"grace_s": self.slurm.preempt_grace_s})
        if self.stop_signal is None:
            self.stop_signal = signal.SIGUSR1

    def run_all(self, lock_fd: int | None = None) -> int:
        old = signal.signal(signal.SIGUSR1, self._on_usr1)
        try:
            self.event(
                EventKind.SLURM_ALLOCATION,
                job_id=self.job_id,
                nodes=self.allocation,
                restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                batch_host=socket.gethostname(),
                active=self.active,
                spares=self.spares,
            )
            if len(self.active) < self.n_nodes:
                self.say(
                    f"only {len(self.active)} usable node(s) in the allocation {self.allocation}, "
                    f"{self.n_nodes} needed"
                )
                code = self._resubmit_without(sorted(self.strikes)[0]) if self.strikes else None
                if code is not None:
                    return code
            return super().run_all(lock_fd)
        finally:
            signal.signal(signal.SIGUSR1, old)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m ptops.ops.slurm.inside",
        description="The supervisor of a ptops Slurm job (run by its sbatch script).",
    )
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--fault", action="append", default=[])
    args = ap.parse_args(argv)
    run = RunDir(args.run_dir)
    try:
        recipe = from_json(run.recipe_json.read_text())
        faults = [parse_fault(f) for f in args.fault]
    except (OSError, ValueError, FaultSpecError) as e:
        print(f"error: {run.recipe_json}: {e}", file=sys.stderr)
        sys.exit(2)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    allocation = commands.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or [
        socket.gethostname()
    ]
    try:
        lock_fd = acquire(run.path)
    except LockedError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sup = SlurmSupervisor(recipe, run, faults, allocation, job_id)
    code = sup.run_all(lock_fd)
    print(
        f"ptops: supervisor of job {job_id} exits {code} ({sup.state}: {sup.reason or 'ok'})",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(code)


if __name__ == "__main__":
    main()
