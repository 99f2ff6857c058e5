"""The supervisor channel: TCP, one JSON object per line, token-authenticated.

The supervisor listens (``127.0.0.1`` and a free port by default; the recipe's
``[supervisor].channel_host`` / ``channel_port`` change that for multi-node
runs); every node agent gets the address and a random token, and passes its own
loopback address and token to its ranks in ``PTOPS_CHANNEL`` (``host:port``) and
``PTOPS_CHANNEL_TOKEN``. No shared filesystem is assumed: agents on other hosts
only need to reach the address. A local run is a one-node run: the same agent.

Every connection starts with a hello line (a rank's, to its agent)::

    {"t": "hello", "token": "...", "role": "rank", "rank": 0, "pid": 123, "host": "n1", "attempt": 1}

A connection with a wrong token is closed without an answer; the supervisor closes
an authenticated one whose role is not ``node`` or ``control`` after one
``{"error": ...}`` line (a rank connects to its agent, never to the supervisor).
After the hello, ranks send ``beat`` / ``ping`` / ``metrics`` / ``fault`` / ``stacks`` / ``exit``
messages, and the supervisor sends commands (``{"cmd": "stacks", "id": 1}``,
``{"cmd": "stop", ...}``, ``{"cmd": "fault", ...}``), relayed by the agent. ``role: "control"``
connections (``ptops inject``) send one request and read one answer.

Node relay (every run, ``ops/node/agent.py``): the ranks of a node connect to their
node agent on loopback exactly as above (the agent's own address and token), and the agent
carries all of them over ONE connection to the supervisor, opened with::

    {"t": "hello", "token": "...", "role": "node", "node": "n2", "node_rank": 1, "pid": 77, "host": "n2", "attempt": 1}

Frames on that connection (one JSON object per line, as everywhere):

- agent -> supervisor ``{"t": "r", "c": 3, "m": {...}}``: message ``m`` of the agent's local rank
  connection ``c`` (the agent's own number). The first ``m`` of a ``c`` is that rank's hello with
  the token removed (the agent checked it); the supervisor then sees a virtual peer per ``c`` and
  every later ``m`` exactly as the rank sent it (the handlers see per-rank messages).
- agent -> supervisor ``{"t": "g", "c": 3}``: connection ``c`` closed (the supervisor's ``_eof``).
- supervisor -> agent ``{"t": "r", "c": 3, "m": {"cmd": ...}}``: a command for rank ``c``.
- supervisor -> agent ``{"t": "ka"}`` every ``KEEPALIVE_S``: the agent kills its ranks when the
  supervisor's connection closes or stays silent for ``PTOPS_NODE_UPSTREAM_TIMEOUT_S``
  (a network cut gives no EOF).
- supervisor -> agent at a hang ``{"cmd": "dump", "id": N, "timeout_s": T, "ranks": {"RANK": {"c": 3,
  "pid": PID, "ask": true}}}`` -> the agent asks each ``ask`` rank for its own dump (its answer is
  kept, not relayed), runs py-spy on the others and on those silent for ``T`` s (the supervisor
  cannot ptrace a process on another host), and replies ONCE ``{"t": "node_stacks", "id": N,
  "stacks": {"RANK": {"text": "...", "note": "channel" | py-spy's note, "pid": PID}}}`` (kept
  beside the supervisor's inbox, never behind its backlog); the supervisor writes one file a node;
  ``{"cmd": "kill"}``.
- agent -> supervisor ``{"t": "node_exit", "code": RC}`` when its torchrun ended.
- agent -> supervisor ``{"t": "a", "c": [3, 4], "ms": [120, 870]}`` every ``ALIVE_S``: the node's
  liveness in one line. The agent keeps its ranks' ``ping`` lines (liveness only, no progress) to
  itself and lists instead every rank connection ``c`` that sent any line since its previous
  ``a`` frame, with the age of that line in ms when the frame left (ages, not timestamps: the
  supervisor subtracts them from its own receive time, so no clock crosses hosts), but for the ranks
  whose beat or step record went up in a batch since that frame (each one already told the
  supervisor the rank lives): at 1 s steps the frame is then empty and not sent. One line a
  node a second replaces a ping a rank a second: 8x fewer messages at 8 ranks a node, 2/3 of
  what a 4 s step sent.

- agent -> supervisor ``{"t": "b", "c": [3, 4, 3], "k": [{...}], "m": [{...}, {...}, {...}]}``:
  every other line of its ranks, batched (``Batcher``): message ``m[i]`` of connection ``c[i]``, in
  the order each rank sent them, held at most ``BATCH_S`` (20 ms). A step record may come as the
  differences from its step's first record in the frame: ``{"t": "metrics", "rec": {changed keys},
  "_k": j}`` is ``rec = {**k[j], **changed}`` (same keys, same order; ``unbatch``). One frame a
  node every few ms replaces a frame a line (the start-up burst: ~50 lines a node), and the
  records' common values cross once. The beats that begin one step (``{"t": "beat",
  "step": N, "phase": "step", "stage": "begin", "ts": T}``, no other key) of several ranks, each with
  nothing sent since the first's place, cross as the first's line with ``"_b": [c, ...]``: the same
  beat from those connections too (their own ``ts``, the rank's clock, is not carried: the
  supervisor stamps a beat on arrival). A rank's line holding ``_k`` or ``_b`` is dropped. Hellos, ``g`` and the agent's own frames stay
  single and leave after the batch before them.
  With ``[supervisor] node_summaries`` (``PTOPS_NODE_SUMMARY``: ``{"every": K, "read": [keys]}``)
  the frame may end in ``"s": [[at, j, [c, ...], {summary}, lead_out, [names]], ...]``: the
  group whose leader is ``m[j]`` had the ranks of connections ``c`` summed up instead of sent
  (``ops/runrecord/nodesummary.py``'s rule: on steps that are not a multiple of K, ranks that
  differ from their leader only in finite numbers of keys none of ``read``), the entry standing
  for them after ``m[at - 1]``; ``lead_out``: the summary holds the leader's values too (the
  file then leaves its record out), ``names``: the keys those ranks differ in.

Relays (``ops/node/relay.py``, at scale): ~64 agents connect to a relay exactly as to the supervisor
(the same hello and token), and the relay to the supervisor as one agent whose ranks live on several
hosts: the frames above both ways, under the relay's own numbers ``c``, its agents' ranks batched again
as one node's (one leader and one summary a step for all of them).

The agent checks that each rank line is a JSON object (a broken line is dropped, not its
neighbours') and puts it into the frame without re-encoding it, so a batch costs the supervisor
one JSON parse; only a step record that joins a group is re-encoded, by the agent.
"""  # noqa: E501

from __future__ import annotations

import json
import operator
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ptops import envnames
from ptops.ops.runrecord.nodesummary import sum_up, summary_entry

MAX_LINE = 16 * 1024 * 1024
ENV_ADDRESS = envnames.CHANNEL
ENV_TOKEN = envnames.CHANNEL_TOKEN


ROLE_NODE = "node"
ROLE_CONTROL = "control"  # `ptops inject`, `ptops profile`, ...: a client of the supervisor
RELAY = "r"  # a relayed rank message
RELAY_GONE = "g"  # a relayed rank connection closed
KEEPALIVE = "ka"
KEEPALIVE_S = 2.0
ALIVE = "a"  # a node's liveness summary (its ranks' pings, absorbed by the agent)
ALIVE_S = 1.0  # how often an agent sends it: the probe's default heartbeat
PING_PREFIX = b'{"t":"ping"'  # a rank's ping line as ``encode`` writes it (the agent keeps these)
# a rank's step lines (beats, step records): the supervisor counts each as a sign of life
# (``HangMonitor._saw``), so a rank that sent one since the last ``a`` frame is not listed in it
STEP_PREFIXES = (b'{"t":"beat"', b'{"t":"metrics"')
STEP_KINDS = frozenset(("beat", "metrics"))


def alive_entries(frame: dict[str, Any]) -> list[tuple[Any, float]]:
    """An ``a`` frame's (connection, age in ms) pairs with a well-formed age (a number, under an
    hour); none when its lists do not pair up. The caller looks each connection up."""
    subs, ages = frame.get("c"), frame.get("ms")
    if not isinstance(subs, list) or not isinstance(ages, list) or len(subs) != len(ages):
        return []
    return [
        (sub, age)
        for sub, age in zip(subs, ages)
        if isinstance(age, (int, float)) and 0 <= age < 3.6e6
    ]


def alive_frame(
    heard: dict[int, float], stepped: set, known: Any, now: float
) -> dict[str, Any] | None:
    """An ``a`` frame (above): the connections of ``known`` heard since the last frame
    (``heard``: number -> when, monotonic) but those in ``stepped`` (their beat or record went up:
    a sign of life already), with the ages in ms at ``now``; None when none is left. The agent's
    rule and its relay's."""
    live = sorted((c, at) for c, at in heard.items() if c in known and c not in stepped)
    if not live:
        return None
    ages = [max(0, round((now - at) * 1e3)) for _, at in live]
    return {"t": ALIVE, "c": [c for c, _ in live], "ms": ages}


def relay_frame(cid: int, raw: bytes) -> bytes:
    """One relayed rank line (``raw``: a JSON object without its newline), as sent upstream."""
    return b'{"t":"r","c":%d,"m":%s}\n' % (cid, raw)


BATCH = "b"  # a node's rank lines of a few ms in one frame
BATCH_S = 0.02  # the longest an agent holds a rank's line before its batch leaves
BATCH_BYTES = 256 * 1024  # a batch this large leaves at once
SUMMARY_ENV = envnames.NODE_SUMMARY  # ``node_summaries``: {"every": K, "read": [keys] or null}
SUMMED = object()  # ``unbatch``'s like for a summary: from the frame's ``s``, never a message
BEGUN = object()  # the supervisor's like for a folded line of begin beats (``_b``), never a message


def relay_group(raw: str | None, node_rank: int) -> tuple[str, int, bool] | None:
    """(the group's relay host, its port, whether this node hosts it) under ``PTOPS_RELAYS``: the
    first node of every ``every`` in ``nodes`` relays its group (``ops/node/relay.py``); None
    (straight to the supervisor) when unset or not for this node."""
    try:
        cfg = json.loads(raw or "null")
        every, port, nodes = int(cfg["every"]), int(cfg["port"]), cfg["nodes"]
    except (ValueError, TypeError, KeyError):
        return None
    if every < 1 or not 0 <= node_rank < len(nodes) or not 0 < port < 65536:
        return None
    head = nodes[node_rank // every * every]
    return (head, port, node_rank % every == 0) if isinstance(head, str) else None


def summary_settings(raw: str | None) -> tuple[int, frozenset | None]:
    """(every, read) of ``PTOPS_NODE_SUMMARY``; (1, None), sum nothing up, when absent or
    malformed (a node that cannot read its settings sends every rank whole: the safe way)."""
    try:
        cfg = json.loads(raw or "null")
        every, read = int(cfg["every"]), cfg["read"]
    except (ValueError, TypeError, KeyError):
        return 1, None
    if not isinstance(read, list) or not all(isinstance(k, str) for k in read):
        return 1, None
    return max(1, every), frozenset(read)


_COMPACT = {"separators": (",", ":")}  # a line as ``encode`` writes it, without its newline


class Batcher:
    """A node agent's rank lines, gathered for up to ``BATCH_S`` and sent as ONE ``b`` frame.

    Why: at thousands of nodes the supervisor's channel thread paid a ``recv`` slice, a JSON parse
    and a queue entry per rank line; the start-up burst alone was ~50 lines a node. A batch is one
    parse and one queue entry. Its step records are also told as differences: ranks of one step
    mostly log the same values, so the first record of a step in the batch (the leader) goes whole
    in ``k`` and each later one as the keys whose values differ (``"_k": i`` names the leader).
    Lossless: only a record with exactly the leader's keys in the leader's order is cut, and a
    value is left out only when the leader's is the same JSON scalar, so ``{**leader, **diff}``
    is the record, key order included. A rank's own lines keep their order: a record joins its
    step's group only if its rank sent nothing since the group's place in the batch.

    ``hold_s`` (a relay's; 0 for an agent, whose 8 ranks make no cohort): a batch whose newest step
    has fewer ranks so far, of records or of begin beats, than the step before it had is held up
    to ``hold_s`` past its oldest line instead of ``BATCH_S``, and a group's members leave in the
    order of their connections' numbers, the lowest leading, whatever order they came in. So a
    step that reaches the relay in its agents' several frames leaves as ONE group and the same
    ranks make the same list every step: the supervisor's cohorts match lists
    (``HangMonitor.observe_ranks``, ``SharedRankedMonitor.repeat_group``); pieces that differ
    from step to step it would take rank by rank. Why here: only the relay sees all its nodes'
    frames; a node's ranks finish a step within a few ms (their collectives), 64 nodes' frames
    over tens of ms. (The order among ranks of one step is the relay's to choose: they run on
    different hosts, and ranks of two attempts never share a relay's link.)
    """

    def __init__(self, every: int = 1, read: frozenset | None = None, hold_s: float = 0.0) -> None:
        self.items: list[tuple[int, bytes, dict | None]] = []  # (cid, line, parsed step record)
        # ``node_summaries``: routine ranks every K steps only, else summed up (module docstring)
        self.every, self.read = every, read
        self.size = 0
        self.since: float | None = None  # when the oldest line waiting arrived (monotonic)
        self.hold_s = hold_s
        # kind (REC, BEGIN) -> [its newest step, its lines so far, the lines of the step before]
        self._steps: dict[int, list[int]] = {}

    def add(
        self, cid: int, raw: bytes | None, now: float, parsed: dict | None = None, size: int = 0
    ) -> bool:
        """Queue one rank line; False (dropped) when it is no JSON object: it goes into the frame
        as it is, and a broken line must not break its neighbours' frame. ``parsed``: the line's
        object, from a caller that made the line from it (a load generator, a relay), never from
        a rank; with it ``raw`` may be None for a step record or a begin beat (encoded only if it
        leaves alone: in a group it leaves as its differences, or folded), ``size`` then its
        bytes' estimate."""
        try:
            msg = json.loads(raw) if parsed is None else parsed
        except (ValueError, TypeError):
            return False
        if not isinstance(msg, dict) or "_k" in msg or "_b" in msg:  # (the frame's own keys)
            return False
        if msg.get("t") == "metrics":
            rec = msg.get("rec")
            kind = REC if isinstance(rec, dict) and type(rec.get("step")) is int else LINE
        else:
            kind = BEGIN if msg.keys() <= _BEGIN_KEYS and begins(msg) else LINE
        if kind == LINE and raw is None:  # (records and begin beats: encoded if they leave alone)
            raw = json.dumps(msg, **_COMPACT).encode()
        elif kind and self.hold_s:
            self._count(kind, msg["rec"]["step"] if kind == REC else msg["step"])
        self.items.append((cid, raw, msg if kind else None, kind))
        self.size += len(raw) if raw is not None else size
        if self.since is None:
            self.since = now
        return True

    def _count(self, kind: int, step: int) -> None:
        s = self._steps.get(kind)
        if s is None:
            self._steps[kind] = [step, 1, 0]
        elif step == s[0]:
            s[1] += 1
        elif step > s[0]:  # (an older step's line, a late rank's, counts for none)
            self._steps[kind] = [step, 1, s[1]]

    def holding(self, now: float) -> bool:
        """Whether a step's group is still short of the ranks its step before had (``hold_s``)."""
        return (
            self.since is not None
            and now - self.since < self.hold_s
            and any(s[1] < s[2] for s in self._steps.values())
        )

    def due(self, now: float) -> bool:
        if self.since is None:
            return False
        if self.size >= BATCH_BYTES:
            return True
        return now - self.since >= BATCH_S and not (self.hold_s and self.holding(now))

    def wait_s(self, now: float, idle: float) -> float:
        """How long the relay may wait for more lines before this batch is due."""
        if self.since is None:
            return idle
        hold = self.hold_s if self.hold_s and self.holding(now) else BATCH_S
        return max(0.0, self.since + hold - now)

    def frame(self) -> bytes | None:
        """The waiting lines as one frame (None when none), and an empty batch."""
        if not self.items:
            return None
        items, self.items, self.size, self.since = self.items, [], 0, None
        # entries in order: [cid, line] or a group [cid, line, message, members, place, kind]
        out: list[list] = []
        groups: dict[tuple[int, int], list] = {}  # (kind, step) -> its open group
        last: dict[int, int] = {}  # cid -> the place of its last line in ``out``
        for cid, raw, msg, kind in items:
            if kind:
                step = msg["rec"]["step"] if kind == REC else msg["step"]
                g = groups.get((kind, step))
                if (
                    g is not None
                    and last.get(cid, -1) < g[4]
                    and (kind == BEGIN or list(msg["rec"]) == list(g[2]["rec"]))
                ):
                    g[3].append((cid, msg))
                    last[cid] = g[4]
                    continue
                g = [cid, raw, msg, [], len(out), kind]
                groups[(kind, step)] = g
                out.append(g)
            else:
                out.append([cid, raw])
            last[cid] = len(out) - 1
        cids: list[int] = []
        lines: list[bytes] = []
        leaders: list[bytes] = []
        sums: list[list] = []
        for e in out:
            if len(e) == 2 or not e[3]:
                cids.append(e[0])
                lines.append(e[1] if e[1] is not None else json.dumps(e[2], **_COMPACT).encode())
                continue
            if self.hold_s:  # a relay's: one order (the class docstring)
                every_one = sorted([(e[0], e[2]), *e[3]], key=_CID)
                (e[0], e[2]), e[3] = every_one[0], every_one[1:]
            if e[5] == BEGIN:  # the step's begin beats of these ranks as one line
                cids.append(e[0])
                lines.append(json.dumps({**e[2], "_b": [c for c, _ in e[3]]}, **_COMPACT).encode())
                continue
            lead = e[2]["rec"]
            j = len(leaders)
            leaders.append(json.dumps(lead, separators=(",", ":")).encode())
            group = [(cid, msg, _diff(msg["rec"], lead)) for cid, msg in [(e[0], e[2])] + e[3]]
            left: Any = ()
            if self.every > 1:
                lead_out, out_at, entry = sum_up(
                    lead, [(m["rec"], d) for _, m, d in group[1:]], self.every, self.read
                )
                left = {i + 1 for i in out_at}
            at = len(lines)
            for i, (cid, msg, diff) in enumerate(group):
                if i in left:
                    continue
                cids.append(cid)
                lines.append(
                    json.dumps({**msg, "rec": diff, "_k": j}, separators=(",", ":")).encode()
                )
            if left:
                names = sorted({k for i in left for k in group[i][2] if k != "rank"})
                gone = [group[i][0] for i in sorted(left)]
                sums.append([len(lines), at, gone, entry, lead_out, names])
        tail = b',"s":%s' % json.dumps(sums, separators=(",", ":")).encode() if sums else b""
        return b'{"t":"b","c":[%s],"k":[%s],"m":[%s]%s}\n' % (
            ",".join(map(str, cids)).encode(),
            b",".join(leaders),
            b",".join(lines),
            tail,
        )


LINE, REC, BEGIN = 0, 1, 2  # a batched line: as it is, a step record, a beat that begins a step
_CID = operator.itemgetter(0)


_BEGIN_KEYS = frozenset(("t", "step", "phase", "stage", "ts"))  # a begin beat that may be folded


def begins(m: dict[str, Any]) -> bool:
    """A ``step`` beat that begins step ``m["step"]`` (an int)."""
    return (
        m.get("t") == "beat"
        and m.get("phase", "step") == "step"
        and m.get("stage") == "begin"
        and type(m.get("step")) is int
    )


def _diff(rec: dict[str, Any], lead: dict[str, Any]) -> dict[str, Any]:
    """``rec``'s values that are not the same JSON scalar as its leader's, as a record would be
    rebuilt from it: equal, of one type (1, 1.0 and True are not), a zero of one sign; containers
    never count as the same (kept per rank). One loop, no call a key: a relay diffs 512 records
    of ~25 keys a step, and a call a key was a fifth of its time."""
    out = {}
    for k, v in rec.items():
        w = lead[k]
        t = type(v)
        if t is not type(w) or v != w or t is list or t is dict:  # (JSON: exact types)
            out[k] = v
        elif t is float and v == 0.0 and str(v) != str(w):
            out[k] = v
    return out


def unbatch(
    frame: dict[str, Any],
    likes: list | None = None,
    sums: list | None = None,
    folds: dict | None = None,
) -> list[tuple[Any, dict[str, Any]]]:
    """A ``b`` frame's (cid, message) pairs in order, each step record whole again. Entries that do
    not parse as such (lengths that differ, a message that is no object, a leader index out of
    range) are dropped, never their neighbours.

    ``likes``, when given, gets one entry per pair: for a step record cut against its leader and
    not the leader itself, (the leader's ``rank``, the keys sent), else None. True by construction
    (every other key holds the leader's own value), so the supervisor may let its monitors treat
    the record as that rank's, but for those keys (``MonitorFeed.feed``); never read from a
    message, so no rank can claim it.

    ``sums``, when given, gets the frame's summaries (``node_summaries``) as ``(at, lead, cids,
    entry, lead_out, names)``: after the first ``at`` pairs returned, standing for the ranks of
    connections ``cids``, whose leader is pair ``lead``; one that does not parse, or whose leader
    was dropped or is no step record of the entry's step, is dropped.

    ``folds``, when given, keeps a line of begin beats folded (``_b``): ONE pair, its place in
    the pairs mapped to the other connections' list (the supervisor handles them as one); without
    it each rank gets its pair (a relay batches them again)."""
    cids, msgs, leaders = frame.get("c"), frame.get("m"), frame.get("k", [])
    if (
        not isinstance(cids, list)
        or not isinstance(msgs, list)
        or not isinstance(leaders, list)
        or len(cids) != len(msgs)
    ):
        return []
    out = []
    seen: set[int] = set()  # leaders whose own record went out whole
    place: list = []  # m's index -> its (first) pair's place in ``out`` (None: dropped)
    kept = []  # kept[i]: pairs made of the first i messages
    for cid, msg in zip(cids, msgs):
        kept.append(len(out))
        place.append(None)
        if not isinstance(msg, dict):
            continue
        like = None
        if "_b" in msg:  # a step's begin beats: one pair a rank, all of them this one message
            also = msg.pop("_b")
            if not isinstance(also, list) or not begins(msg) or msg.keys() - _BEGIN_KEYS:
                continue
            place[-1] = len(out)
            if folds is not None:
                folds[len(out)] = also
                also = ()
            for c in [cid, *also]:
                out.append((c, msg))
            if likes is not None:
                likes.extend([None] * (1 + len(also)))
            continue
        if "_k" in msg:
            j, rec = msg.pop("_k"), msg.get("rec")
            if (
                type(j) is not int
                or not 0 <= j < len(leaders)
                or not isinstance(leaders[j], dict)
                or not isinstance(rec, dict)
            ):
                continue
            if j in seen:
                like = (leaders[j].get("rank"), frozenset(rec))
            elif not rec:  # the leader itself (the Batcher sends it first, nothing cut away)
                seen.add(j)
            full = dict(leaders[j])
            full.update(rec)
            msg["rec"] = full
        place[-1] = len(out)
        out.append((cid, msg))
        if likes is not None:
            likes.append(like)
    kept.append(len(out))
    if sums is not None and frame.get("s"):
        _summaries(frame["s"], out, place, kept, sums)
    return out


def _summaries(raw: Any, out: list, place: list, kept: list, sums: list) -> None:
    """``unbatch``'s summaries, each checked (an agent is trusted, its frame is still parsed)."""
    if not isinstance(raw, list):
        return
    for s in raw:
        if not (isinstance(s, list) and len(s) == 6):
            continue
        at, j, cids, entry, lead_out, names = s
        entry = summary_entry(entry)
        if (
            type(at) is not int
            or type(j) is not int
            or not 0 <= j < at <= len(place)
            or place[j] is None
            or entry is None
            or not isinstance(cids, list)
            or not all(type(c) is int for c in cids)
            or type(lead_out) is not bool
            or not isinstance(names, list)
            or not all(isinstance(k, str) for k in names)
        ):
            continue
        rec = out[place[j]][1].get("rec")
        if not isinstance(rec, dict) or rec.get("step") != entry["step"]:
            continue
        sums.append((kept[at], place[j], cids, entry, lead_out, frozenset(names)))


def take_lines(buf: bytearray) -> Iterator[bytes]:
    """The complete lines in ``buf``, removed from it (a partial line stays for the next
    ``recv``). Every end of the channel reads its stream this way: rank, node agent, supervisor.
    The lines read are cut off once, when the caller is done (or stops early: what it did not take
    is left), not one by one: a 64 KB read of a node's frames holds ~100 lines, and moving the rest
    of the buffer after each cost ~3 us a line on the supervisor's channel thread."""
    start = 0
    try:
        while True:
            i = buf.find(b"\n", start)
            if i < 0:
                return
            raw = bytes(buf[start:i])
            start = i + 1
            yield raw
    finally:
        if start:
            del buf[:start]


def new_token() -> str:
    return secrets.token_hex(32)


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), allow_nan=True) + "\n").encode()


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdecimal():
        raise ValueError(f"channel address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class ChannelClient:
    """The rank (or control) side. ``on_message`` runs on the reader thread; ``on_eof`` once."""

    def __init__(
        self,
        address: str,
        token: str,
        hello: dict[str, Any],
        on_message: Callable[[dict[str, Any]], None] | None = None,
        on_eof: Callable[[], None] | None = None,
        connect_timeout: float = 30.0,
    ):
        host, port = split_address(address)
        deadline = time.monotonic() + connect_timeout
        last: OSError | None = None
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as e:
                last = e
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"cannot reach the supervisor channel at {address}: {last}"
                    ) from None
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self.broken = False
        self.on_message = on_message
        self.on_eof = on_eof
        self.send({"t": "hello", "token": token, **hello})
        self._reader: threading.Thread | None = None
        if on_message is not None or on_eof is not None:
            self._reader = threading.Thread(
                target=self._read_loop, name="ptops-probe-reader", daemon=True
            )
            self._reader.start()

    def send(self, obj: dict[str, Any]) -> bool:
        if self.broken:
            return False
        try:
            with self._lock:
                self.sock.sendall(encode(obj))
            return True
        except OSError:
            self.broken = True
            return False

    def send_raw(self, data: bytes) -> bool:
        """An already encoded line (the node agent's relay)."""
        if self.broken:
            return False
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            self.broken = True
            return False

    def _lines(self):
        buf = bytearray()
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            buf += data
            for raw in take_lines(buf):
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                if isinstance(msg, dict):
                    yield msg

    def _read_loop(self) -> None:
        for msg in self._lines():
            if self.on_message is not None:
                try:
                    self.on_message(msg)
                except Exception:  # a bad command must not kill the reader
                    pass
        self.broken = True
        if self.on_eof is not None:
            self.on_eof()

    def request(self, obj: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """Control connections: send one request and wait for one answer line."""
        self.send(obj)
        self.sock.settimeout(timeout)
        for msg in self._lines():
            return msg
        raise ConnectionError("the supervisor closed the channel without answering")

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # sends FIN and wakes our own reader thread
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------- the private address file


def write_info(path: Path, address: str, token: str, pid: int) -> None:
    """``RUN_DIR/supervisor/channel.json``: address + token for ``ptops inject`` (0600 in a 0700
    dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "token": token, "pid": pid}, f)
    os.replace(tmp, path)


def read_info(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
