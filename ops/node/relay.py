"""A relay between up to ~64 node agents and the supervisor: the supervisor's unit becomes a
relay's group of nodes, not a node (docs/scale.md, "The relay tier").

Why: one supervisor process pays ~1.3 ms of CPU a node-step however little a node says (the
frame's parse and dispatch, the leader's record through the monitors, the line written); 16,384
nodes at 1 s steps is ~20 cores of that. A relay takes its nodes' frames and sends one of its own:
their ranks' lines unbatched and batched again by the agent's own ``Batcher`` over all its ranks,
so a step's records of 64 nodes cross as ONE leader and 511 differences, and with ``[supervisor]
node_summaries`` the routine ranks of all 64 nodes as ONE summary entry (the rule of
``ops/runrecord/nodesummary.py`` applied to 512 ranks at once: exact, no summary of summaries).

To the supervisor a relay is a node agent (``role: "node"``) whose ranks happen to live on several
hosts: nothing there changes. Each rank's hello keeps its own node's name (its agent set it), so
blame, stacks files and spares still name the rank's own host. To a node agent a relay is the
supervisor: the same frames, the same upstream token (every agent of the job has it already).

What the relay does with each frame of a node agent (wire format: ``ops/rank/channel.py``):

- ``b``: unbatched (records whole again) into the relay's batch, under the relay's numbers for
  the connections (``c``: unique over its nodes); a step that comes in several agents' frames is
  held (up to ``HOLD_S``, ``PTOPS_RELAY_HOLD_S``) until it has the ranks its step before had, so it
  leaves as one group in one order. A frame that carries its own summaries (an agent
  told to sum up) is passed on whole, renumbered: the relay does not sum up summaries.
- ``r`` (a rank's hello): numbered, sent up after the batch before it; ``g``: the same.
- ``a``: each rank's seen-at (receive time less its age) kept; the relay sends ONE ``a`` frame a
  second for all its ranks, ages re-counted at its own send time (no clock crosses hosts).
- ``node_stacks``: passed up as it came (ranks are global numbers).
- ``ka``, ``node_exit``: the agent's own; its link is watched here (``last_rx``), its end is EOF.
  A node agent's EOF is each of its ranks' ``g``.

Downstream: a rank's command goes to its agent under the agent's number; keepalives to every
agent; ``dump`` split by agent (an agent silent for ``STALE_S`` is answered for at once, "node
agent unreachable behind relay R", instead of holding the hang's stacks for py-spy's time);
``kill`` to every agent, then the relay ends. A send to an agent that does not take it within
``SEND_TIMEOUT_S`` cuts that agent off (its ranks go as at its EOF): a frozen host must not hold
the relay, and behind it the supervisor. When the supervisor's link closes or stays silent
for ``PTOPS_NODE_UPSTREAM_TIMEOUT_S`` the relay closes its agents' connections, and each agent
kills its ranks as it would had the supervisor gone (no orphans).

Where relays run: with ``[slurm] relay_every = N`` the agent of the first node of every N hosts one
(a thread; ``ops/node/agent.py``) and the group's agents connect to it; ``bench/scale_load.py
--relay-tier N`` starts one process per N simulated nodes (``main`` below; with ``--template`` only
those of rank 0 and the victim, the other groups' bytes made by ``upstream_hello`` and ``rebatch``).

Environment: ``PTOPS_CHANNEL``, ``PTOPS_CHANNEL_TOKEN`` (upstream), ``PTOPS_RELAY_LISTEN``
(``HOST:PORT`` to listen on for agents, default ``127.0.0.1:0``), ``PTOPS_NODE_SUMMARY`` (the
supervisor's summary settings: the relay sums up, its agents then should not), ``PTOPS_ATTEMPT``.
Prints ``{"relay": "HOST:PORT"}`` on stdout once listening.
"""

from __future__ import annotations

import hmac
import json
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any

from ptops import envnames
from ptops.ops.rank.channel import (
    ALIVE,
    ALIVE_S,
    BATCH,
    ENV_ADDRESS,
    ENV_TOKEN,
    KEEPALIVE,
    KEEPALIVE_S,
    MAX_LINE,
    RELAY,
    RELAY_GONE,
    ROLE_NODE,
    STEP_KINDS,
    SUMMARY_ENV,
    Batcher,
    ChannelClient,
    alive_entries,
    alive_frame,
    encode,
    split_address,
    summary_settings,
    take_lines,
    unbatch,
)

STALE_S = 5.0  # an agent this long silent is not asked for stacks (the supervisor's ping_stale_s)
SEND_TIMEOUT_S = 2.0  # a send to an agent that does not read gives up, and the agent is dropped
# a step's lines are held this long at most for its ranks still to come (``Batcher``'s hold_s)
HOLD_S = 0.25
KA_LINE = encode({"t": KEEPALIVE})


class _Agent:
    """One node agent's connection to the relay."""

    __slots__ = ("sock", "buf", "hello", "last_rx", "lock", "cids", "broken")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.hello: dict[str, Any] | None = None
        self.last_rx = now
        self.lock = threading.Lock()
        self.cids: dict[int, int] = {}  # the agent's number for a rank -> the relay's
        self.broken = False

    def send(self, data: bytes) -> None:
        """Within the socket's ``SEND_TIMEOUT_S``, else the agent is cut off: an agent that
        stopped reading (a frozen host) must not hold the relay's upstream reader, and behind
        it the supervisor's sends to the relay. Its ranks then go as at its EOF (``g``)."""
        if self.broken:
            return
        try:
            with self.lock:
                self.sock.sendall(data)
        except OSError:
            self.broken = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # the loop reads its EOF and drops it
            except OSError:
                pass


def upstream_hello(name: str, env: dict[str, str]) -> dict[str, Any]:
    """A relay's hello to the supervisor (after the token ``ChannelClient`` puts first): a node
    agent's, ``relay: true``. A function of its own: ``bench/scale_load.py --template`` says it
    for the relays it stands in for, and must say what a relay says."""
    return {
        "role": ROLE_NODE,
        "node": name,
        "relay": True,
        "pid": os.getpid(),
        "host": name,
        "attempt": int(env.get(envnames.ATTEMPT) or 0),
    }


def rebatch(
    batch: Batcher, frame: dict[str, Any], size: int, now: float, mine: dict[int, int]
) -> list[tuple[int, dict[str, Any]]]:
    """An agent's ``b`` frame (parsed; ``size``: its line's bytes) unbatched into the relay's
    ``batch``, each line under the relay's number for its rank (``mine``: the agent's number ->
    the relay's; a line of a number the agent never said hello for is dropped). Returns the
    (relay's number, message) pairs added, for the relay's liveness. A function, not a method:
    ``bench/scale_load.py --template`` makes the frames of the relays it stands in for with it,
    so what they send is what this code makes."""
    pairs = unbatch(frame)
    share = size // max(1, len(pairs))  # a line's share of the frame: the batch's bytes
    add = batch.add
    out = []
    for cid, m in pairs:
        c = mine.get(cid) if type(cid) is int else None
        if c is not None:
            add(c, None, now, m, share)  # encoded by the batch, only if it leaves whole
            out.append((c, m))
    return out


def hold_s(env: dict[str, str]) -> float:
    """``PTOPS_RELAY_HOLD_S`` (seconds; 0: a step's pieces leave as they come), else ``HOLD_S``."""
    try:
        v = float(env.get(envnames.RELAY_HOLD_S) or HOLD_S)
    except ValueError:
        return HOLD_S
    return v if 0.0 <= v <= 10.0 else HOLD_S


class Relay:
    def __init__(self, env: dict[str, str], name: str | None = None) -> None:
        self.env = env
        self.name = name or socket.gethostname()
        self.token = env[ENV_TOKEN]
        self.upstream_timeout = float(env.get(envnames.NODE_UPSTREAM_TIMEOUT_S) or 10.0)
        self.batch = Batcher(*summary_settings(env.get(SUMMARY_ENV)), hold_s=hold_s(env))
        self.done = threading.Event()
        self.why = ""
        self.last_upstream = time.monotonic()
        self._agents: dict[int, _Agent] = {}  # fd -> agent
        self._down: dict[int, tuple[_Agent, int]] = {}  # the relay's number -> (agent, its)
        self._heard: dict[int, float] = {}  # the relay's number -> seen at (monotonic)
        self._stepped: set[int] = set()  # numbers with a beat or record sent since the last a
        self._next = 0
        host, port = split_address(env.get(envnames.RELAY_LISTEN) or "127.0.0.1:0")
        self._listen = socket.socket()
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((host, port))
        self._listen.listen(1024)
        self._listen.setblocking(False)
        self.up = ChannelClient(
            env[ENV_ADDRESS],
            self.token,
            upstream_hello(self.name, env),
            on_message=self._from_supervisor,
            on_eof=lambda: self.stop("the supervisor's connection closed"),
            connect_timeout=30.0,
        )

    @property
    def address(self) -> str:
        host, port = self._listen.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self, why: str) -> None:
        if not self.done.is_set():
            self.why = why
            self.done.set()

    def serve_out(self) -> None:
        """The hosting agent is done (``[slurm] relay_every``): relay on until the group's other
        agents are gone (their ranks may still be saving) or the supervisor is, then stop."""
        while self._agents and not self.done.wait(0.2):
            pass
        self.stop("its agents are gone")

    # ------------------------------------------------------------ upstream (reader thread)
    def _from_supervisor(self, msg: dict[str, Any]) -> None:
        self.last_upstream = time.monotonic()
        t, cmd = msg.get("t"), msg.get("cmd")
        if t == RELAY:
            to = self._down.get(msg.get("c")) if type(msg.get("c")) is int else None
            if to is not None and isinstance(msg.get("m"), dict):
                to[0].send(encode({"t": RELAY, "c": to[1], "m": msg["m"]}))
        elif t == KEEPALIVE:
            for a in list(self._agents.values()):
                a.send(KA_LINE)
        elif cmd == "dump":  # (its sends may wait on agents: off this reader)
            threading.Thread(target=self._dump, args=(msg,), daemon=True).start()
        elif cmd == "kill":
            for a in list(self._agents.values()):
                a.send(encode({"cmd": "kill"}))
            self.stop("the supervisor asked")

    def _dump(self, msg: dict[str, Any]) -> None:
        """The supervisor's ``dump`` for ranks behind this relay, split by agent, each under its
        own numbers; an agent silent for ``STALE_S`` answered for here at once."""
        by_agent: dict[int, tuple[_Agent, dict]] = {}
        ranks = msg.get("ranks")
        for r, v in ranks.items() if isinstance(ranks, dict) else ():
            c = v.get("c") if isinstance(v, dict) else None
            to = self._down.get(c) if type(c) is int else None  # (a list would not hash)
            if to is not None:
                by_agent.setdefault(id(to[0]), (to[0], {}))[1][r] = {**v, "c": to[1]}
        now = time.monotonic()
        for agent, ranks in by_agent.values():
            silent = now - agent.last_rx
            if silent > STALE_S:
                note = f"node agent unreachable behind relay {self.name} (silent {silent:.0f} s)"
                stacks = {
                    r: {"text": None, "note": note, "pid": v.get("pid")} for r, v in ranks.items()
                }
                self.up.send({"t": "node_stacks", "id": msg.get("id"), "stacks": stacks})
            else:
                agent.send(encode({**msg, "ranks": ranks}))

    # ------------------------------------------------------------ agents (the relay's loop)
    def _flush(self) -> None:
        frame = self.batch.frame()
        if frame is not None and not self.up.send_raw(frame):
            self.stop("the supervisor's connection broke")

    def _gone(self, agent: _Agent, cid: int) -> None:
        mine = agent.cids.pop(cid, None)
        if mine is not None:
            self._down.pop(mine, None)
            self._heard.pop(mine, None)
            self.up.send({"t": RELAY_GONE, "c": mine})

    def _drop(self, sel: selectors.BaseSelector, agent: _Agent) -> None:
        try:
            sel.unregister(agent.sock)
        except (KeyError, ValueError):
            pass
        self._agents.pop(agent.sock.fileno(), None)
        agent.sock.close()
        self._flush()  # its ranks' last lines before the word that they are gone
        for cid in list(agent.cids):
            self._gone(agent, cid)

    def _line(self, agent: _Agent, raw: bytes, now: float) -> bool:
        """One line of an agent; False when the agent is to be dropped (a bad hello)."""
        try:
            msg = json.loads(raw)
        except ValueError:
            return True
        if not isinstance(msg, dict):
            return True
        t = msg.get("t")
        if agent.hello is None:
            tok = str(msg.get("token", ""))
            if (
                t != "hello"
                or msg.get("role") != ROLE_NODE
                or not hmac.compare_digest(tok.encode(), self.token.encode())
            ):
                return False
            msg.pop("token", None)
            agent.hello = msg
            return True
        if t == BATCH:
            self._batched(agent, msg, raw, now)
        elif t == ALIVE:
            for cid, age in alive_entries(msg):
                mine = agent.cids.get(cid) if type(cid) is int else None
                at = now - age / 1000.0
                if mine is not None and at > self._heard.get(mine, 0.0):
                    self._heard[mine] = at
        elif t == RELAY:
            cid, m = msg.get("c"), msg.get("m")
            if type(cid) is not int or not isinstance(m, dict):
                return True
            mine = agent.cids.get(cid)
            if mine is None:
                if m.get("t") != "hello":  # the agent checked its rank's token: hello first
                    return True
                self._next += 1
                mine = agent.cids[cid] = self._next
                self._down[mine] = (agent, cid)
                m.setdefault("node", agent.hello.get("node"))
                self._flush()
                self.up.send({"t": RELAY, "c": mine, "m": m})
            else:
                self._heard[mine] = now
                self.batch.add(mine, None, now, m, len(raw))
        elif t == RELAY_GONE:
            if type(msg.get("c")) is int:
                self._flush()
                self._gone(agent, msg["c"])
        elif t == "node_stacks":
            self.up.send_raw(raw + b"\n")
        return True

    def _batched(self, agent: _Agent, frame: dict[str, Any], raw: bytes, now: float) -> None:
        if frame.get("s"):  # an agent that sums up its own ranks: on whole, renumbered
            cids = frame.get("c")
            if not isinstance(cids, list):
                return
            mine = agent.cids
            frame["c"] = [mine.get(c, -1) if type(c) is int else -1 for c in cids]
            for s in frame["s"] if isinstance(frame["s"], list) else ():
                if isinstance(s, list) and len(s) == 6 and isinstance(s[2], list):
                    s[2] = [mine.get(c, -1) if type(c) is int else -1 for c in s[2]]
            self._flush()
            self.up.send_raw(encode(frame))
            return
        heard, stepped = self._heard, self._stepped
        for mine, m in rebatch(self.batch, frame, len(raw), now, agent.cids):
            heard[mine] = now
            if m.get("t") in STEP_KINDS:
                stepped.add(mine)

    def loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, None)
        next_ka = next_alive = 0.0
        batch = self.batch
        while not self.done.is_set():
            now = time.monotonic()
            if batch.due(now):
                self._flush()
            if now >= next_ka:
                next_ka = now + KEEPALIVE_S
                self.up.send({"t": KEEPALIVE})
            if now >= next_alive:
                next_alive = now + ALIVE_S
                if not batch.holding(now):  # (a held step leaves whole: its ranks are stepped)
                    self._flush()  # the lines heard before the word that they were heard
                self._alive(now)
            if now - self.last_upstream > self.upstream_timeout:
                self.stop(f"no word from the supervisor for {self.upstream_timeout:g} s")
                break
            wait = min(batch.wait_s(now, 0.2), max(0.0, next_alive - now))
            for key, _ in sel.select(timeout=wait):
                if key.data is None:
                    try:
                        conn, _ = self._listen.accept()
                    except OSError:
                        continue
                    conn.settimeout(SEND_TIMEOUT_S)  # (reads happen when select says ready)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    agent = _Agent(conn, time.monotonic())
                    self._agents[conn.fileno()] = agent
                    sel.register(conn, selectors.EVENT_READ, agent)
                    continue
                agent = key.data
                try:
                    data = agent.sock.recv(1 << 20)
                except OSError:
                    data = b""
                if not data or len(agent.buf) > MAX_LINE:
                    self._drop(sel, agent)
                    continue
                now = time.monotonic()
                agent.last_rx = now
                agent.buf += data
                for raw in take_lines(agent.buf):
                    if not self._line(agent, raw, now):
                        self._drop(sel, agent)
                        break
        self._flush()
        for agent in list(self._agents.values()):  # each agent kills its ranks on our EOF
            try:
                agent.sock.close()
            except OSError:
                pass
        self._listen.close()
        self.up.close()

    def _alive(self, now: float) -> None:
        """One ``a`` frame for all its ranks heard since the last, but those whose beat or record
        it sent since (each was a sign of life to the supervisor): the agent's own rule."""
        heard, self._heard = self._heard, {}
        stepped, self._stepped = self._stepped, set()
        frame = alive_frame(heard, stepped, self._down, now)
        if frame is not None:
            self.up.send(frame)


def main() -> None:
    from ptops.ops.supervisor.procs import die_with_parent

    die_with_parent()
    try:
        relay = Relay(dict(os.environ))
    except (ConnectionError, ValueError, KeyError, OSError) as e:
        sys.stderr.write(f"[ptops.relay] {e}\n")
        sys.exit(1)
    sys.stdout.write(json.dumps({"relay": relay.address}) + "\n")
    sys.stdout.flush()
    relay.loop()
    sys.stderr.write(f"[ptops.relay {relay.name}] done ({relay.why})\n")


if __name__ == "__main__":
    main()
