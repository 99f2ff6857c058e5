"""The channel: every message a rank or a control client sends, and what the supervisor does with
it.

Why a table: a message type names one handler method (:data:`RANK_HANDLERS`,
:data:`CONTROL_HANDLERS`), so "what happens on a ``beat``" is one short method to
read, and a message type nobody handles is counted (``unknown_messages``), not lost
in an if/elif. Messages of an earlier attempt (a straggler rank) are dropped here.

Used as a mixin of :class:`ptops.ops.supervisor.core.Supervisor`; it reads and writes
the attempt's live state (``ranks``, ``monitor``, ``blame``, ``step``, ``state``).
"""

from __future__ import annotations

import contextlib
import math
import queue
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ptops.faultinject.spec import Fault, FaultSpecError, format_spec
from ptops.faultinject.spec import parse_live as parse_fault
from ptops.ops.rank.channel import BEGUN, SUMMED, begins
from ptops.ops.runrecord.events import RANK_KINDS, EventKind, RunState
from ptops.ops.supervisor.blame import GOODBYE, NO_GOODBYE
from ptops.ops.supervisor.channel import LINK_CLOSED, Peer


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    peer: Peer | None = None
    exit_code: int | None = None  # from the rank's goodbye
    error: str | None = None
    traceback: str | None = None  # the goodbye's short traceback of a failure (rank entry.py)
    gone_ts: float | None = None  # EOF (monotonic)
    # the highest step this rank has begun (its beats) or finished (its metrics) by its own
    # messages; with the steps its relay folded or summed up: ``MessagesMixin.rank_step``
    step: int = 0
    step_s: float | None = None  # its last step's duration

    def reached(self, step: int, step_s: Any = None) -> None:
        """A beat or a record of ``step`` (a record's ``step_s``: kept when it is a number)."""
        if step > self.step:
            self.step = step
        if isinstance(step_s, (int, float)):
            self.step_s = step_s


# message type -> handler method name (``t`` of the message; ``_hello``/``_eof`` come from the
# server)
RANK_HANDLERS = {
    "_hello": "_on_hello",
    "beat": "_on_beat",
    "ping": "_on_ping",
    "world": "_on_world",
    "metrics": "_on_metrics",
    "fault": "_on_fault",
    "fault_armed": "_on_ignored",
    "event": "_on_event",
    "stacks": "_on_ignored",  # a dump its agent relayed after the hang's deadline
    "stop_ack": "_on_stop_ack",
    "exit": "_on_exit",
    "_eof": "_on_eof",
}
# a node agent's own messages (multi-node runs; its ranks' messages arrive as virtual rank peers)
NODE_HANDLERS = {
    "_hello": "_on_node_hello",
    "node_stacks": "_on_node_stacks",
    "node_exit": "_on_node_exit",
    "_alive": "_on_node_alive",
    "_batch": "_on_node_batch",
    "_eof": "_on_node_eof",
}
CONTROL_HANDLERS = {
    "inject": "_on_inject",
    "status": "_on_status",
    "profile": "_on_profile",
}
PROFILE_MAX_STEPS = 100
PROFILE_LEAD_S = 1.0  # a profile request must reach every rank before the step it starts at


def profile_start(
    rank_steps: list[int], step_s: float | None, lead_s: float = PROFILE_LEAD_S, min_margin: int = 2
) -> int:
    """The step every rank starts profiling at: past the furthest rank by ``min_margin`` steps,
    or by ``lead_s`` worth of steps when steps are fast, so the request reaches every rank first
    (a rank it reaches late starts at its next step and says so; the analysis keeps the steps
    common to all ranks)."""
    margin = min_margin
    if step_s and step_s > 0:
        margin = max(min_margin, math.ceil(lead_s / step_s) + 1)
    return max(rank_steps, default=0) + margin


class MessagesMixin:
    def pump(self, timeout: float, drain: bool = False) -> None:
        """Handle channel messages for up to ``timeout`` seconds (``drain``: until quiet)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                peer, msg, ts = self.server.inbox.get(timeout=left)
            except queue.Empty:
                return
            self.server.took(peer, ts)
            self.handle(peer, msg, ts)
            batch = msg.get("t") == "_batch"  # (``n``: the rank messages its items stand for)
            self.server.handled += msg.get("n", len(msg["items"])) if batch else 1
            if self.stop_signal is not None and not drain:
                return

    def handle(self, peer: Peer, msg: dict[str, Any], ts: float, like: Any = None) -> None:
        t = str(msg.get("t"))
        if peer.role == "control":
            name = CONTROL_HANDLERS.get(t)
        elif peer.role == "node":
            if int(peer.hello.get("attempt", -1)) != self.attempt:
                return
            name = NODE_HANDLERS.get(t)
        else:
            if not _current_rank(peer, self.attempt):
                return  # a straggler from an earlier attempt
            name = RANK_HANDLERS.get(t)
        if name is None:  # e.g. a rank of a newer ptops: ignored, counted, said once per type
            key = f"{peer.role}:{t}"
            self.unknown_messages[key] = self.unknown_messages.get(key, 0) + 1
            if self.unknown_messages[key] == 1:
                self.say(f"ignoring channel messages of unknown type {t!r} (from a {peer.role})")
            return
        if like is not None and name == "_on_metrics":
            self._on_metrics(peer, msg, ts, like)
            return
        getattr(self, name)(peer, msg, ts)

    # ------------------------------------------------------------ control clients (ptops inject)
    def _on_status(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        self.server.send(
            peer, {"ok": True, "state": self.state, "attempt": self.attempt, "step": self.step}
        )

    def _on_inject(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        try:
            fault = parse_fault(str(msg.get("spec", "")))
        except FaultSpecError as e:
            self.server.send(peer, {"ok": False, "error": str(e)})
            return
        if self.state not in (RunState.STARTING, RunState.RUNNING, RunState.CHECKPOINTING):
            self.server.send(
                peer, {"ok": False, "error": f"no live attempt to inject into (state {self.state})"}
            )
            return
        fault = Fault(fault.kind, fault.step, fault.rank, self.attempt, fault.params, fault.text)
        sent = []
        for info in self.ranks.values():
            if info.peer is not None and info.gone_ts is None:
                if self.server.send(info.peer, {"cmd": "fault", "fault": fault.to_dict()}):
                    sent.append(info.rank)
        self.event(
            EventKind.INJECT, fault=format_spec(fault), attempt=self.attempt, ranks=sorted(sent)
        )
        self.server.send(
            peer, {"ok": True, "attempt": self.attempt, "ranks": sorted(sent), "fault": str(fault)}
        )

    def _on_profile(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        """``ptops profile``: one start step for every rank, forwarded; the ranks report back as
        events."""

        def refuse(error: str) -> None:
            self.server.send(peer, {"ok": False, "error": error})

        try:
            steps = int(msg.get("steps", 5))
        except (TypeError, ValueError):
            return refuse(f"steps: expected a whole number, got {msg.get('steps')!r}")
        if not 1 <= steps <= PROFILE_MAX_STEPS:
            return refuse(f"steps: expected 1..{PROFILE_MAX_STEPS}, got {steps}")
        if self.state not in (RunState.RUNNING, RunState.CHECKPOINTING):
            return refuse(f"no live attempt to profile (state {self.state})")
        live = sorted(
            (i for i in self.ranks.values() if i.peer is not None and i.gone_ts is None),
            key=lambda i: i.rank,
        )
        if len(live) < self.world:
            return refuse(
                f"only {len(live)} of {self.world} ranks of attempt {self.attempt} are connected; "
                "try again once all have started"
            )
        busy = self.profiling
        if busy and busy["attempt"] == self.attempt and busy["waiting"]:
            return refuse(
                f"profile {busy['id']} (steps "
                f"{busy['start_step']}..{busy['start_step'] + busy['steps'] - 1}) "
                f"is still being captured by ranks {sorted(busy['waiting'])}"
            )
        times = [i.step_s for i in live if i.step_s]
        at_step = [self.rank_step(i) for i in live]
        start = profile_start(at_step, statistics.median(times) if times else None)
        total = int(self.recipe.train.steps)
        if start + steps > total:
            at = max(at_step)
            return refuse(
                f"the run is at step {at} of {total}: too few steps left to profile {steps} steps "
                f"from step {start} (the window must end before the last step)"
            )
        pid = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        cmd = {"cmd": "profile", "id": pid, "start_step": start, "steps": steps}
        sent = [i.rank for i in live if self.server.send(i.peer, cmd)]
        self.profiling = {
            "id": pid,
            "attempt": self.attempt,
            "start_step": start,
            "steps": steps,
            "waiting": set(sent),
        }
        self.event(
            EventKind.PROFILE_REQUESTED,
            id=pid,
            attempt=self.attempt,
            start_step=start,
            steps=steps,
            ranks=sent,
            dir=f"profiles/{pid}",
        )
        self.say(f"profile {pid}: ranks {sent} trace steps {start}..{start + steps - 1}")
        self.server.send(
            peer,
            {
                "ok": True,
                "id": pid,
                "attempt": self.attempt,
                "start_step": start,
                "steps": steps,
                "ranks": sent,
                "dir": f"profiles/{pid}",
                "total_steps": total,
            },
        )

    # ------------------------------------------------------------ ranks
    def _on_hello(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        hello, rank = peer.hello, peer.rank
        self.ranks[rank] = RankInfo(
            rank, int(hello.get("pid", 0)), str(hello.get("host", "?")), peer
        )
        self.ranks_changed += 1
        self.monitor.observe(
            {"kind": "beat", "rank": rank, "step": 0, "phase": "startup", "ts": ts}
        )
        if self.state == RunState.STARTING and len(self.ranks) >= self.world:
            self.transition(RunState.RUNNING, "all_ranks_hello")
        self.write_status(force=len(self.ranks) >= self.world)

    def _on_beat(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        rank = peer.rank
        phase = msg.get("phase", "step")
        step = int(msg.get("step", 0))
        info = self.ranks.get(rank)
        if info is not None:
            info.reached(step)
        self.monitor.observe(
            {
                "kind": "beat",
                "rank": rank,
                "step": step,
                "phase": phase,
                "stage": msg.get("stage"),
                "section": msg.get("section"),
                "ts": ts,
            }
        )
        if rank == 0:
            self._checkpoint_beat(phase, step, ts)

    def _on_ping(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        self.monitor.observe({"kind": "ping", "rank": peer.rank, "ts": ts})

    def _on_world(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        """A rank's process group as formed: a world of one, or of another size than the launcher
        asked for (nproc x nodes), is a misconfiguration: the attempt ends at once and the run fails
        (restarting cannot fix it)."""
        size, rank = int(msg.get("world_size", 0)), int(msg.get("rank", -1))
        if size == self.world and rank == peer.rank or self.misconfigured is not None:
            return
        host = str(msg.get("host") or peer.hello.get("host", "?"))
        what = "a world of one" if size == 1 else f"a world of {size}"
        self.misconfigured = {
            "attempt": self.attempt,
            "rank": peer.rank,
            "host": host,
            "world_size": size,
            "expected_world_size": self.world,
            "reason": f"rank {peer.rank} on {host} formed {what} (as rank {rank}) but the "
            "launcher started "
            f"{self.world} ranks: check the rendezvous endpoint (MASTER_ADDR / --rdzv-endpoint) "
            f"and nproc x nodes",
        }

    def _on_metrics(self, peer: Peer, msg: dict[str, Any], ts: float, like: Any = None) -> None:
        rank = peer.rank
        rec = msg.get("rec") or {}
        self.metrics_out.append(rec, like)
        info = self.ranks.get(rank)
        if info is not None:
            info.reached(int(rec.get("step") or 0), rec.get("step_s"))
        self.feed_monitors(rec, like)
        self.monitor.observe(
            {
                "kind": "metrics",
                "rank": rank,
                "step": rec.get("step", 0),
                "step_s": rec.get("step_s"),
                "ts": ts,
            }
        )
        if rank == 0:
            self._rank0_record(rec)

    def _rank0_record(self, rec: dict[str, Any]) -> None:
        self.step = int(rec.get("step", self.step))
        if self.state == RunState.STARTING:
            self.transition(RunState.RUNNING, "first_record")
        if self.progress is not None:
            self.progress.update(rec)

    def _on_fault(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        fields = {k: msg.get(k) for k in ("fault", "rank", "step", "attempt")}
        self.event(EventKind.FAULT_INJECTED, **fields)
        self.say(
            f"fault injected: {fields['fault']} on rank {fields['rank']} at step {fields['step']}"
        )

    def _on_ignored(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        pass

    def _on_event(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        kind = str(msg.get("kind") or "")
        if kind in RANK_KINDS:
            fields = msg.get("fields") or {}
            self.event(kind, **fields)
            busy = self.profiling
            if (
                kind in (EventKind.PROFILE_CAPTURED, EventKind.PROFILE_FAILED)
                and busy
                and busy["id"] == fields.get("id")
            ):
                busy["waiting"].discard(peer.rank)
            self.reached.note(kind, fields)
            if kind == EventKind.CHECKPOINT and fields.get("path"):
                # the engine's own event, sent after its commit: the one source of ``checkpoint``
                self.good = {"step": int(fields.get("step", 0)), "path": str(fields["path"])}

    def _on_stop_ack(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        self.stop_acks[peer.rank] = msg

    def _on_exit(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        rank = peer.rank
        info = self.ranks.get(rank)
        code = int(msg.get("code", 0))
        if info is not None:
            info.exit_code, info.error = code, msg.get("error")
            info.traceback = msg.get("traceback")
        self.monitor.observe({"kind": "exit", "rank": rank, "ts": ts, "code": code})
        if code != 0:
            self.blame.note(rank, code, GOODBYE, ts)

    def _on_eof(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        rank = peer.rank
        info = self.ranks.get(rank)
        if info is not None:
            info.gone_ts = ts
            self.ranks_changed += 1
            if info.exit_code is None:
                self.monitor.observe({"kind": "exit", "rank": rank, "ts": ts})
                via = peer.via if msg.get("link") is LINK_CLOSED else None
                link = _node_name(via) if via else None
                self.blame.note(rank, None, NO_GOODBYE, ts, link)

    # ------------------------------------------------------------ node agents (ops/node/agent.py)
    def _on_node_hello(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        self.node_peers[_node_name(peer)] = peer

    def _on_node_stacks(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        got = msg.get("stacks")
        for rank, reply in got.items() if isinstance(got, dict) else ():
            if isinstance(reply, dict) and str(rank).isdecimal():
                self.node_stacks[int(rank)] = {**reply, "node": peer.hello.get("node")}

    def _on_node_alive(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        """A node's liveness summary (``ChannelServer._alive``): what a ping a rank was."""
        seen = self.monitor.seen
        for vp, at in msg.get("seen") or ():
            if vp.rank is not None:
                seen(vp.rank, at)

    def _on_node_batch(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        """A node's batch of rank messages (``ChannelServer._batch``), in the order sent: each
        handled as if it had come alone, but a node's step group (its ranks' records of one
        step, the first whole and the rest certified equal to it but for some keys: ``like``;
        or their beats that begin the next step) is handled as ONE unit (``_on_step_group``),
        with the same effect. Why: at 16k nodes the supervisor's work must grow with nodes, not
        ranks (docs/scale.md, "The budget at 131,072 ranks")."""
        handle, out = self.handle, self.metrics_out
        lines = out.node(str(peer.hello.get("node"))) if self.cfg.metrics_lines == "node" else None
        items = msg.get("items") or ()
        with out.held(), lines or contextlib.nullcontext():  # the batch's records: one write
            i, n = 0, len(items)
            while i < n:
                j = _group_end(items, i, self.attempt) if self.STEP_GROUPS else i + 1
                if j - i > 1:
                    self._on_step_group(items[i:j], ts)
                else:
                    vp, m, like = items[i]
                    if like is SUMMED:
                        self._on_node_summary(vp, m, ts)
                    elif like is BEGUN:
                        self._on_begun(m, ts)
                    else:
                        handle(vp, m, ts, like)
                i = j

    STEP_GROUPS = True  # False: every message of a batch alone (the reference the tests compare)

    def _on_step_group(self, items: list, ts: float) -> None:
        """``_on_metrics`` (or ``_on_beat``) of each message of a node's step group (``_group_end``)
        as one pass a part: the lines, the monitors (``MonitorFeed.feed_group``), the hang monitor
        (``HangMonitor.observe_steps``). The same records, findings and state as one by one; only
        rank 0's progress line moves to the group's end."""
        ranks = self.ranks
        if items[0][1]["t"] == "beat":  # (one step: ``_group_end``)
            self._steps_begun([vp.rank for vp, _, _ in items], items[0][1]["step"], ts)
            return
        append = self.metrics_out.append
        recs, likes, done = [], [], []
        zero = None
        for vp, m, like in items:
            rec = m["rec"]
            append(rec, like)
            rank, step, step_s = vp.rank, rec["step"], rec.get("step_s")
            info = ranks.get(rank)
            if info is not None:
                info.reached(step, step_s)
            recs.append(rec)
            likes.append(like)
            done.append((rank, step, step_s))
            if rank == 0:
                zero = rec
        self.feed_monitors_group(recs, likes)
        self.monitor.observe_steps("metrics", done, ts)
        if zero is not None:
            self._rank0_record(zero)

    def current_ranks(self, peers: list) -> list[int]:
        """The ranks of this attempt among ``peers``, a list the channel shares from frame to
        frame (``peers_of``): worked out once a list and attempt, not a rank a step. Read it,
        never change it."""
        hit = self._rank_lists.get(id(peers))
        if hit is not None and hit[0] is peers and hit[1] == self.attempt:
            return hit[2]
        attempt = self.attempt
        ranks = [vp.key[0] for vp in peers if vp.key is not None and vp.key[1] == attempt]
        if len(self._rank_lists) >= 4096:
            self._rank_lists.clear()
        self._rank_lists[id(peers)] = (peers, attempt, ranks)  # (holds peers: no id reused)
        return ranks

    def _on_begun(self, msg: dict[str, Any], ts: float) -> None:
        """A folded line of begin beats (``ChannelServer._batch``): each rank's ``_on_beat`` as
        one step group (``_on_step_group``'s effect), or one by one without groups."""
        beat, peers = msg["beat"], msg["ranks"]
        if not self.STEP_GROUPS:
            for vp in peers:
                self.handle(vp, beat, ts)
            return
        self._steps_begun(self.current_ranks(peers), beat["step"], ts)

    def rank_step(self, info: RankInfo) -> int:
        """The highest step ``info``'s rank has begun or finished: by its own messages
        (``RankInfo.step``), or by a step group, a folded line or a summary of its node or relay,
        which the hang monitor holds (one update for a relay's ranks, not a write a rank a step:
        ~8 % of a core at 131,072 ranks)."""
        st = self.monitor.ranks.get(info.rank) if self.monitor is not None else None
        return info.step if st is None or st.step < info.step else st.step

    def _steps_begun(self, ranks: list[int], step: int, ts: float) -> None:
        """Each of ``ranks`` began ``step``, their beats come together at ``ts`` (a step group,
        a folded line): the hang monitor in one call (their progress: ``rank_step``), rank 0's
        checkpoint state."""
        self.monitor.observe_ranks("begin", ranks, step, ts)
        if 0 in ranks:
            self._checkpoint_beat("step", step, ts)

    def _on_node_summary(self, lead: Peer, msg: dict[str, Any], ts: float) -> None:
        """A node's routine ranks of one step, summed up by its agent (``node_summaries``): the
        summary into the node line, each rank's progress in the hang monitor (its step ended,
        ``rank_step``; the step time only for the rank of the summary's slowest, which can only
        lengthen the hang budget), the
        shared monitors moving them on with their leader (``MonitorFeed.repeat_summary``). The
        other monitors see these ranks only on sample steps (docs/scale.md)."""
        if not _current_rank(lead, self.attempt):
            return
        entry, rec = msg["entry"], msg["lead"]
        step = entry["step"]
        self.metrics_out.summary(entry, rec.get("rank") if msg["lead_out"] else None)
        hi = entry["keys"].get("step_s")
        slow, slow_s = (hi[4], hi[3]) if hi else (None, None)
        infos = self.ranks
        ranks = self.current_ranks(msg["ranks"])
        if slow in ranks:
            info = infos.get(slow)
            if info is not None:
                info.reached(step, slow_s)
        self.monitor.observe_ranks("metrics", ranks, step, ts, (slow, slow_s))
        unmoved = len(self.feed.unmoved)
        self._monitored(*self.feed.repeat_summary(rec, ranks, msg["names"]))
        for name in list(self.feed.unmoved)[unmoved:]:  # said once a monitor
            keys = ", ".join(sorted(msg["names"]))
            self.say(
                f"monitor {name} reads a key summed-up ranks differ in ({keys}): it judges them "
                "again from their next whole record (supervisor.node_summaries)"
            )

    def _on_node_exit(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        peer.hello["exit_code"] = msg.get("code")

    def _on_node_eof(self, peer: Peer, msg: dict[str, Any], ts: float) -> None:
        peer.hello["gone_ts"] = ts

    def _checkpoint_beat(self, phase: str, step: int, ts: float) -> None:
        """State only (``checkpointing`` while rank 0 is in a save's blocking part). The
        ``checkpoint`` event itself comes from the engine after its commit (``probe.event``),
        so there is one source, supervised or not, and a failed save never looks saved."""
        if phase == "checkpoint":
            self.ckpt_started.setdefault(step, ts)
            self.transition(RunState.CHECKPOINTING, "checkpoint_begun")
        elif step in self.ckpt_started:
            self.ckpt_started.pop(step)
            self.transition(RunState.RUNNING, "checkpoint_done")


def _node_name(peer: Peer) -> str:
    """A node agent's (or relay's) name as its hello gave it: the key of ``node_peers``, the host
    a closed link's blame goes to."""
    return str(peer.hello.get("node") or peer.hello.get("host"))


def _group_end(items: Any, i: int, attempt: int) -> int:
    """Where the node's step group that opens at ``items[i]`` ends (``i + 1``: none opens there).
    A group is a run of this attempt's ranks' messages of one step: ``metrics`` records, the
    first whole (no ``like``) and each later one certified against it (``like`` naming its
    rank), or ``beat``s that begin the step. Steps must be ints (what the handlers would parse
    the same way); anything else is left to the handlers one by one."""
    vp, m, like = items[i]
    t = m.get("t")
    if not _current_rank(vp, attempt) or t not in ("metrics", "beat"):
        return i + 1
    if t == "metrics":
        rec = m.get("rec")
        if like is not None or not isinstance(rec, dict) or type(rec.get("step")) is not int:
            return i + 1
        step, lead = rec["step"], rec.get("rank")
        j = i + 1
        while j < len(items):
            vp, m, like = items[j]
            rec = m.get("rec")
            if (
                m.get("t") != "metrics"
                or like is None
                or like[0] != lead
                or not isinstance(rec, dict)
                or rec.get("step") != step
                or type(rec["step"]) is not int
                or not _current_rank(vp, attempt)
            ):
                break
            j += 1
        return j
    if not begins(m):
        return i + 1
    step, first = m["step"], m
    j = i + 1
    while j < len(items):
        vp, m, _ = items[j]
        # (a folded line's ranks share its one message: ``unbatch``)
        if m is not first and (not begins(m) or m["step"] != step):
            break
        if not _current_rank(vp, attempt):
            break
        j += 1
    return j


def _current_rank(vp: Any, attempt: int) -> bool:
    """What ``handle`` takes as this attempt's rank: a rank's hello (``Peer.key``, read once) of
    this attempt."""
    k = vp.key
    return k is not None and k[1] == attempt
