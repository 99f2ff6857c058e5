"""The supervisor's side of the channel: accepts node agents and control clients, queues messages.

The wire format, token and address handling are in :mod:`ptops.ops.rank.channel` (the rank side).
A node agent's connection (``role: "node"``) carries its node's ranks: each relayed rank becomes a
virtual :class:`Peer` (``via`` the node's peer), so the handlers see per-rank messages, and
``send`` to it is wrapped for the agent. A rank connecting directly is refused: a local run is a
one-node run through the same agent, so there is one path to test.
"""

from __future__ import annotations

import hmac
import json
import queue
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ptops.ops.rank.channel import (
    ALIVE,
    BATCH,
    BEGUN,
    KEEPALIVE,
    KEEPALIVE_S,
    MAX_LINE,
    RELAY,
    RELAY_GONE,
    ROLE_CONTROL,
    ROLE_NODE,
    SUMMED,
    alive_entries,
    encode,
    new_token,
    take_lines,
    unbatch,
)

NODE_FRAMES = (RELAY, RELAY_GONE, KEEPALIVE, ALIVE, BATCH)  # a node agent's own frame types
DIRECT_ROLES = (ROLE_NODE, ROLE_CONTROL)  # who may connect; ranks arrive relayed by an agent
REFUSED = "role %r refused: ranks connect through their node agent (python -m ptops.ops.node.agent)"


@dataclass
class Peer:
    """One authenticated connection, as the server sees it."""

    cid: int
    sock: socket.socket
    hello: dict[str, Any] = field(default_factory=dict)
    buf: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    authed: bool = False
    via: "Peer | None" = None  # a relayed rank: the node agent's connection it arrives on
    sub: int = 0  # a relayed rank: the agent's number for it
    subs: dict = field(default_factory=dict)  # a node agent: sub -> its virtual peers
    # a node agent: a list of its connections as its frames name them -> their peers (``peers_of``)
    lists: dict = field(default_factory=dict)
    last_rx: float = (
        0.0  # monotonic time of the last bytes from this connection (a node's keepalives)
    )
    closed: bool = False  # the channel thread dropped it (its ``_eof`` may still be queued)
    # a connection's messages queued and not yet taken: their arrival times, oldest first (the
    # channel thread appends, the main thread pops; ``conn_read_until``)
    arrivals: deque = field(default_factory=deque)
    # a connection last read full since the round after this time: what reached its socket
    # before it has been read (``conn_read_until``)
    caught_t: float = 0.0

    # a rank's (rank, attempt) read off its hello once, None for any other peer or a hello whose
    # numbers are no ints: what each message's check reads (``messages._current_rank``), once a
    # rank a step at 131,072 ranks, where reading the hello each time was a tenth of a step's cost
    key: tuple[int, int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.key = _rank_key(self.hello)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "hello":
            object.__setattr__(self, "key", _rank_key(value))

    @property
    def role(self) -> str:
        return self.hello.get("role", "rank")

    @property
    def rank(self) -> int | None:
        if self.key is not None:
            return self.key[0]
        r = self.hello.get("rank")
        return None if r is None else int(r)


def _rank_key(hello: Any) -> tuple[int, int] | None:
    if not isinstance(hello, dict) or hello.get("role", "rank") in DIRECT_ROLES:
        return None
    rank, attempt = hello.get("rank"), hello.get("attempt", -1)
    try:
        return None if rank is None else (int(rank), int(attempt))
    except (TypeError, ValueError):
        return None


RECV_BYTES = 65536  # one read of a peer; a read that fills it leaves bytes behind
# a relayed rank's ``_eof`` under ``"link"``: it ended because its node agent's or relay's link
# closed, not by its own goodbye or ``g`` (the blame goes to that link's host); no message's value
LINK_CLOSED = object()


class ChannelServer:
    """Accepts connections in a background thread and queues ``(peer, message, recv_ts)``.

    Synthetic messages: ``{"t": "_hello"}`` after a good hello, ``{"t": "_eof"}``
    when a connection closes (a relayed rank's, when its node's link closed: ``"link":
    LINK_CLOSED``). ``recv_ts`` is the supervisor's ``time.monotonic()``.
    """

    def oldest_unhandled(self) -> float | None:
        """The arrival time (``recv_ts``) of the oldest message still queued, None when the inbox
        is empty: what the supervisor has not read yet, it cannot judge."""
        with self.inbox.mutex:
            return self.inbox.queue[0][2] if self.inbox.queue else None

    def read_until(self) -> float:
        """Every byte that reached this host's sockets by this time has been read: now while the
        channel thread waits in ``select`` (nothing is pending then), else the return of its
        last ``select`` whose ready sockets all read short (a full read leaves bytes behind: a
        busy or starved thread is behind by that much, and bytes in the kernel have no stamp)."""
        return time.monotonic() if self._idle else self._caught_up

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.token = token or new_token()
        self.inbox: queue.Queue[tuple[Peer, dict[str, Any], float]] = queue.Queue()
        # messages queued so far (a batch counts its messages): less ``handled`` (the supervisor's
        # count), how many wait; the queue's length counts a batch as one
        self.received = 0
        self.handled = 0
        self.refused = 0  # authenticated connections refused for their role (a direct rank)
        # a node agent's stacks at a hang (``node_stacks``), beside the inbox: the hang path waits
        # for them, and behind a backlog of 100,000s of messages they came after the wait ended
        self.replies: queue.Queue[tuple[Peer, dict[str, Any], float]] = queue.Queue()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((host, port))
        self._listen.listen(256)
        self._listen.setblocking(False)
        self.host, self.port = self._listen.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._peers: dict[int, Peer] = {}
        self._next = 0
        self._stop = threading.Event()
        self._idle, self._caught_up = True, time.monotonic()  # read_until
        # conn_read_until: the connections (ids) the last round read full, and when that round's
        # select returned (both published when the round is done)
        self._full: frozenset = frozenset()
        self._round_t = self._caught_up
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="ptops-channel", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[Peer, dict[str, Any], float]) -> None:
        self.received += 1
        peer = item[0]
        (peer.via or peer).arrivals.append(item[2])
        self.inbox.put(item)

    def took(self, peer: Peer | None, ts: float) -> None:
        """The main thread took ``peer``'s message that arrived at ``ts`` off the inbox (one not
        put by ``_put``, such as a test's, has no arrival to drop)."""
        if peer is None:
            return
        a = (peer.via or peer).arrivals
        if a and a[0] == ts:
            a.popleft()

    def conn_read_until(self, peer: Peer, now: float) -> float:
        """``read_until`` for ONE rank's connection (its node agent's, when relayed): every message
        it sent that reached this host before the time returned has been handled. Its own oldest
        queued message, and its own socket left unread by a full read: a backlog on other
        connections does not hold it, so a node that went silent is judged at about the clock
        while the others' messages wait."""
        conn = peer.via or peer
        t = now if self._idle else (conn.caught_t if id(conn) in self._full else self._round_t)
        a = conn.arrivals
        if a:
            try:
                t = min(t, a[0])
            except IndexError:  # taken meanwhile
                pass
        return min(t, now)

    def address(self, advertise: str = "") -> str:
        host = advertise or self.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    # ------------------------------------------------------------ thread side
    def _loop(self) -> None:
        next_ka = time.monotonic() + KEEPALIVE_S
        while not self._stop.is_set():
            if time.monotonic() >= next_ka:
                next_ka = time.monotonic() + KEEPALIVE_S
                self._keepalive()
            self._idle = True
            ready = self._sel.select(timeout=0.5)
            self._idle = False
            # select reports every socket with bytes at its return: once the ready ones are read
            # short, everything that arrived before t has been read
            t = time.monotonic()
            full = []
            for key, _ in ready:
                if key.data == "wake":
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                elif key.data is None:
                    self._accept()
                elif self._read(key.data):
                    full.append(key.data)
            if not full:
                self._caught_up = t
            # a connection read full this round is caught up to the round before it first was
            for p in full:
                if id(p) not in self._full:
                    p.caught_t = self._round_t
            self._full = frozenset(map(id, full))
            self._round_t = t

    def _accept(self) -> None:
        try:
            sock, _ = self._listen.accept()
        except OSError:
            return
        sock.settimeout(
            10.0
        )  # a send to a peer behind a cut link fails instead of blocking forever
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next += 1
        peer = Peer(self._next, sock)
        self._peers[peer.cid] = peer
        self._sel.register(sock, selectors.EVENT_READ, peer)

    def _keepalive(self) -> None:
        """Node agents kill their ranks when the supervisor goes silent (a network cut gives no
        EOF)."""
        for peer in list(self._peers.values()):
            if peer.authed and peer.role == ROLE_NODE:
                self.send(peer, {"t": KEEPALIVE})

    def _drop(self, peer: Peer) -> None:
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        try:
            peer.sock.close()
        except OSError:
            pass
        self._peers.pop(peer.cid, None)
        peer.closed = True
        if peer.authed:
            now = time.monotonic()
            for sub in list(peer.subs.values()):  # the node's ranks are gone with it
                if sub.authed:
                    self._put((sub, {"t": "_eof", "link": LINK_CLOSED}, now))
            peer.subs.clear()
            peer.lists.clear()
            self._put((peer, {"t": "_eof"}, now))

    def _read(self, peer: Peer) -> bool:
        """One read of a ready peer; True when it filled the buffer (more may be waiting)."""
        try:
            data = peer.sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return False
        peer.buf += data
        peer.last_rx = time.monotonic()
        if len(peer.buf) > MAX_LINE:
            self._drop(peer)
            return False
        full = len(data) == RECV_BYTES
        now = time.monotonic()
        for raw in take_lines(peer.buf):
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if not isinstance(msg, dict):
                continue
            if not peer.authed:
                tok = str(msg.get("token", ""))
                if msg.get("t") != "hello" or not hmac.compare_digest(
                    tok.encode(), self.token.encode()
                ):
                    peer.authed = False
                    self._drop(peer)
                    return False
                msg.pop("token", None)
                if msg.get("role") not in DIRECT_ROLES:
                    # a rank reaches the supervisor only through its node agent (one path for
                    # one node and many); told why, then dropped
                    self.refused += 1
                    try:
                        peer.sock.sendall(encode({"error": REFUSED % msg.get("role", "rank")}))
                    except OSError:
                        pass
                    self._drop(peer)
                    return False
                peer.hello = msg
                peer.authed = True
                self._put((peer, {**msg, "t": "_hello"}, now))
                continue
            if peer.role == ROLE_NODE and msg.get("t") == "node_stacks":
                self.replies.put((peer, msg, now))  # not behind a backlog: see ``replies``
                continue
            if peer.role == ROLE_NODE and msg.get("t") in NODE_FRAMES:
                t = msg["t"]
                if t == BATCH:
                    self._batch(peer, msg, now)
                elif t == ALIVE:
                    self._alive(peer, msg, now)
                elif t != KEEPALIVE:
                    self._relayed(peer, msg, now)
                continue
            self._put((peer, msg, now))
        return full

    def _relayed(self, node: Peer, frame: dict[str, Any], now: float) -> None:
        try:
            sub = int(frame.get("c"))
        except (TypeError, ValueError):
            return
        vp = node.subs.get(sub)
        if frame["t"] == RELAY_GONE:
            if vp is not None:
                node.subs.pop(sub, None)
                node.lists.clear()
                if vp.authed:
                    self._put((vp, {"t": "_eof"}, now))
            return
        msg = frame.get("m")
        if not isinstance(msg, dict):
            return
        if vp is None:
            if (
                msg.get("t") != "hello"
            ):  # the agent checked the rank's token; the first line is its hello
                return
            self._next += 1
            hello = {k: v for k, v in msg.items() if k != "token"}
            hello.setdefault("node", node.hello.get("node"))
            vp = Peer(self._next, node.sock, hello=hello, authed=True, via=node, sub=sub)
            node.subs[sub] = vp
            node.lists.clear()
            self._put((vp, {**hello, "t": "_hello"}, now))
            return
        self._put((vp, msg, now))

    def _batch(self, node: Peer, frame: dict[str, Any], now: float) -> None:
        """A node's batch of rank lines: ONE inbox entry (``batch_entry``)."""
        entry = batch_entry(node, frame)
        if entry["items"]:
            self._put((node, entry, now))
            self.received += entry["n"] - 1

    def _alive(self, node: Peer, frame: dict[str, Any], now: float) -> None:
        """A node's liveness summary: ONE inbox entry for all its ranks, ``(rank peer, seen at)``
        pairs (the agent's ages off this receive time). Malformed entries are dropped, never the
        frame's neighbours."""
        seen = []
        for sub, age in alive_entries(frame):
            vp = node.subs.get(sub) if isinstance(sub, int) else None
            if vp is not None:
                seen.append((vp, now - age / 1000.0))
        if seen:
            self._put((node, {"t": "_alive", "seen": seen}, now))

    # ------------------------------------------------------------ caller side
    def send(self, peer: Peer, obj: dict[str, Any]) -> bool:
        if peer.via is not None:
            peer, obj = peer.via, {"t": RELAY, "c": peer.sub, "m": obj}
        try:
            with peer.lock:
                peer.sock.sendall(encode(obj))
            return True
        except OSError:
            return False

    def peers(self, role: str | None = None) -> list[Peer]:
        return [
            p for p in list(self._peers.values()) if p.authed and (role is None or p.role == role)
        ]

    def nodes(self) -> list[Peer]:
        """The connected node agents."""
        return self.peers(ROLE_NODE)

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for peer in list(self._peers.values()):
            try:
                peer.sock.close()
            except OSError:
                pass
        for s in (self._listen, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass


def batch_entry(node: Peer, frame: dict[str, Any]) -> dict[str, Any]:
    """A node's ``b`` frame as the supervisor's inbox entry ``{"t": "_batch", "items": [(rank
    peer, message, like)], "n": rank messages}``, in the order sent (``unbatch`` rebuilds the
    step records). A line of a connection the node never said hello for is dropped, as a relayed
    one is. A folded line of begin beats stays ONE item for all its ranks (``_begun``, ``BEGUN``):
    no tuple a rank in the channel thread, which shares the GIL with the handlers (at 131,072
    ranks the expansion alone was a third of that thread)."""
    items: list = []
    likes: list = []
    sums: list = []
    folds: dict = {}
    place: list = []  # a pair's place -> its item's (None: dropped)
    subs, n = node.subs, 0
    for i, ((sub, msg), like) in enumerate(zip(unbatch(frame, likes, sums, folds), likes)):
        if i in folds:
            vps = peers_of(node, [sub, *folds[i]])
            place.append(len(items) if vps else None)
            if vps:
                items.append((vps[0], {"t": "_begun", "beat": msg, "ranks": vps}, BEGUN))
                n += len(vps)
            continue
        vp = subs.get(sub) if type(sub) is int else None
        place.append(len(items) if vp is not None else None)
        if vp is not None:
            items.append((vp, msg, like))
            n += 1
    if sums:
        _with_summaries(node, items, place, sums)
    return {"t": "_batch", "items": items, "n": n}


def peers_of(node: Peer, cids: list) -> list[Peer]:
    """The peers of a list of a node's connections (those it never said hello for left out),
    remembered a list until its connections change: a relay names the same ~511 connections in
    its folded beats and its summary every step, and a lookup a rank a step was a fifth of the
    channel thread at 131,072 ranks. The list returned is shared: read it, never change it."""
    try:
        key = tuple(cids)
        hit = node.lists.get(key)
    except TypeError:  # an entry that does not hash: no connection's number
        key, hit = None, None
    if hit is None:
        subs = node.subs
        hit = [subs[c] for c in cids if type(c) is int and c in subs]
        if key is not None:
            if len(node.lists) >= 64:
                node.lists.clear()
            node.lists[key] = hit
    return hit


def batch_items(msg: dict[str, Any]) -> list[tuple[Peer, dict[str, Any], Any]]:
    """A ``_batch`` inbox entry's (rank peer, message, like), a folded line of begin beats
    (``_begun``) one a rank again: the messages as their ranks sent them, for a reader that is
    not the supervisor's handlers (a test, a bench)."""
    out = []
    for vp, m, like in msg.get("items") or ():
        if like is BEGUN:
            out += [(p, m["beat"], None) for p in m["ranks"]]
        else:
            out.append((vp, m, like))
    return out


def _with_summaries(node: Peer, items: list, place: list, sums: list) -> None:
    """A frame's summaries (``unbatch``) put into its items where they stood, as ``(leader's
    peer, {"t": "_summary", "lead": its record, "ranks": [peers], "entry", "lead_out",
    "names"}, SUMMED)``: ``SUMMED`` is no message's, so no rank's line can pass for one. A
    summary whose leader's line was dropped is dropped; so is a rank its node never said hello
    for."""
    kept = [0]  # kept[i]: items among the first i pairs
    for p in place:
        kept.append(kept[-1] + (p is not None))
    for at, lead, cids, entry, lead_out, names in reversed(sums):
        i = place[lead]
        if i is None:
            continue
        vp, msg, _ = items[i]
        peers = peers_of(node, cids)
        summary = {
            "t": "_summary",
            "lead": msg["rec"],
            "ranks": peers,
            "entry": entry,
            "lead_out": lead_out,
            "names": names,
        }
        items.insert(kept[at], (vp, summary, SUMMED))
