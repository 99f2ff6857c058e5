"""A hung attempt: every rank's stacks first, then teardown, then the ``hang`` event.

Why a part of its own: at 03:00 the stacks are what the on-call reads, so how they are
obtained (each node agent gathers its ranks': their own dumps, py-spy for a rank that
cannot answer; a note for a rank that never connected) is kept in one place. Detection
itself is the pure ``ptops.monitors.hang`` monitor, driven by the channel handlers.

Used as a mixin of :class:`ptops.ops.supervisor.core.Supervisor`.
"""

from __future__ import annotations

import base64
import os
import queue
import re
import time
from pathlib import Path

from ptops.ops.runrecord.events import EventKind, RunState
from ptops.ops.runrecord.metrics import tail_records
from ptops.ops.runrecord.ranks import rank_list
from ptops.ops.runrecord.rundir import STACK_SECTION
from ptops.ops.supervisor import launcher, procs, stacks
from ptops.ops.supervisor.outcome import Outcome

# the rank's phases inside a step that wait on the inference engine (recipes/trl/engine.py)
ENGINE_SEAMS = ("engine_sync", "engine_generate", "engine_wait")


def sidecar_stacks(run_dir: Path, stack_dir: Path) -> str | None:
    """The other side of a seam: py-spy stacks of the run's sidecar processes (a vLLM server and
    its engine), one ``stack_dir/sidecars.txt``; None when the run has none."""
    from ptops.ops.supervisor.sidecar import sidecar_pids

    pids = sidecar_pids(run_dir)
    if not pids:
        return None
    parts = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            cmd = "?"
        text, how = stacks.with_py_spy(pid, timeout_s=10.0)
        parts.append(f"#### sidecar pid {pid} ({how}): {cmd.strip()} ####\n{text or ''}")
    out = stack_dir / "sidecars.txt"
    stacks.write_private(out, "\n".join(parts))
    return str(out)


def engine_version(run_dir: Path, tail_bytes: int = 262_144) -> int | None:
    """The newest ``engine/version`` in the run's records (their last ``tail_bytes``, read as every
    reader of the record reads them: rotated segments and node lines included)."""
    version = None
    try:
        for rec in tail_records(run_dir, tail_bytes):
            v = rec.get("engine/version")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                version = int(v)
    except (OSError, ValueError):  # a segment the hang's report can do without
        return None
    return version


class HangMixin:
    def on_hang(self, finding, attempt: int, stack_dir: Path) -> Outcome:
        self.transition(RunState.COLLECTING_STACKS, "hang")
        self.write_status(force=True)
        self.say(
            f"hang: rank(s) {rank_list(finding.ranks)} made no progress for "
            f"{finding.silent_s:.1f} s "
            f"(timeout {finding.timeout_s:.1f} s, {finding.phase}"
            + (
                f" {finding.section}"
                if finding.section and finding.section not in finding.phase
                else ""
            )
            + f", step {finding.step}"
            + (
                f"; judged on its own connection, the supervisor {finding.behind_s:.0f} s behind"
                if finding.behind_s > 0
                else ""
            )
            + (
                f"; {len(finding.also_quiet)} more quiet for less, not named: "
                f"{rank_list(finding.also_quiet, bare=True)}"
                if finding.also_quiet
                else ""
            )
            + "); collecting stacks"
        )
        found_ts = time.time()
        t0 = time.monotonic()
        notes = self.collect_stacks(stack_dir)
        ev = finding.as_event(attempt)
        ev["ranks_text"] = rank_list(finding.ranks, bare=True)  # the list stays (scripts read it)
        ev["found_ts"] = round(
            found_ts, 3
        )  # when the budget ran out (the event is written after the stacks)
        ev["stacks"] = str(stack_dir)
        ev["stack_sources"] = notes
        ev["stacks_s"] = round(time.monotonic() - t0, 2)
        if finding.phase in ENGINE_SEAMS:
            # the model version the engine was asked for (the rank's last record says it)
            version = engine_version(self.run.path)
            if version is not None:
                ev["engine_version"] = version
        t1 = time.monotonic()
        procs.teardown(self.proc, self.run.path, self._rank_pids(), grace_s=0)
        ev["teardown_s"] = round(time.monotonic() - t1, 2)
        self.event(EventKind.HANG, **ev)
        self.step = max(self.step, launcher.completed_step(self.run))
        return Outcome(
            "hang",
            f"hang: rank(s) {rank_list(finding.ranks)} silent {finding.silent_s:.0f} s at step "
            f"{finding.step}",
            ev,
        )

    def collect_stacks(self, stack_dir: Path) -> dict[str, str]:
        """Every rank's stacks, gathered by its node agent into one ``stack_dir/node-NAME.txt``
        (sections ``#### rank R ####``, read back by ``diagnostics/stacks.py``); returns rank ->
        how it was obtained (a rank that never said hello: "never connected")."""
        stack_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(stack_dir, 0o700)
        now = time.monotonic()
        by_node: dict[tuple, tuple] = {}  # (link, node) -> (link's peer, {"R": {c, pid, ask}})
        for info in self.ranks.values():
            if info.peer is None or info.peer.via is None:
                continue
            seen = (
                self.monitor.ranks.get(info.rank).last_seen
                if self.monitor and info.rank in self.monitor.ranks
                else None
            )
            # not even pinging (stopped, or stuck in C holding the GIL): straight to py-spy
            ask = not (seen is not None and now - seen > self.cfg.hang.ping_stale_s)
            # the rank's own node (its agent named it), asked through its link: the agent's, or
            # a relay's for many nodes (ops/node/relay.py), whose numbers ``c`` are its own
            via = info.peer.via
            node = str(info.peer.hello.get("node") or via.hello.get("node") or info.host)
            entry = {"c": info.peer.sub, "pid": info.pid, "ask": ask and info.gone_ts is None}
            by_node.setdefault((via.cid, node), (via, {}))[1][str(info.rank)] = entry
        self._ask_node_agents(by_node)
        self._wait_node_agents(by_node)
        notes: dict[str, str] = {}
        self._write_node_files(stack_dir, by_node, notes)
        for rank in range(self.world):
            notes.setdefault(str(rank), "never connected")
        for fr in stack_dir.parent.glob(f"attempt-{self.attempt}/flight_recorder_rank_*"):
            notes.setdefault("flight_recorder", str(fr))
        other = sidecar_stacks(self.run.path, stack_dir)
        if other is not None:
            notes["sidecars"] = other
        return notes

    def _ask_node_agents(self, by_node: dict[tuple, tuple]) -> None:
        """Each node agent gathers its ranks' stacks (``dump``: their own dumps, py-spy where they
        do not answer: ptrace does not cross hosts). Answers land in ``node_stacks``; a link that
        is silent (no keepalive: a cut) is not asked, nor one whose send failed. ONE ``dump`` a
        link: a relay (``ops/node/relay.py``) splits it for its nodes; a dump a node was 64 sends
        a relay, each up to the socket's 10 s when the relay stopped reading (131,072 ranks on
        16 cores: the supervisor sat in this loop for minutes)."""
        self.node_stacks = {}
        while not self.server.replies.empty():  # a late answer to an earlier hang
            self.server.replies.get_nowait()
        now = time.monotonic()
        links: dict[int, tuple] = {}  # link -> (its peer, {"R": entry}, {"R": node})
        for (_, node), (peer, ranks) in by_node.items():
            _, asked, named = links.setdefault(peer.cid, (peer, {}, {}))
            asked.update(ranks)
            named.update(dict.fromkeys(ranks, node))
        for peer, ranks, named in links.values():
            silent = now - peer.last_rx
            why = f"node unreachable (silent {silent:.0f} s)"
            if silent <= self.cfg.hang.ping_stale_s:
                msg = {
                    "cmd": "dump",
                    "id": self.attempt,
                    "ranks": ranks,
                    "timeout_s": self.cfg.stack_timeout_s,
                }
                if self.server.send(peer, msg):
                    continue
                why = "node unreachable (its link took no dump)"
            for r in ranks:
                self.node_stacks[int(r)] = {"text": None, "node": named[r], "note": why}

    def _wait_node_agents(self, by_node: dict[tuple, tuple]) -> None:
        """Until every asked rank is answered for, every node's link is gone, or py-spy's time is
        up. The ranks left are crossed off by each reply's own ranks, and the links looked at
        only when no reply comes: both were walked after every reply, O(nodes x ranks) at a
        hang (16,384 ranks: 2.5 s of CPU in the stacks; 131,072: ~3 minutes)."""
        left = {int(r) for _, ranks in by_node.values() for r in ranks} - self.node_stacks.keys()
        # the ranks' own dumps, then py-spy's own timeout (20 s)
        deadline = time.monotonic() + self.cfg.stack_timeout_s + 20.0
        peers = [p for p, _ in by_node.values()]
        while left and time.monotonic() < deadline:
            try:  # the replies beside the inbox: not behind its backlog
                peer, msg, ts = self.server.replies.get(timeout=0.1)
            except queue.Empty:
                if all(p.closed or p.hello.get("gone_ts") for p in peers):
                    return
                continue
            self.handle(peer, msg, ts)
            got = msg.get("stacks") if isinstance(msg, dict) else None
            for r in got if isinstance(got, dict) else ():
                if str(r).isdecimal() and int(r) in self.node_stacks:
                    left.discard(int(r))

    def _write_node_files(self, stack_dir: Path, by_node: dict[tuple, tuple], notes: dict) -> None:
        """One file a node: a section a rank, its source in the section's first line."""
        used: set[str] = set()
        for (_, node), (peer, ranks) in sorted(by_node.items(), key=lambda kv: kv[0][::-1]):
            name = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:64] or "node"
            if name in used:
                name = f"{name}-{peer.cid}"
            used.add(name)
            parts = []
            for r in sorted(ranks, key=int):
                rank = int(r)
                got = self.node_stacks.get(rank)
                if got is not None and got.get("text"):
                    how = got.get("note")
                    note = "channel" if how == "channel" else f"node agent {node}: {how}"
                    src = "channel (the rank's own dump)" if how == "channel" else note
                    parts.append(f"{STACK_SECTION % rank}\n# source: {src}\n{got['text']}")
                    fr = got.get("flight_recorder_b64")
                    if fr:
                        stacks.write_private(
                            stack_dir / f"rank-{rank}.flight_recorder", base64.b64decode(fr)
                        )
                else:
                    note = f"node agent {node}: " + (
                        (got or {}).get("note") or "no answer (node unreachable?)"
                    )
                    parts.append(f"{STACK_SECTION % rank}\n# no stack: {note}\n")
                notes[r] = note
            stacks.write_private(stack_dir / f"node-{name}.txt", "\n".join(parts))
